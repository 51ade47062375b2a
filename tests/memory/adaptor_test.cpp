// Statistics, tracking and trace-logging wrappers.

#include <gtest/gtest.h>

#include <sstream>

#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/replay.hpp"
#include "tensormem/memory/host_resource.hpp"
#include "tensormem/memory/statistics_adaptor.hpp"
#include "tensormem/trace/trace_io.hpp"

namespace tensormem::memory {
namespace {

TEST(statistics_adaptor, counts_current_peak_and_total) {
  host_resource host;
  statistics_adaptor stats(host);
  void* a = stats.allocate(100);
  void* b = stats.allocate(300);
  stats.deallocate(a, 100);
  void* c = stats.allocate(50);
  const resource_counters c1 = stats.counters();
  EXPECT_EQ(c1.current_bytes, 350U);
  EXPECT_EQ(c1.peak_bytes, 400U);
  EXPECT_EQ(c1.total_bytes, 450U);
  EXPECT_EQ(c1.current_allocations, 2U);
  EXPECT_EQ(c1.peak_allocations, 2U);
  EXPECT_EQ(c1.total_allocations, 3U);
  EXPECT_EQ(c1.total_deallocations, 1U);
  stats.deallocate(b, 300);
  stats.deallocate(c, 50);
  EXPECT_EQ(stats.counters().current_bytes, 0U);
}

TEST(tracking_adaptor, reports_leaks_oldest_first) {
  host_resource host;
  tracking_adaptor tracking(host);
  void* a = tracking.allocate(10);
  void* b = tracking.allocate(20);
  void* c = tracking.allocate(30);
  tracking.deallocate(b, 20);
  EXPECT_EQ(tracking.outstanding(), 2U);
  EXPECT_EQ(tracking.outstanding_bytes(), 40U);
  const std::string report = tracking.leak_report();
  EXPECT_EQ(report.find("#0 "), 0U) << report;
  EXPECT_NE(report.find("#2 "), std::string::npos);
  EXPECT_EQ(report.find("#1 "), std::string::npos);
  tracking.deallocate(a, 10);
  tracking.deallocate(c, 30);
  EXPECT_EQ(tracking.leak_report(), "");
}

TEST(trace_log_adaptor, writes_a_trace_the_planner_reads) {
  host_resource host;
  std::ostringstream log;
  {
    trace_log_adaptor logger(host, log);
    void* a = logger.allocate(1000);  // t0
    void* b = logger.allocate(2000);  // t1
    logger.deallocate(a, 1000);       // t2
    void* c = logger.allocate(1000);  // t3
    logger.deallocate(b, 2000);       // t4
    (void)c;                          // still live at the end: flushed by the destructor
    logger.flush();
    host.deallocate(c, 1000);
  }
  std::istringstream in(log.str());
  const auto buffers = trace::read_trace(in, "log");
  ASSERT_EQ(buffers.size(), 3U);
  EXPECT_EQ(buffers[0].id, "a0");
  EXPECT_EQ(buffers[0].lower, 0U);
  EXPECT_EQ(buffers[0].upper, 2U);
  EXPECT_EQ(buffers[1].lower, 1U);
  EXPECT_EQ(buffers[1].upper, 4U);
  EXPECT_EQ(buffers[2].lower, 3U);
  EXPECT_EQ(buffers[2].upper, 6U);  // still live when flushed: one past the step after the last event
  EXPECT_EQ(core::lower_bound(buffers), 3000U);
  core::best_fit_allocator online(core::growing, 1);
  EXPECT_EQ(core::replay(buffers, online).high_water, 3000U);
}

}  // namespace
}  // namespace tensormem::memory
