// Both I/O engines, by content, on real files: odd sizes, short reads, per-request errors,
// a full file-size limit, and draining on teardown.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "segments.hpp"
#include "tensormem/io/file_io.hpp"
#include "tensormem/io/io_engine.hpp"

namespace tensormem::io {
namespace {

// Whether this process holds CAP_IPC_LOCK (bit 14 of its effective capabilities), so that no
// limit on locked memory applies to it.
bool may_lock_any_amount() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("CapEff:", 0) == 0) return ((std::stoull(line.substr(7), nullptr, 16) >> 14) & 1U) != 0;
  }
  return false;
}

class io_engine_test : public ::testing::TestWithParam<engine_kind> {
 protected:
  void SetUp() override {
    if (GetParam() == engine_kind::uring) {
      try {
        engine_ = make_uring_engine(16);
      } catch (const std::system_error& e) {
        GTEST_SKIP() << "io_uring unavailable here: " << e.what();
      }
    } else {
      engine_ = make_thread_engine(16, 4);
    }
    char name[] = "/tmp/tensormem-io-XXXXXX";
    fd_ = mkstemp(name);
    ASSERT_GE(fd_, 0);
    path_ = name;
  }
  void TearDown() override {
    engine_.reset();
    if (fd_ >= 0) close(fd_);
    if (!path_.empty()) std::filesystem::remove(path_);
  }
  std::unique_ptr<io_engine> engine_;
  int fd_ = -1;
  std::string path_;
};

std::vector<io_completion> wait_all(io_engine& e) {
  std::vector<io_completion> all;
  while (e.outstanding() != 0) {
    auto some = e.wait(1);
    all.insert(all.end(), some.begin(), some.end());
  }
  return all;
}

TEST_P(io_engine_test, round_trips_odd_sizes_by_content) {
  std::mt19937_64 rng(1);
  std::vector<std::vector<char>> data;
  std::vector<io_request> writes;
  std::uint64_t offset = 0;
  for (std::uint64_t i = 0; i < 200; ++i) {
    const std::size_t bytes = i % 50 == 0 ? (std::size_t{3} << 20) + i : 1 + rng() % 70000;
    data.emplace_back(bytes);
    for (char& c : data.back()) c = static_cast<char>(rng());
    writes.push_back({fd_, offset, data.back().data(), bytes, true, i});
    offset += bytes + rng() % 5000;
  }
  engine_->submit(writes);
  for (const io_completion& c : wait_all(*engine_)) {
    ASSERT_EQ(c.result, static_cast<std::int64_t>(c.bytes)) << "write " << c.user_data;
  }
  std::vector<std::vector<char>> back;
  std::vector<io_request> reads;
  for (std::size_t i = 0; i < writes.size(); ++i) {
    back.emplace_back(writes[i].bytes);
    reads.push_back({fd_, writes[i].offset, back.back().data(), writes[i].bytes, false, i});
  }
  engine_->submit(reads);
  const auto done = wait_all(*engine_);
  ASSERT_EQ(done.size(), reads.size());
  for (const io_completion& c : done) {
    ASSERT_EQ(c.result, static_cast<std::int64_t>(c.bytes));
    EXPECT_EQ(back[c.user_data], data[c.user_data]) << "read " << c.user_data;
  }
}

