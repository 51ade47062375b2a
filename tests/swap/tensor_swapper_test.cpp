// The swapper, by content, on real files and both engines: odd sizes, checksums, misuse,
// a file-size limit, and O_DIRECT fallback on tmpfs.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <chrono>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <system_error>
#include <thread>
#include <string>
#include <vector>

#include "../memory/limited_child.hpp"
#include "swap_test_support.hpp"
#include "tensormem/memory/errors.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"
#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/swap/crc32c.hpp"
#include "tensormem/swap/tensor_swapper.hpp"

namespace tensormem::swap {
namespace {

namespace fs = std::filesystem;

class swap_dir {
 public:
  explicit swap_dir(const fs::path& parent = fs::temp_directory_path()) {
    std::string templ = (parent / "tensormem-swap-XXXXXX").string();
    if (mkdtemp(templ.data()) != nullptr) path_ = templ;
  }
  ~swap_dir() {
    if (!path_.empty()) fs::remove_all(path_);
  }
  bool ok() const { return !path_.empty(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void fill(std::byte* p, std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(rng());
}

TEST(crc32c, known_vector) {
  const char text[] = "123456789";
  EXPECT_EQ(crc32c(text, 9), 0xE3069283U);
  EXPECT_EQ(crc32c(text + 4, 5, crc32c(text, 4)), 0xE3069283U);
}

// The table used without SSE4.2 gives the same checksums as the instruction (where this
// processor has it): a file written on one machine is read on the other. Lengths around the
// instruction path's 8-byte words and 3 x 8 KiB lanes, from every start offset mod 8, continued.
TEST(crc32c, the_portable_table_agrees_with_the_known_vector_and_the_fast_path) {
  const char text[] = "123456789";
  EXPECT_EQ(detail::crc32c_portable(text, 9), 0xE3069283U);
  EXPECT_EQ(detail::crc32c_portable(text + 4, 5, detail::crc32c_portable(text, 4)), 0xE3069283U);
  EXPECT_EQ(detail::crc32c_portable(text, 0, 0x12345678U), 0x12345678U);
  std::mt19937_64 rng(11);
  std::vector<unsigned char> data(3 * 8192 * 2 + 64);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{9}, std::size_t{4096},
                              std::size_t{3 * 8192 - 1}, std::size_t{3 * 8192}, std::size_t{3 * 8192 + 1},
                              std::size_t{6 * 8192 + 17}}) {
    for (std::size_t start = 0; start < 8; ++start) {
      const std::uint32_t seed = static_cast<std::uint32_t>(rng());
      ASSERT_EQ(detail::crc32c_portable(data.data() + start, n, seed), crc32c(data.data() + start, n, seed))
          << n << " bytes from " << start;
    }
  }
}

TEST(crc32c, combine_matches_the_crc_of_the_concatenation) {
  std::mt19937_64 rng(4);
  std::vector<unsigned char> data(100'000);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t split = rng() % (data.size() + 1);
    const std::uint32_t a = crc32c(data.data(), split);
    const std::uint32_t b = crc32c(data.data() + split, data.size() - split);
    ASSERT_EQ(crc32c_combine(a, b, data.size() - split), crc32c(data.data(), data.size())) << split;
  }
  EXPECT_EQ(crc32c_combine(crc32c("1234", 4), crc32c("56789", 5), 5), 0xE3069283U);
}

class swapper_test : public ::testing::TestWithParam<io::engine_kind> {};

TEST_P(swapper_test, round_trips_odd_sizes_by_content) {
  swap_dir dir;
  ASSERT_TRUE(dir.ok());
  memory::pinned_pool pool({.slab_bytes = std::size_t{64} << 20});
  tensor_swapper swapper(pool, {.engine = GetParam(), .queue_depth = 16,
                                .block_bytes = std::size_t{1} << 20, .staging_buffers = 4});
  const std::vector<std::size_t> sizes = {1, 7, 4095, 4096, 4097, 100000, (std::size_t{1} << 20) + 13,
                                          std::size_t{3} << 20, std::size_t{64} << 20};
  std::vector<std::vector<std::byte>> plain;  // unaligned memory: staged under O_DIRECT
  std::vector<void*> pinned;                  // aligned memory: straight from the tensor
  std::vector<tensor_ref> out;
  std::vector<std::string> paths;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const bool aligned_case = i % 2 == 1;
    std::byte* p = nullptr;
    if (aligned_case) {
      p = static_cast<std::byte*>(pool.allocate(sizes[i], 4096));
      pinned.push_back(p);
    } else {
      plain.emplace_back(sizes[i] + 1);
      p = plain.back().data() + 1;  // deliberately misaligned
    }
    fill(p, sizes[i], i);
    out.push_back({p, sizes[i]});
    paths.push_back(dir.file("t" + std::to_string(i)));
  }
  for (const swap_result& r : swapper.wait(swapper.swap_out(out, paths))) {
    EXPECT_EQ(r.error, 0) << r.path << ": " << r.message;
  }
  // Wipe the tensors, read them back, compare.
  std::vector<std::vector<std::byte>> expected;
  for (const tensor_ref& t : out) {
    expected.emplace_back(static_cast<std::byte*>(t.data), static_cast<std::byte*>(t.data) + t.bytes);
    std::memset(t.data, 0, t.bytes);
  }
  for (const swap_result& r : swapper.wait(swapper.swap_in(paths, out))) {
    EXPECT_EQ(r.error, 0) << r.path << ": " << r.message;
  }
  for (std::size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(std::memcmp(out[i].data, expected[i].data(), out[i].bytes), 0) << "tensor " << i;
    EXPECT_EQ(fs::file_size(paths[i]), 4096 + (sizes[i] + 4095) / 4096 * 4096);
  }
  const swap_stats s = swapper.stats();
  EXPECT_EQ(s.tensors_out, sizes.size());
  EXPECT_EQ(s.tensors_in, sizes.size());
  EXPECT_GT(s.direct_bytes, 0U);
  if (s.direct) {
    EXPECT_GT(s.staged_bytes, 0U);
  }
  EXPECT_TRUE(s.checksums);
  for (void* p : pinned) pool.free(p);
}

TEST_P(swapper_test, checksum_catches_corruption_and_misuse_is_reported) {
  swap_dir dir;
  memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
  tensor_swapper swapper(pool, {.engine = GetParam(), .staging_buffers = 2});
  std::vector<std::byte> a(50000);
  fill(a.data(), a.size(), 9);
  const std::string path = dir.file("a");
  const tensor_ref t{a.data(), a.size()};
  ASSERT_EQ(swapper.wait(swapper.swap_out({&t, 1}, {&path, 1})).at(0).error, 0);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096 + 1234);
    f.put('\x5a');
  }
  const swap_result bad = swapper.wait(swapper.swap_in({&path, 1}, {&t, 1})).at(0);
  EXPECT_EQ(bad.error, EBADMSG) << bad.message;
  EXPECT_NE(bad.message.find("checksum mismatch"), std::string::npos);

