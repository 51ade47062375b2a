// The io_uring engine when the kernel refuses: transient submit refusals are retried,
// hard submit and wait errors fail the requests (never a hang), and content stays right.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "uring_faults.hpp"

namespace tensormem::io {
namespace {

class uring_fault_test : public ::testing::Test {
 protected:
  void SetUp() override {
    io_uring probe{};
    if (io_uring_queue_init(2, &probe, 0) < 0) GTEST_SKIP() << "io_uring unavailable here";
    io_uring_queue_exit(&probe);
    char name[] = "/tmp/tensormem-uring-fault-XXXXXX";
    fd_ = mkstemp(name);
    ASSERT_GE(fd_, 0);
    path_ = name;
  }
  void TearDown() override {
    if (fd_ >= 0) close(fd_);
    if (!path_.empty()) std::filesystem::remove(path_);
  }
  std::vector<io_completion> run(io_engine& e, std::vector<std::vector<char>>& buffers, bool write) {
    std::vector<io_request> requests;
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      requests.push_back({fd_, i * 4096, buffers[i].data(), buffers[i].size(), write, i});
    }
    e.submit(requests);
    std::vector<io_completion> all;
    while (e.outstanding() != 0) {
      auto some = e.wait(1);
      if (some.empty()) break;  // a hang would be a failure of its own; never loop forever
      all.insert(all.end(), some.begin(), some.end());
    }
    return all;
  }
  // Writes each buffer of 4096 bytes to its page of the file, reads them back, and expects
  // every request to have moved all its bytes, and the same bytes back.
  void write_and_read_back(io_engine& e, std::vector<std::vector<char>>& out) {
    const auto written = run(e, out, true);
    ASSERT_EQ(written.size(), out.size());
    for (const auto& c : written) EXPECT_EQ(c.result, 4096) << c.user_data;
    std::vector<std::vector<char>> in(out.size(), std::vector<char>(4096));
    const auto read = run(e, in, false);
    ASSERT_EQ(read.size(), in.size());
    for (const auto& c : read) EXPECT_EQ(c.result, 4096) << c.user_data;
    for (std::size_t i = 0; i < in.size(); ++i) EXPECT_EQ(in[i], out[i]) << i;
  }
  int fd_ = -1;
  std::string path_;
};

TEST_F(uring_fault_test, transient_submit_refusals_are_retried) {
  int refusals = 0;
  detail::uring_faults faults;
  faults.submit = [&refusals](io_uring* ring) {
    // Every other call is refused as a busy kernel would, cycling through the codes.
    static const int codes[] = {-EBUSY, -EAGAIN, -EINTR};
    if (refusals < 30 && (refusals++ % 2) == 0) return codes[refusals % 3];
    return io_uring_submit(ring);
  };
  auto engine = detail::make_uring_engine(4, faults);
  std::vector<std::vector<char>> out(16, std::vector<char>(4096));
  for (std::size_t i = 0; i < out.size(); ++i) std::fill(out[i].begin(), out[i].end(), static_cast<char>('a' + i));
  write_and_read_back(*engine, out);
  EXPECT_GT(refusals, 0);
}

TEST_F(uring_fault_test, a_hard_submit_error_fails_the_requests_instead_of_hanging) {
  detail::uring_faults faults;
  faults.submit = [](io_uring*) { return -EINVAL; };
  auto engine = detail::make_uring_engine(4, faults);
  std::vector<std::vector<char>> out(10, std::vector<char>(4096, 'x'));
  const auto done = run(*engine, out, true);
  ASSERT_EQ(done.size(), out.size());
  for (const auto& c : done) EXPECT_EQ(c.result, -EINVAL);
  EXPECT_EQ(engine->outstanding(), 0U);
  // Later requests fail the same way, at once.
  const auto again = run(*engine, out, true);
  ASSERT_EQ(again.size(), out.size());
  for (const auto& c : again) EXPECT_EQ(c.result, -EINVAL);
}

TEST_F(uring_fault_test, a_hard_wait_error_fails_what_is_in_flight_and_teardown_ends) {
  detail::uring_faults faults;
  faults.wait = [](io_uring* ring, io_uring_cqe** cqe) {
    // Let the kernel finish for real (so no buffer is written after the test), then
    // report a hard error as a broken ring would.
    (void)io_uring_wait_cqe(ring, cqe);
    return -EBADF;
  };
  std::vector<std::vector<char>> out(8, std::vector<char>(4096, 'y'));
  {
    auto engine = detail::make_uring_engine(4, faults);
    const auto done = run(*engine, out, true);
    ASSERT_EQ(done.size(), out.size());
    int failed = 0;
    for (const auto& c : done) failed += c.result == -EBADF ? 1 : 0;
    EXPECT_GT(failed, 0);
    EXPECT_EQ(engine->outstanding(), 0U);
  }  // the destructor returns
}

// io_uring cancels a request it cannot start a kernel worker for (RLIMIT_NPROC): the engine
// moves it with blocking calls, from where the kernel's reports left it (after a short
// transfer too), counts it, and reports what those calls report: an error, or a file's end.
TEST_F(uring_fault_test, a_cancelled_request_is_moved_by_blocking_calls_and_counted) {
  int calls = 0;
  detail::uring_faults faults;
  faults.result = [&calls](int res) {
    switch (calls++ % 3) {
      case 0: return -ECANCELED;
      case 1: return res > 1 ? res / 2 : res;  // short: the engine continues from there
      default: return res;
    }
  };
  auto engine = detail::make_uring_engine(4, faults);
  std::vector<std::vector<char>> out(16, std::vector<char>(4096));
  for (std::size_t i = 0; i < out.size(); ++i) {
    for (std::size_t k = 0; k < out[i].size(); ++k) out[i][k] = static_cast<char>(i * 31 + k % 251);
  }
  write_and_read_back(*engine, out);
  const std::uint64_t moved = engine->synchronous_requests();
  EXPECT_GE(moved, 8U);  // a third of the completions, of at least 32 requests
  EXPECT_LE(moved, static_cast<std::uint64_t>(calls));

  // Past the file's end: the blocking read finds it (0 bytes), as the kernel's would.
  std::vector<char> beyond(4096);
  const io_request past{fd_, 1 << 20, beyond.data(), beyond.size(), false, 7};
  calls = 0;
  engine->submit({&past, 1});
  auto c = engine->wait(1);
  ASSERT_EQ(c.size(), 1U);
  EXPECT_EQ(c[0].result, 0);
  EXPECT_EQ(engine->synchronous_requests(), moved + 1);

  // A write to a descriptor open only for reading: the blocking call's error is the result.
  const int read_only = open(path_.c_str(), O_RDONLY);
  ASSERT_GE(read_only, 0);
  const io_request refused{read_only, 0, out[0].data(), 4096, true, 8};
  calls = 0;
  engine->submit({&refused, 1});
  c = engine->wait(1);
  close(read_only);
  ASSERT_EQ(c.size(), 1U);
  EXPECT_EQ(c[0].result, -EBADF);
  EXPECT_EQ(engine->synchronous_requests(), moved + 2);
}

// A completion the kernel reports as -EAGAIN or -EINTR is submitted again (the same bytes at
// the same offset, safe to repeat), and every request completes whole with the right bytes.
TEST_F(uring_fault_test, transient_completion_results_are_submitted_again) {
  int calls = 0;
  int transient = 0;
  detail::uring_faults faults;
  faults.result = [&](int res) {
    switch (calls++ % 3) {
      case 0:
        ++transient;
        return -EAGAIN;
      case 1:
        ++transient;
        return -EINTR;
      default:
        return res;
    }
  };
  auto engine = detail::make_uring_engine(4, faults);
  std::vector<std::vector<char>> out(12, std::vector<char>(4096));
  for (std::size_t i = 0; i < out.size(); ++i) {
    for (std::size_t k = 0; k < out[i].size(); ++k) out[i][k] = static_cast<char>(i * 17 + k % 241);
  }
  write_and_read_back(*engine, out);
  EXPECT_GE(transient, 2 * 24);  // two of every three completions, of the 24 requests and their retries
  EXPECT_EQ(engine->synchronous_requests(), 0U);
}

// A kernel whose io_uring lacks an operation the engine uses (before Linux 5.6: no plain read
// or write) sets a ring up, but every request would fail with EINVAL: the engine refuses to be
// made, naming the operation, so that make_engine's callers fall back to threads and say why.
TEST_F(uring_fault_test, a_kernel_without_an_operation_the_engine_uses_is_refused_at_construction) {
  for (const int lacking : {IORING_OP_READ, IORING_OP_WRITE, IORING_OP_READV, IORING_OP_WRITEV, IORING_OP_READ_FIXED,
                            IORING_OP_WRITE_FIXED}) {
    detail::uring_faults faults;
    faults.supported = [lacking](int opcode) { return opcode != lacking; };
    try {
      auto engine = detail::make_uring_engine(4, faults);
      ADD_FAILURE() << "made without operation " << lacking;
    } catch (const std::system_error& e) {
      EXPECT_EQ(e.code().value(), EOPNOTSUPP);
      EXPECT_NE(std::string(e.what()).find("io_uring of this kernel has no IORING_OP_"), std::string::npos) << e.what();
    }
  }
  detail::uring_faults all;
  all.supported = [](int) { return true; };
  std::vector<std::vector<char>> out(4, std::vector<char>(4096, 'z'));
  auto engine = detail::make_uring_engine(4, all);
  write_and_read_back(*engine, out);
}

}  // namespace
}  // namespace tensormem::io