// Two-segment requests (a header page and its data in one preadv/pwritev): by content,
// with random sizes, and short where the file ends inside either segment.
TEST_P(io_engine_test, two_segment_requests_round_trip_and_end_short) {
  std::mt19937_64 rng(7);
  std::vector<std::vector<char>> first, second;
  std::vector<io_request> writes;
  std::uint64_t offset = 0;
  for (std::uint64_t i = 0; i < 100; ++i) {
    first.emplace_back(1 + rng() % 9000);
    second.emplace_back(i % 25 == 0 ? (std::size_t{2} << 20) + i : 1 + rng() % 70000);
    for (auto* v : {&first.back(), &second.back()}) {
      for (char& c : *v) c = static_cast<char>(rng());
    }
    writes.push_back({fd_, offset, first.back().data(), first.back().size(), true, i,
                      second.back().data(), second.back().size()});
    offset += writes.back().total() + rng() % 3000;
  }
  engine_->submit(writes);
  for (const io_completion& c : wait_all(*engine_)) {
    ASSERT_EQ(c.bytes, writes[c.user_data].total());
    ASSERT_EQ(c.result, static_cast<std::int64_t>(c.bytes)) << "write " << c.user_data;
  }
  std::vector<std::vector<char>> back1, back2;
  std::vector<io_request> reads;
  for (std::size_t i = 0; i < writes.size(); ++i) {
    back1.emplace_back(first[i].size());
    back2.emplace_back(second[i].size());
    reads.push_back({fd_, writes[i].offset, back1.back().data(), back1.back().size(), false, i,
                     back2.back().data(), back2.back().size()});
  }
  engine_->submit(reads);
  for (const io_completion& c : wait_all(*engine_)) {
    ASSERT_EQ(c.result, static_cast<std::int64_t>(c.bytes));
    EXPECT_EQ(back1[c.user_data], first[c.user_data]) << "read " << c.user_data;
    EXPECT_EQ(back2[c.user_data], second[c.user_data]) << "read " << c.user_data;
  }
  // The file ends 100 bytes into the second segment, then inside the first.
  const auto end = static_cast<std::uint64_t>(lseek(fd_, 0, SEEK_END));
  std::vector<char> a(500), b(4000);
  const io_request tail[] = {{fd_, end - 600, a.data(), a.size(), false, 1, b.data(), b.size()},
                             {fd_, end - 200, a.data(), a.size(), false, 2, b.data(), b.size()}};
  engine_->submit({&tail[0], 1});
  EXPECT_EQ(wait_all(*engine_).at(0).result, 600);
  engine_->submit({&tail[1], 1});
  EXPECT_EQ(wait_all(*engine_).at(0).result, 200);
}

// What a request continues with after a short transfer: every split point of two segments.
TEST(io_segments, remaining_segments_cover_exactly_what_is_left) {
  std::vector<char> a(7), b(5);
  for (const std::size_t second : {std::size_t{0}, b.size()}) {
    const io_request r{3, 0, a.data(), a.size(), false, 0, second ? b.data() : nullptr, second};
    for (std::size_t done = 0; done <= r.total(); ++done) {
      iovec iov[2];
      const unsigned n = detail::remaining_segments(r, done, iov);
      std::size_t left = 0;
      for (unsigned k = 0; k < n; ++k) left += iov[k].iov_len;
      EXPECT_EQ(left, r.total() - done) << "done " << done;
      if (done < a.size()) {
        ASSERT_GE(n, 1U);
        EXPECT_EQ(iov[0].iov_base, a.data() + done);
        EXPECT_EQ(n, second ? 2U : 1U);
      } else if (done < r.total()) {
        ASSERT_EQ(n, 1U);
        EXPECT_EQ(iov[0].iov_base, b.data() + (done - a.size()));
      } else {
        EXPECT_EQ(n, 0U);
      }
    }
  }
}

TEST_P(io_engine_test, short_reads_and_per_request_errors) {
  std::vector<char> block(1000, 'x');
  io_request w{fd_, 0, block.data(), block.size(), true, 1};
  engine_->submit({&w, 1});
  ASSERT_EQ(wait_all(*engine_).at(0).result, 1000);
  std::vector<char> out(4096);
  const int read_only = open(path_.c_str(), O_RDONLY);
  ASSERT_GE(read_only, 0);
  const io_request requests[] = {
      {fd_, 500, out.data(), 4096, false, 10},            // past the end: short
      {read_only, 0, block.data(), 10, true, 11},         // write on a read-only fd
      {-1, 0, out.data(), 10, false, 12},                 // bad descriptor
      {fd_, 0, out.data(), 100, false, 13},               // fine
  };
  engine_->submit(requests);
  std::map<std::uint64_t, std::int64_t> result;
  for (const io_completion& c : wait_all(*engine_)) result[c.user_data] = c.result;
  close(read_only);
  EXPECT_EQ(result.at(10), 500);
  EXPECT_EQ(result.at(11), -EBADF);
  EXPECT_EQ(result.at(12), -EBADF);
  EXPECT_EQ(result.at(13), 100);
}