  const std::string never = dir.file("never-written");
  const swap_result missing = swapper.wait(swapper.swap_in({&never, 1}, {&t, 1})).at(0);
  EXPECT_EQ(missing.error, ENOENT);
  EXPECT_EQ(missing.message, "cannot open " + never + ": " + std::strerror(ENOENT) +
                                 " (never swapped out, or discarded or removed since)");
  // Only a swap-in of a path that does not exist says so: not a swap-in refused for another
  // reason (a folder), nor a swap-out into a folder that does not exist.
  const std::string folder = dir.file("folder");
  fs::create_directory(folder);
  const swap_result not_a_file = swapper.wait(swapper.swap_in({&folder, 1}, {&t, 1})).at(0);
  EXPECT_NE(not_a_file.error, 0);
  EXPECT_EQ(not_a_file.message.find("never swapped out"), std::string::npos) << not_a_file.message;
  const std::string orphan = dir.file("no-such-folder/a");
  const swap_result no_folder = swapper.wait(swapper.swap_out({&t, 1}, {&orphan, 1})).at(0);
  EXPECT_EQ(no_folder.error, ENOENT);
  EXPECT_EQ(no_folder.message.find("never swapped out"), std::string::npos) << no_folder.message;
  EXPECT_EQ(no_folder.message.rfind("swap-out of " + orphan + ": cannot create ", 0), 0U) << no_folder.message;

