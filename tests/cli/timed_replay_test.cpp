// The CLI's timed replays: how many, which timing is reported, and the determinism check.

#include "timed_replay.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/tlsf_allocator.hpp"

namespace tensormem::cli {
namespace {

std::vector<core::buffer> small_step() {
  std::vector<core::buffer> buffers;
  for (std::uint64_t i = 0; i < 40; ++i) {
    buffers.push_back({std::to_string(i), i, i + 1 + (i * 7) % 13, 256 + (i * 911) % 4096, std::nullopt});
  }
  return buffers;
}

// Best fit, with hooks: the first allocator made sleeps in its first allocation (a cold
// replay), and every allocator may report a peak of its own.
struct instrumented {
  static inline int made = 0;
  static inline bool distinct_peaks = false;
  core::best_fit_allocator inner;
  int serial;
  bool slept = false;

  instrumented(std::uint64_t capacity, std::uint64_t alignment) : inner(capacity, alignment), serial(made++) {}
  std::optional<core::allocation> allocate(std::uint64_t bytes) {
    if (serial == 0 && !slept) {
      slept = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return inner.allocate(bytes);
  }
  void deallocate(const core::allocation& a) { inner.deallocate(a); }
  std::uint64_t peak() const { return inner.peak() + (distinct_peaks ? static_cast<std::uint64_t>(serial) : 0); }
};

TEST(timed_replay, the_first_replay_gives_the_placement_and_the_median_the_time) {
  const auto buffers = small_step();
  core::tlsf_allocator once(core::growing, 256);
  const core::replay_result single = core::replay(buffers, once);

  const timed_replay t = replay_timed<core::tlsf_allocator>(buffers, 256, 10.0, 9);
  EXPECT_EQ(t.replays, 9U);  // the budget is far away: the count stops it
  EXPECT_EQ(t.first.offsets, single.offsets);
  EXPECT_EQ(t.first.high_water, single.high_water);
  EXPECT_EQ(t.first.operations, 2 * buffers.size());
  EXPECT_GT(t.ns_per_op, 0.0);
}

TEST(timed_replay, a_spent_budget_stops_after_one_replay) {
  const timed_replay t = replay_timed<core::best_fit_allocator>(small_step(), 256, 0.0, 1000);
  EXPECT_EQ(t.replays, 1U);
  EXPECT_DOUBLE_EQ(t.ns_per_op, t.first.seconds * 1e9 / static_cast<double>(t.first.operations));
}

TEST(timed_replay, a_slow_first_replay_does_not_set_the_figure) {
  instrumented::made = 0;
  instrumented::distinct_peaks = false;
  const auto buffers = small_step();
  const timed_replay t = replay_timed<instrumented>(buffers, 256, 10.0, 5);
  ASSERT_EQ(t.replays, 5U);
  const double first_ns = t.first.seconds * 1e9 / static_cast<double>(t.first.operations);
  EXPECT_GE(first_ns, 5e6 / static_cast<double>(t.first.operations));  // it slept 5 ms
  EXPECT_LT(t.ns_per_op * 10, first_ns);  // the median of five is one of the four fast ones
}

TEST(timed_replay, replays_that_disagree_are_a_bug_reported_as_such) {
  instrumented::made = 0;
  instrumented::distinct_peaks = true;
  try {
    (void)replay_timed<instrumented>(small_step(), 256, 10.0, 3);
    FAIL() << "no error";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("replay 2 reached a high-water mark"), std::string::npos) << e.what();
  }
  instrumented::distinct_peaks = false;
}

TEST(timed_replay, nothing_to_replay_is_one_replay_and_no_time) {
  const timed_replay t = replay_timed<core::best_fit_allocator>({}, 256);
  EXPECT_EQ(t.replays, 1U);
  EXPECT_EQ(t.first.operations, 0U);
  EXPECT_EQ(t.ns_per_op, 0.0);
}

}  // namespace
}  // namespace tensormem::cli