TEST_P(io_engine_test, queue_depth_bounds_what_is_in_flight_and_teardown_drains) {
  std::vector<char> block(1 << 16, 'y');
  std::vector<io_request> many;
  for (std::uint64_t i = 0; i < 500; ++i) many.push_back({fd_, i << 16, block.data(), block.size(), true, i});
  engine_->submit(many);
  EXPECT_EQ(engine_->outstanding(), 500U);
  const auto some = engine_->wait(10);
  EXPECT_GE(some.size(), 10U);
  engine_.reset();  // destroys with requests still outstanding: must drain, not crash
  EXPECT_GE(lseek(fd_, 0, SEEK_END), 0);
}

TEST_P(io_engine_test, file_size_limit_fails_the_write_it_hits) {
  // In a child: lower RLIMIT_FSIZE so that the third write cannot be made. The fixture's
  // engine is destroyed first: forking while its worker threads live could leave the child
  // with a lock some other thread held.
  engine_.reset();
  const engine_kind kind = GetParam();
  const std::string path = path_;
  const pid_t pid = fork();
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{1 << 20, 1 << 20};
    setrlimit(RLIMIT_FSIZE, &limit);
    std::string reason;
    auto engine = make_engine(kind, 8, reason);
    const int fd = open(path.c_str(), O_WRONLY | O_TRUNC);
    std::vector<char> block(1 << 19, 'z');
    const io_request w[] = {{fd, 0, block.data(), block.size(), true, 0},
                            {fd, 1 << 19, block.data(), block.size(), true, 1},
                            {fd, 1 << 20, block.data(), block.size(), true, 2}};
    engine->submit(w);
    std::map<std::uint64_t, std::int64_t> r;
    while (engine->outstanding() != 0) {
      for (const auto& c : engine->wait(1)) r[c.user_data] = c.result;
    }
    _exit(r[0] == (1 << 19) && r[1] == (1 << 19) && r[2] == -EFBIG ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST_P(io_engine_test, registered_buffers_carry_the_same_bytes) {
  std::vector<std::byte> region(std::size_t{1} << 20);
  std::vector<std::byte> plain(4096);
  const std::span<std::byte> regions[] = {std::span<std::byte>(region)};
  const bool registered = engine_->register_buffers(regions);
  if (GetParam() == engine_kind::threads) {
    EXPECT_FALSE(registered);
  } else if (may_lock_any_amount()) {
    EXPECT_TRUE(registered) << "io_uring refused fixed buffers to a process that may lock memory";
  }
  std::mt19937_64 rng(4);
  for (std::byte& b : region) b = static_cast<std::byte>(rng());
  for (std::byte& b : plain) b = static_cast<std::byte>(rng());
  const io_request writes[] = {{fd_, 0, region.data() + 4096, 65536, true, 1},   // inside the region
                               {fd_, 65536, plain.data(), plain.size(), true, 2}};  // outside it
  engine_->submit(writes);
  for (const auto& c : wait_all(*engine_)) ASSERT_EQ(c.result, static_cast<std::int64_t>(c.bytes));
  std::vector<std::byte> back(65536 + 4096);
  const io_request read{fd_, 0, region.data(), back.size(), false, 3};  // into the region
  engine_->submit({&read, 1});
  ASSERT_EQ(wait_all(*engine_).at(0).result, static_cast<std::int64_t>(back.size()));
  EXPECT_EQ(std::memcmp(region.data() + 65536, plain.data(), plain.size()), 0);
  EXPECT_FALSE(engine_->register_buffers(regions));  // only once
}

// A queue deeper than io_uring allows is the caller's error on either engine, and never a
// reason to fall back to threads (the kernel refuses such a ring with EINVAL).
TEST(io_engine, a_queue_deeper_than_io_uring_allows_is_an_argument_error) {
  EXPECT_THROW(make_thread_engine(max_queue_depth + 1, 4), std::invalid_argument);
  EXPECT_THROW(make_uring_engine(max_queue_depth + 1), std::invalid_argument);
  for (const engine_kind kind : {engine_kind::uring, engine_kind::threads}) {
    std::string why = "untouched";
    EXPECT_THROW(make_engine(kind, max_queue_depth + 1, why), std::invalid_argument);
  }
  EXPECT_EQ(make_thread_engine(max_queue_depth, 4)->queue_depth(), max_queue_depth);
  try {
    EXPECT_EQ(make_uring_engine(max_queue_depth)->queue_depth(), max_queue_depth);
  } catch (const std::system_error& e) {
    GTEST_SKIP() << "io_uring unavailable here: " << e.what();
  }
}

// The thread engine starts the threads asked for, at least one and no more than its queue
// depth (a thread more would have nothing to move).
TEST(io_engine, the_thread_engine_starts_the_threads_asked_within_its_queue_depth) {
  EXPECT_EQ(make_thread_engine(16, 3)->workers(), 3U);
  EXPECT_EQ(make_thread_engine(16, 1)->workers(), 1U);
  EXPECT_EQ(make_thread_engine(16, 0)->workers(), 1U);
  EXPECT_EQ(make_thread_engine(2, 8)->workers(), 2U);
  const auto smallest = make_thread_engine(0, 0);
  EXPECT_EQ(smallest->queue_depth(), 1U);
  EXPECT_EQ(smallest->workers(), 1U);
}

// wait(n) returns once n completions are ready, though other requests are still in flight:
// io_uring keeps a read of an empty pipe in flight until the pipe is written, and a wait for
// one completion returns a file's read meanwhile.
TEST(io_engine, a_wait_returns_what_is_ready_while_another_request_stays_in_flight) {
  std::unique_ptr<io_engine> e;
  try {
    e = make_uring_engine(4);
  } catch (const std::system_error& x) {
    GTEST_SKIP() << "io_uring unavailable here: " << x.what();
  }
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  char file_name[] = "/tmp/tensormem-wait-XXXXXX";
  const int file = ::mkstemp(file_name);
  ASSERT_GE(file, 0);
  ::unlink(file_name);
  const char data[] = "ready before the pipe";
  ASSERT_EQ(::pwrite(file, data, sizeof data, 0), static_cast<ssize_t>(sizeof data));
  char from_pipe[8] = {};
  char from_file[sizeof data] = {};
  const io_request stuck{pipe_fds[0], 0, from_pipe, sizeof from_pipe, false, 1};
  const io_request ready{file, 0, from_file, sizeof from_file, false, 2};
  e->submit({&stuck, 1});
  e->submit({&ready, 1});
  const std::vector<io_completion> first = e->wait(1);
  EXPECT_EQ(first.size(), 1U);
  if (!first.empty()) {
    EXPECT_EQ(first[0].user_data, 2U);
    EXPECT_EQ(first[0].result, static_cast<std::int64_t>(sizeof data));
  }
  EXPECT_EQ(e->outstanding(), 1U);
  ASSERT_EQ(::write(pipe_fds[1], "01234567", 8), 8);  // the pipe's read can now complete
  const std::vector<io_completion> second = e->wait(1);
  ASSERT_EQ(second.size(), 1U);
  EXPECT_EQ(second[0].user_data, 1U);
  EXPECT_EQ(second[0].result, 8);
  EXPECT_EQ(std::string(from_pipe, 8), "01234567");
  ::close(file);
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
}

// The names the statistics report an engine by.
TEST(io_engine, engines_are_named_in_the_statistics) {
  EXPECT_EQ(to_string(engine_kind::uring), "uring");
  EXPECT_EQ(to_string(engine_kind::threads), "threads");
  file_io_options options;
  options.engine = engine_kind::threads;
  EXPECT_EQ(async_file_io(options).stats().engine, "threads");
}

INSTANTIATE_TEST_SUITE_P(engines, io_engine_test,
                         ::testing::Values(engine_kind::uring, engine_kind::threads),
                         [](const auto& param_info) {
                           return std::string(to_string(param_info.param));
                         });

TEST(make_engine, reports_a_fallback) {
  std::string reason;
  auto e = make_engine(engine_kind::threads, 4, reason);
  EXPECT_EQ(e->kind(), engine_kind::threads);
  EXPECT_TRUE(reason.empty());
  auto u = make_engine(engine_kind::uring, 4, reason);
  if (u->kind() == engine_kind::threads) {
    EXPECT_NE(reason.find("io_uring unavailable"), std::string::npos) << reason;
  } else {
    EXPECT_TRUE(reason.empty());
  }
}

}  // namespace
}  // namespace tensormem::io