  std::vector<std::byte> small(100);
  const tensor_ref s{small.data(), small.size()};
  const swap_result wrong = swapper.wait(swapper.swap_in({&path, 1}, {&s, 1})).at(0);
  EXPECT_EQ(wrong.error, EINVAL);
  EXPECT_NE(wrong.message.find("holds 50000 bytes"), std::string::npos) << wrong.message;

  // Rewriting with a smaller tensor leaves no old tail.
  ASSERT_EQ(swapper.wait(swapper.swap_out({&s, 1}, {&path, 1})).at(0).error, 0);
  EXPECT_EQ(fs::file_size(path), 4096U + 4096U);
  EXPECT_THROW(swapper.wait(12345), std::invalid_argument);
  EXPECT_EQ(swapper.stats().failed, 5U);
}

TEST_P(swapper_test, a_full_file_size_limit_fails_that_tensor_and_keeps_its_bytes) {
  swap_dir dir;
  const std::string big_path = dir.file("big");
  const std::string small_path = dir.file("small");
  const io::engine_kind kind = GetParam();
  const pid_t pid = fork();
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{std::size_t{2} << 20, std::size_t{2} << 20};
    setrlimit(RLIMIT_FSIZE, &limit);
    memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
    tensor_swapper swapper(pool, {.engine = kind, .staging_buffers = 2});
    std::vector<std::byte> big(std::size_t{3} << 20);
    std::vector<std::byte> small(5000);
    fill(big.data(), big.size(), 1);
    fill(small.data(), small.size(), 2);
    const std::vector<std::byte> big_copy = big;
    const tensor_ref tensors[] = {{big.data(), big.size()}, {small.data(), small.size()}};
    const std::string paths[] = {big_path, small_path};
    const auto r = swapper.wait(swapper.swap_out(tensors, paths));
    const bool ok = r[0].error == EFBIG && r[1].error == 0 && big == big_copy &&
                    r[0].message.find("failed") != std::string::npos;
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

INSTANTIATE_TEST_SUITE_P(engines, swapper_test,
                         ::testing::Values(io::engine_kind::uring, io::engine_kind::threads),
                         [](const auto& param_info) { return std::string(io::to_string(param_info.param)); });

// An engine that completes slowly and records any buffer handed to it again before the
// request that used it completed.
class slow_checking_engine final : public testing::forwarding_engine {
 public:
  using forwarding_engine::forwarding_engine;
  void submit(std::span<const io::io_request> requests) override {
    for (const io::io_request& r : requests) {
      for (void* b : {r.buffer, r.buffer2}) {
        if (b != nullptr && !busy_.insert(b).second) ++reused_while_busy_;
      }
      buffers_of_[r.user_data] = {r.buffer, r.buffer2};
    }
    inner_->submit(requests);
  }
  std::vector<io::io_completion> wait(std::size_t min_completions) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    auto done = inner_->wait(min_completions);
    for (const auto& c : done) {
      for (void* b : buffers_of_.at(c.user_data)) busy_.erase(b);
    }
    return done;
  }
  int reused_while_busy() const { return reused_while_busy_; }

 private:
  std::set<void*> busy_;
  std::map<std::uint64_t, std::array<void*, 2>> buffers_of_;
  int reused_while_busy_ = 0;
};

TEST(swapper, staging_buffers_are_reused_only_after_their_io_completes) {
  swap_dir dir;
  memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
  auto engine = std::make_unique<slow_checking_engine>(io::make_thread_engine(4, 2));
  slow_checking_engine* probe = engine.get();
  tensor_swapper swapper(pool, {.block_bytes = std::size_t{1} << 20, .staging_buffers = 2},
                         std::move(engine));
  std::vector<std::byte> a((std::size_t{8} << 20) + 1);  // misaligned: every chunk is staged
  fill(a.data() + 1, a.size() - 1, 5);
  const tensor_ref t{a.data() + 1, a.size() - 1};
  const std::string path = dir.file("staged");
  ASSERT_EQ(swapper.wait(swapper.swap_out({&t, 1}, {&path, 1})).at(0).error, 0);
  std::memset(t.data, 0, t.bytes);
  ASSERT_EQ(swapper.wait(swapper.swap_in({&path, 1}, {&t, 1})).at(0).error, 0);
  std::vector<std::byte> expected(t.bytes);
  fill(expected.data(), expected.size(), 5);
  EXPECT_EQ(std::memcmp(t.data, expected.data(), t.bytes), 0);
  EXPECT_EQ(probe->reused_while_busy(), 0);
  if (swapper.stats().direct) {
    EXPECT_GE(swapper.stats().staged_bytes, 2 * t.bytes);
  }
}

// Staging buffers that could not all be had are refused before the first is taken: they
// were locked one by one until the machine's memory ran out (staging_buffers = 10^9).
TEST(swapper, staging_beyond_the_machines_memory_is_refused_before_any_is_taken) {
  memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
  const std::size_t physical = memory::physical_memory_bytes();
  ASSERT_LT(physical, std::numeric_limits<std::size_t>::max());
  const std::size_t block = std::size_t{1} << 20;
  for (const std::size_t count : {physical / block + 1, std::size_t{1000000000}, std::numeric_limits<std::size_t>::max()}) {
    try {
      tensor_swapper s(pool, {.block_bytes = block, .staging_buffers = count});
      ADD_FAILURE() << count << " staging buffers were accepted";
    } catch (const memory::out_of_memory& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(count) + " staging buffers of 1048576 bytes are more than this "
                                           "machine's " + std::to_string(physical) + " bytes"),
                std::string::npos) << e.what();
    }
    EXPECT_EQ(pool.stats().slabs, 0U);
    EXPECT_EQ(pool.stats().allocations, 0U);
  }
  // A block alone larger than the machine.
  EXPECT_THROW(tensor_swapper(pool, {.block_bytes = (physical / 4096 + 1) * 4096, .staging_buffers = 2}),
               memory::out_of_memory);
  EXPECT_EQ(pool.stats().slabs, 0U);
  tensor_swapper fits(pool, {.block_bytes = block, .staging_buffers = 2});
  EXPECT_GT(pool.stats().allocations, 0U);
}

// A swap-in batch whose tensors share a byte is refused, changing nothing (each byte is
// written once); what writes no byte twice is taken: one tensor swapped out to two paths in
// one batch, and an empty tensor inside another's memory.
TEST(swapper, a_batch_is_refused_only_where_a_swap_in_would_write_a_byte_twice) {
  swap_dir dir;
  memory::pinned_pool pool({.slab_bytes = std::size_t{4} << 20});
  tensor_swapper s(pool, {.staging_buffers = 2});
  std::vector<std::byte> a(10000), none;
  fill(a.data(), a.size(), 41);
  const std::string p1 = dir.file("1"), p2 = dir.file("2"), p3 = dir.file("3");
  const tensor_ref twice[] = {{a.data(), a.size()}, {a.data(), a.size()}};
  const std::string out_paths[] = {p1, p2};
  for (const auto& r : s.wait(s.swap_out(twice, out_paths))) EXPECT_EQ(r.error, 0) << r.message;
  const tensor_ref empty{none.data(), 0};
  ASSERT_EQ(s.wait(s.swap_out({&empty, 1}, {&p3, 1})).at(0).error, 0);
  std::vector<std::byte> x(15000);
  const tensor_ref overlapping[] = {{x.data(), 10000}, {x.data() + 5000, 10000}};
  try {
    s.swap_in(out_paths, overlapping);
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "tensor_swapper: the tensors for " + p1 + " and " + p2 +
                                         " overlap in memory; a swap-in writes each byte once");
  }
  EXPECT_EQ(x, std::vector<std::byte>(x.size()));
  const tensor_ref with_empty[] = {{x.data(), 10000}, {x.data() + 5000, 0}};
  const std::string in_paths[] = {p1, p3};
  for (const auto& r : s.wait(s.swap_in(in_paths, with_empty))) EXPECT_EQ(r.error, 0) << r.message;
  EXPECT_TRUE(std::equal(a.begin(), a.end(), x.begin()));
}

// A batch whose tensors and paths differ in number, or whose tensor's memory would run past
// the end of the address space, is refused before anything is queued or any file made.
TEST(swapper, a_batch_of_other_counts_or_memory_past_the_address_space_is_refused) {
  swap_dir dir;
  memory::pinned_pool pool({.slab_bytes = std::size_t{4} << 20});
  tensor_swapper s(pool, {.staging_buffers = 2});
  std::vector<std::byte> a(8192);
  const std::string paths[] = {dir.file("1"), dir.file("2")};
  const tensor_ref one{a.data(), a.size()};
  try {
    s.swap_out({&one, 1}, paths);
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "tensor_swapper: 1 tensors for 2 paths");
  }
  void* const near_the_end = reinterpret_cast<void*>(std::numeric_limits<std::uintptr_t>::max() - 4095);
  const tensor_ref wrapping{near_the_end, 8192};
  for (const bool out : {true, false}) {
    try {
      if (out) s.swap_out({&wrapping, 1}, {&paths[0], 1});
      else s.swap_in({&paths[0], 1}, {&wrapping, 1});
      ADD_FAILURE() << "accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), "tensor_swapper: the memory of the tensor for " + paths[0] +
                                           " runs past the end of the address space");
    }
  }
  EXPECT_FALSE(fs::exists(paths[0]));
  EXPECT_FALSE(fs::exists(paths[1]));
  EXPECT_EQ(s.stats().failed, 0U);
  ASSERT_EQ(s.wait(s.swap_out({&one, 1}, {&paths[0], 1})).at(0).error, 0);  // still in service
}

// Options it cannot work with are refused when it is made, saying which and why, before any
// staging buffer is taken (a queue depth of 0 ran at 1, and fewer than two staging buffers
// were two, without a word).
TEST(swapper, options_it_cannot_work_with_are_refused) {
  memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
  const struct {
    swap_options options;
    std::string message;
  } cases[] = {
      {{.queue_depth = 0}, "tensor_swapper: queue_depth must be 1 to 32768, not 0"},
      {{.queue_depth = io::max_queue_depth + 1}, "tensor_swapper: queue_depth must be 1 to 32768, not 32769"},
      {{.block_bytes = 0}, "tensor_swapper: block_bytes must be a positive multiple of 4096"},
      {{.block_bytes = 6000}, "tensor_swapper: block_bytes must be a positive multiple of 4096"},
      {{.staging_buffers = 0}, "tensor_swapper: staging_buffers must be at least 2 (a block is staged while "
                               "another moves), not 0"},
      {{.staging_buffers = 1}, "tensor_swapper: staging_buffers must be at least 2 (a block is staged while "
                               "another moves), not 1"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    try {
      tensor_swapper s(pool, c.options);
      ADD_FAILURE() << "accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), c.message);
    }
    EXPECT_EQ(pool.stats().allocations, 0U);
  }
  tensor_swapper edge(pool, {.queue_depth = 1, .block_bytes = 4096, .staging_buffers = 2});
  EXPECT_EQ(edge.stats().failed, 0U);
  // As many staging buffers as asked, and one allocation of header pages: no more.
  EXPECT_EQ(edge.stats().staging_buffers, 2U);
  EXPECT_EQ(pool.stats().allocations, 3U);
  // The deepest queue is taken (the thread engine: no ring of 32,768 entries to make); its
  // 65,536 header pages are one allocation.
  tensor_swapper deepest(pool, {.engine = io::engine_kind::threads,
                                .queue_depth = io::max_queue_depth,
                                .block_bytes = 4096,
                                .staging_buffers = 3});
  EXPECT_EQ(deepest.stats().staging_buffers, 3U);
  EXPECT_EQ(pool.stats().allocations, 3U + 4U);
}

// The swapper's three threads (reaper, committer, worker): when one cannot start, those
// started end, the staging goes back to the pool and the constructor throws (a joinable
// std::thread destroyed while unwinding ended the process, and the staging stayed taken).
TEST(swapper, a_thread_that_cannot_start_is_an_exception_and_the_staging_goes_back) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's runtime needs threads of its own in the limited child";
#endif
  for (const std::size_t allowed : {0U, 1U, 2U}) {
    const int status = testing::with_thread_limit(allowed, [] {
      memory::pinned_pool pool({.slab_bytes = std::size_t{1} << 20});
      try {
        tensor_swapper s(pool, {.engine = io::engine_kind::uring, .block_bytes = std::size_t{64} << 10,
                                .staging_buffers = 2});
        return 1;
      } catch (const std::system_error& e) {
        if (std::string(e.what()).find("tensor_swapper: cannot start a thread") == std::string::npos) return 4;
        return pool.stats().in_use_bytes == 0 ? 0 : 3;
      } catch (const memory::out_of_memory&) {
        return 76;  // this user may not lock even 1 MiB here
      }
    });
    if (status == 76 || status == 77) GTEST_SKIP() << "the limited child could not be set up (" << status << ")";
    EXPECT_EQ(status, 0) << allowed << " threads allowed";
  }
}

// Where io_uring cannot start a kernel worker (the user's thread limit reached by the
// swapper's own three threads), the requests it cancels are moved by blocking calls: the
// tensor goes out and comes back right, and the stats say so. (Before, the swap-out failed
// with ECANCELED.)
TEST(swapper, requests_io_uring_cannot_start_are_moved_by_blocking_calls_and_reported) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's runtime needs threads of its own in the limited child";
#endif
  swap_dir dir;
  ASSERT_TRUE(dir.ok());
  fs::permissions(dir.file(""), fs::perms::all);  // the child is a user of its own
  const std::string path = dir.file("t");
  const int status = testing::with_thread_limit(3, [&] {
    try {
      memory::pinned_pool pool({.slab_bytes = std::size_t{1} << 20});
      tensor_swapper s(pool, {.engine = io::engine_kind::uring, .block_bytes = std::size_t{64} << 10,
                              .staging_buffers = 2, .direct = false});
      if (s.stats().engine != "uring") return 76;
      std::vector<std::byte> a(300'000), b(300'000);
      fill(a.data(), a.size(), 11);
      const tensor_ref out{a.data(), a.size()};
      if (s.wait(s.swap_out({&out, 1}, {&path, 1})).at(0).error != 0) return 2;
      const tensor_ref in{b.data(), b.size()};
      if (s.wait(s.swap_in({&path, 1}, {&in, 1})).at(0).error != 0) return 3;
      if (a != b) return 4;
      const swap_stats st = s.stats();
      if (st.synchronous_requests == 0) return 75;  // done without a worker: nothing to show
      return st.fallback.find("io_uring could not start a kernel worker for") != std::string::npos ? 0 : 5;
    } catch (const memory::out_of_memory&) {
      return 76;  // this user may not lock even 1 MiB here
    }
  });
  if (status == 75 || status == 76 || status == 77) GTEST_SKIP() << "not reached here (" << status << ")";
  EXPECT_EQ(status, 0);
}

// Under a memory-lock limit too small for all its staging (a user without CAP_IPC_LOCK, a pool
// without the unlocked fallback), the swapper keeps the staging buffers the pool could lock,
// two or more, says so, and moves tensors right; with room for fewer than two, its error says
// what it locks and which options lock less, after the pool's own words, and every buffer it
// had taken goes back. (Before, the swapper was refused with the pool's words alone: the
// defaults, 8 MiB of staging and the header pages, were refused under Debian's usual 8 MiB.)
TEST(swapper, a_memory_lock_limit_keeps_the_staging_it_allows_or_names_the_options) {
  const auto [code, message] = memory::testing::in_limited_child([](std::string& out) {
    memory::pinned_pool pool({.slab_bytes = std::size_t{256} << 10});
    const swap_dir dir;  // made by the limited user
    if (!dir.ok()) {
      out = "no scratch folder";
      return 6;
    }
    tensor_swapper s(pool, {.queue_depth = 4, .block_bytes = std::size_t{256} << 10, .staging_buffers = 8});
    const swap_stats st = s.stats();
    out = st.fallback;
    if (st.staging_buffers < 2 || st.staging_buffers >= 8) return 1;
    if (st.fallback.find("RLIMIT_MEMLOCK let the swapper lock " + std::to_string(st.staging_buffers) +
                         " of its 8 staging buffers of 262144 bytes") == std::string::npos) {
      return 2;
    }
    std::vector<std::byte> a(1'000'003), b(a.size());  // unaligned: every block staged
    fill(a.data(), a.size(), 5);
    const std::string path = dir.file("t");
    const tensor_ref out_ref{a.data(), a.size()}, in_ref{b.data(), b.size()};
    if (s.wait(s.swap_out({&out_ref, 1}, {&path, 1})).at(0).error != 0) return 3;
    if (s.wait(s.swap_in({&path, 1}, {&in_ref, 1})).at(0).error != 0) return 4;
    return a == b ? 0 : 5;
  });
  ASSERT_EQ(code, 0) << message;

  // Room for exactly two: the header pages' 256 KiB slab and two dedicated 320 KiB buffers
  // are 896 KiB of the 1 MiB limit, a third would be 1,216 KiB. Two is enough to work.
  const auto [two, two_message] = memory::testing::in_limited_child([](std::string& out) {
    memory::pinned_pool pool({.slab_bytes = std::size_t{256} << 10});
    try {
      tensor_swapper s(pool, {.queue_depth = 4, .block_bytes = std::size_t{320} << 10, .staging_buffers = 4});
      out = s.stats().fallback;
      return s.stats().staging_buffers == 2 ? 0 : 1;
    } catch (const std::exception& e) {
      out = std::string("refused: ") + e.what();
      return 2;
    }
  });
  ASSERT_EQ(two, 0) << two_message;
  EXPECT_NE(two_message.find("RLIMIT_MEMLOCK let the swapper lock 2 of its 4 staging buffers of 327680 bytes"),
            std::string::npos)
      << two_message;

  const auto [refused, words] = memory::testing::in_limited_child([](std::string& out) {
    memory::pinned_pool pool({.slab_bytes = std::size_t{256} << 10});
    try {
      tensor_swapper s(pool, {.queue_depth = 4, .block_bytes = std::size_t{512} << 10, .staging_buffers = 4});
      out = "made with " + std::to_string(s.stats().staging_buffers) + " staging buffers";
      return 1;
    } catch (const memory::lock_limit_error& e) {
      out = e.what();
      return pool.stats().in_use_bytes == 0 ? 0 : 3;
    } catch (const std::exception& e) {
      out = std::string("another error: ") + e.what();
      return 2;
    }
  });
  ASSERT_EQ(refused, 0) << words;
  EXPECT_NE(words.find("RLIMIT_MEMLOCK is 1048576 bytes"), std::string::npos) << words;
  EXPECT_NE(words.find(". The swapper locks 8 header pages and at least two staging buffers of 524288 bytes "
                       "(1081344 bytes): a smaller block_bytes or a smaller queue_depth lock less"),
            std::string::npos)
      << words;
}

TEST(swapper, tmpfs_direct_or_buffered_is_reported) {
  if (!fs::exists("/dev/shm")) GTEST_SKIP() << "no /dev/shm (tmpfs) here";
  swap_dir dir("/dev/shm");
  if (!dir.ok()) GTEST_SKIP() << "cannot create a directory in /dev/shm";
  memory::pinned_pool pool({.slab_bytes = std::size_t{4} << 20});
  tensor_swapper swapper(pool, {.staging_buffers = 2});
  std::vector<std::byte> a(10000);
  fill(a.data(), a.size(), 3);
  const tensor_ref t{a.data(), a.size()};
  const std::string path = dir.file("x");
  ASSERT_EQ(swapper.wait(swapper.swap_out({&t, 1}, {&path, 1})).at(0).error, 0);
  std::memset(a.data(), 0, a.size());
  ASSERT_EQ(swapper.wait(swapper.swap_in({&path, 1}, {&t, 1})).at(0).error, 0);
  std::vector<std::byte> expected(10000);
  fill(expected.data(), expected.size(), 3);
  EXPECT_EQ(a, expected);
  // Kernels since 6.6 let tmpfs take O_DIRECT; older ones refuse it. Either way the swapper
  // must say what it used.
  const int probe = open(dir.file("probe").c_str(), O_CREAT | O_WRONLY | O_DIRECT, 0644);
  const bool tmpfs_direct = probe >= 0;
  if (probe >= 0) close(probe);
  EXPECT_EQ(swapper.stats().direct, tmpfs_direct);
  if (!tmpfs_direct) {
    EXPECT_NE(swapper.stats().fallback.find("O_DIRECT refused"), std::string::npos)
        << swapper.stats().fallback;
  } else {
    EXPECT_EQ(swapper.stats().fallback.find("O_DIRECT"), std::string::npos);
  }
}

}  // namespace
}  // namespace tensormem::swap
