// Swap files that lie: flipped header bits, another tensor's file, a path twice in a batch,
// failed swap-outs with checksums off, and one swapper shared by several threads.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/swap/tensor_swapper.hpp"
#include "swap_test_support.hpp"

namespace tensormem::swap {
namespace {

namespace fs = std::filesystem;

using testing::pattern;
using testing::scratch_dir;
using testing::hang_guard;

int swap_out_one(tensor_swapper& s, std::vector<std::byte>& t, const std::string& path,
                 const std::vector<std::string>& keys = {}) {
  const tensor_ref refs[] = {{t.data(), t.size()}};
  const std::string paths[] = {path};
  return s.wait(s.swap_out(refs, paths, keys))[0].error;
}

swap_result swap_in_one(tensor_swapper& s, std::vector<std::byte>& t, const std::string& path,
                        const std::vector<std::string>& keys = {}) {
  const tensor_ref refs[] = {{t.data(), t.size()}};
  const std::string paths[] = {path};
  return s.wait(s.swap_in(paths, refs, keys))[0];
}

void flip_bit(const std::string& path, std::size_t offset, unsigned bit) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ (1 << bit));
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

class integrity : public ::testing::TestWithParam<io::engine_kind> {
 protected:
  memory::pinned_pool pool_{{.slab_bytes = std::size_t{16} << 20}};
  scratch_dir dir_;
};

TEST_P(integrity, a_flipped_header_bit_is_caught_whatever_the_file_says) {
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2});
  auto t = pattern(10000, 1);
  const std::string path = dir_.file("t");
  ASSERT_EQ(swap_out_one(s, t, path), 0);
  // Byte 20 holds the flags: clearing "checksum present" must not turn verification off.
  flip_bit(path, 20, 0);
  std::vector<std::byte> back(t.size());
  const swap_result r = swap_in_one(s, back, path);
  EXPECT_EQ(r.error, EBADMSG) << r.message;
  EXPECT_NE(r.message.find("corrupt header"), std::string::npos) << r.message;
  // Every header byte is covered, the key tail included.
  ASSERT_EQ(swap_out_one(s, t, path), 0);
  flip_bit(path, 4000, 3);
  EXPECT_EQ(swap_in_one(s, back, path).error, EBADMSG);
}

// A tensor of several blocks is checksummed block by block as the blocks arrive, in any
// order, and the blocks' checksums are combined: a flipped bit in the first block, a middle
// one or the short last one is caught, and so is a swap of two blocks' bytes in the file.
TEST_P(integrity, a_flipped_data_bit_in_any_block_of_a_large_tensor_is_caught) {
  constexpr std::size_t block = std::size_t{64} << 10;
  tensor_swapper s(pool_, {.engine = GetParam(), .block_bytes = block, .staging_buffers = 2});
  auto t = pattern(4 * block + 5000, 6);
  const std::string path = dir_.file("t");
  std::vector<std::byte> back(t.size());
  for (const std::size_t at : {std::size_t{17}, 2 * block + 100, 4 * block + 4999}) {
    ASSERT_EQ(swap_out_one(s, t, path), 0);
    flip_bit(path, 4096 + at, 5);
    const swap_result r = swap_in_one(s, back, path);
    EXPECT_EQ(r.error, EBADMSG) << "byte " << at << ": " << r.message;
    EXPECT_NE(r.message.find("checksum mismatch"), std::string::npos) << r.message;
  }
  // Blocks 1 and 2 exchanged: every block's bytes are intact, their order is not.
  ASSERT_EQ(swap_out_one(s, t, path), 0);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    std::vector<char> one(block);
    std::vector<char> two(block);
    f.seekg(static_cast<std::streamoff>(4096 + block));
    f.read(one.data(), static_cast<std::streamsize>(block));
    f.read(two.data(), static_cast<std::streamsize>(block));
    f.seekp(static_cast<std::streamoff>(4096 + block));
    f.write(two.data(), static_cast<std::streamsize>(block));
    f.write(one.data(), static_cast<std::streamsize>(block));
  }
  EXPECT_EQ(swap_in_one(s, back, path).error, EBADMSG);
  // The file written again reads back whole.
  ASSERT_EQ(swap_out_one(s, t, path), 0);
  ASSERT_EQ(swap_in_one(s, back, path).error, 0);
  EXPECT_EQ(back, t);
}

// A file shorter than a swap file's header is no swap file: refused as such (it used to
// fail as a short read, EIO, which reads as a disk error), its tensor untouched, and the
// swapper goes on (its file slot is given back).
TEST_P(integrity, a_file_shorter_than_a_header_is_not_a_swap_file) {
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2});
  const std::string small = dir_.file("notes.csv");
  std::ofstream(small) << "id,lower,upper,size\na,0,2,100\n";
  const std::string empty = dir_.file("empty");
  std::ofstream{empty};
  auto t = pattern(5000, 8);
  const auto before = t;
  ASSERT_EQ(fs::file_size(small), 30U);
  for (const std::string& path : {small, empty}) {
    const swap_result r = swap_in_one(s, t, path);
    EXPECT_EQ(r.error, EBADMSG) << r.message;
    EXPECT_EQ(r.message, path + " is not a tensormem swap file: " + std::to_string(fs::file_size(path)) +
                             " bytes, less than a swap file's 4096-byte header");
  }
  EXPECT_EQ(t, before);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(swap_out_one(s, t, dir_.file("t")), 0);
    std::vector<std::byte> back(t.size());
    ASSERT_EQ(swap_in_one(s, back, dir_.file("t")).error, 0);
    EXPECT_EQ(back, t);
  }
}

TEST_P(integrity, data_without_a_checksum_is_refused_when_checksums_are_on) {
  tensor_swapper unchecked(pool_, {.engine = GetParam(), .staging_buffers = 2, .checksums = false});
  tensor_swapper checked(pool_, {.engine = GetParam(), .staging_buffers = 2, .checksums = true});
  auto t = pattern(8192, 2);
  const std::string path = dir_.file("t");
  ASSERT_EQ(swap_out_one(unchecked, t, path), 0);
  std::vector<std::byte> back(t.size());
  const swap_result r = swap_in_one(checked, back, path);
  EXPECT_EQ(r.error, EBADMSG) << r.message;
  EXPECT_NE(r.message.find("carries no checksum"), std::string::npos) << r.message;
  EXPECT_EQ(swap_in_one(unchecked, back, path).error, 0);
  EXPECT_EQ(back, t);
}

TEST_P(integrity, another_tensors_file_of_the_same_size_is_refused) {
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2});
  auto a = pattern(5000, 3);
  auto b = pattern(5000, 4);
  ASSERT_EQ(swap_out_one(s, a, dir_.file("a")), 0);
  ASSERT_EQ(swap_out_one(s, b, dir_.file("b")), 0);
  fs::rename(dir_.file("b"), dir_.file("a"));  // a's path now holds b's file
  std::vector<std::byte> back(a.size());
  const swap_result r = swap_in_one(s, back, dir_.file("a"));
  EXPECT_EQ(r.error, EINVAL) << r.message;
  EXPECT_NE(r.message.find("holds another tensor"), std::string::npos) << r.message;
  // With explicit keys, files may move: the key, not the path, is the identity.
  ASSERT_EQ(swap_out_one(s, a, dir_.file("x"), {"layer3.exp_avg"}), 0);
  fs::rename(dir_.file("x"), dir_.file("y"));
  EXPECT_EQ(swap_in_one(s, back, dir_.file("y"), {"layer3.exp_avg"}).error, 0);
  EXPECT_EQ(back, a);
  EXPECT_EQ(swap_in_one(s, back, dir_.file("y"), {"layer3.exp_avg_sq"}).error, EINVAL);
}

TEST_P(integrity, a_path_twice_in_flight_is_refused_before_anything_is_queued) {
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2});
  auto a = pattern(5000, 5);
  auto b = pattern(5000, 6);
  const tensor_ref refs[] = {{a.data(), a.size()}, {b.data(), b.size()}};
  const std::string same[] = {dir_.file("p"), dir_.file("p")};
  EXPECT_THROW((void)s.swap_out(refs, same), std::invalid_argument);
  EXPECT_FALSE(fs::exists(dir_.file("p")));
  const std::string one[] = {dir_.file("p")};
  const std::uint64_t ticket = s.swap_out(std::span(refs, 1), one);
  // The refusal names the ticket that holds the path (one its caller may have dropped), and
  // so does discard's.
  const std::string held = "tensor_swapper: " + one[0] + " is in a transfer not yet waited for (ticket " +
                           std::to_string(ticket) + ": wait(" + std::to_string(ticket) +
                           ") or synchronize() collects it)";
  try {
    (void)s.swap_in(one, std::span(refs + 1, 1));
    ADD_FAILURE() << "a path in flight was taken again";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), held);
  }
  try {
    s.discard(one[0]);
    ADD_FAILURE() << "a path in flight was discarded";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), held);
  }
  EXPECT_EQ(s.wait(ticket)[0].error, 0);
  // Once waited for, the path is free again.
  EXPECT_EQ(s.wait(s.swap_in(one, std::span(refs + 1, 1)))[0].error, 0);
  EXPECT_EQ(b, a);
}

// With checksums off, a swap-out that fails must neither read back as success nor destroy
// the previous good version of the file.
TEST_P(integrity, keys_must_match_the_paths_one_for_one) {
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2});
  auto a = pattern(100, 30);
  const tensor_ref refs[] = {{a.data(), a.size()}};
  const std::string paths[] = {dir_.file("k")};
  const std::string keys[] = {"one", "two"};
  EXPECT_THROW((void)s.swap_out(refs, paths, keys), std::invalid_argument);
  EXPECT_THROW((void)s.swap_in(paths, refs, keys), std::invalid_argument);
  EXPECT_FALSE(fs::exists(dir_.file("k")));
}

TEST_P(integrity, a_failed_swap_out_keeps_the_old_file_and_never_reads_back_as_success) {
  const std::string kept = dir_.file("kept");
  const std::string fresh = dir_.file("fresh");
  const io::engine_kind kind = GetParam();
  const pid_t pid = fork();
  if (pid == 0) {
    memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
    tensor_swapper s(pool, {.engine = kind, .staging_buffers = 2, .checksums = false});
    auto old_version = pattern(1 << 20, 7);
    int code = 0;
    if (swap_out_one(s, old_version, kept) != 0) code = 1;
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{std::size_t{2} << 20, std::size_t{2} << 20};
    setrlimit(RLIMIT_FSIZE, &limit);
    auto big = pattern(std::size_t{3} << 20, 8);
    if (swap_out_one(s, big, kept) == 0) code = 2;   // fails: over the limit
    if (swap_out_one(s, big, fresh) == 0) code = 3;  // fails: no old version
    std::vector<std::byte> back(old_version.size());
    const swap_result r = swap_in_one(s, back, kept);
    if (r.error != 0 || back != old_version) code = 4;  // the old version survived
    std::vector<std::byte> back_big(big.size());
    if (swap_in_one(s, back_big, fresh).error == 0) code = 5;  // never success
    for (const auto& e : fs::directory_iterator(fs::path(kept).parent_path())) {
      if (e.path().string().find(".tensormem-tmp") != std::string::npos) code = 6;  // cleaned up
    }
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: setup, 2/3: failure not reported, 4: old version lost, "
                                       "5: failed swap-out read back as success, 6: partial file left";
}

// An empty tensor swapped in from the file of a tensor of another size reads the header
// alone, exactly one page, and the header says whose it is; from an empty tensor's file it
// succeeds.
TEST_P(integrity, an_empty_tensor_from_a_file_of_another_size_is_refused_by_its_header) {
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2});
  auto t = pattern(50000, 26);
  const std::string path = dir_.file("full"), empty_path = dir_.file("empty");
  ASSERT_EQ(swap_out_one(s, t, path), 0);
  std::vector<std::byte> none;
  const swap_result r = swap_in_one(s, none, path);
  EXPECT_EQ(r.error, EINVAL) << r.message;
  EXPECT_NE(r.message.find("holds 50000 bytes"), std::string::npos) << r.message;
  ASSERT_EQ(swap_out_one(s, none, empty_path), 0);
  EXPECT_EQ(fs::file_size(empty_path), 4096U);
  EXPECT_EQ(swap_in_one(s, none, empty_path).error, 0);
}

// A swap file cut short after it was written is refused as such before anything is read (it
// failed as a short read, EIO, which reads as a disk error), its tensor untouched; one of
// another size or tensor still says so, and so does a damaged header.
TEST_P(integrity, a_truncated_file_is_refused_as_cut_short_not_read) {
  // Checksums off: only the file's length can tell that bytes are missing.
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2, .checksums = false});
  for (const std::size_t bytes : {std::size_t{10000}, std::size_t{1} << 20}) {
    auto t = pattern(bytes, 9);
    const std::string path = dir_.file("short");
    ASSERT_EQ(swap_out_one(s, t, path), 0);
    const std::size_t whole = 4096 + (bytes + 4095) / 4096 * 4096;
    ASSERT_EQ(fs::file_size(path), whole);
    fs::resize_file(path, 4096 + 4096);  // the header and the first data page only
    std::vector<std::byte> back(t.size());
    swap_result r = swap_in_one(s, back, path);
    EXPECT_EQ(r.error, EBADMSG) << r.message;
    EXPECT_EQ(r.message, path + " is cut short: 8192 bytes, where the swap file of its " + std::to_string(bytes) +
                             "-byte tensor holds " + std::to_string(whole) + " (truncated after it was written)");
    EXPECT_EQ(back, std::vector<std::byte>(t.size()));  // nothing read into it
    // The header alone is a swap file cut short; a byte less is no swap file.
    for (const std::size_t left : {std::size_t{4096}, std::size_t{4095}}) {
      ASSERT_EQ(swap_out_one(s, t, path), 0);
      fs::resize_file(path, left);
      r = swap_in_one(s, back, path);
      EXPECT_EQ(r.error, EBADMSG) << r.message;
      EXPECT_EQ(r.message, left == 4096 ? path + " is cut short: 4096 bytes, where the swap file of its " +
                                              std::to_string(bytes) + "-byte tensor holds " + std::to_string(whole) +
                                              " (truncated after it was written)"
                                        : path + " is not a tensormem swap file: 4095 bytes, less than a swap "
                                                 "file's 4096-byte header");
    }
    // One page short of whole: still refused.
    ASSERT_EQ(swap_out_one(s, t, path), 0);
    fs::resize_file(path, whole - 1);
    r = swap_in_one(s, back, path);
    EXPECT_EQ(r.error, EBADMSG) << r.message;
    // A larger tensor's file, cut as short: it holds another size, as it would say whole.
    auto larger = pattern(bytes + 8192, 10);
    ASSERT_EQ(swap_out_one(s, larger, path), 0);
    fs::resize_file(path, 4096 + 4096);
    r = swap_in_one(s, back, path);
    EXPECT_EQ(r.error, EINVAL) << r.message;
    EXPECT_EQ(r.message, path + " holds " + std::to_string(bytes + 8192) + " bytes; the tensor has " +
                             std::to_string(bytes));
    // Its header damaged too: the header is what is wrong.
    {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(100);
      const int c = f.get();
      f.seekp(100);
      f.put(static_cast<char>(~c));  // one byte of the header flipped
    }
    r = swap_in_one(s, back, path);
    EXPECT_EQ(r.error, EBADMSG) << r.message;
    EXPECT_EQ(r.message, path + " has a corrupt header");
    tensor_swapper::remove_files(path);
  }
  // The swapper goes on: every file was closed and its slot given back.
  auto t = pattern(5000, 11);
  ASSERT_EQ(swap_out_one(s, t, dir_.file("after")), 0);
  std::vector<std::byte> back(t.size());
  EXPECT_EQ(swap_in_one(s, back, dir_.file("after")).error, 0);
  EXPECT_EQ(back, t);
}

// Two swappers (in one process or in two) writing one path at once. With reuse_files both
// wrote into its spare file and exchanged it with the path in turn: the second exchange put
// the version before both back, and a swap-in read those stale bytes as success. Now a spare
// is reused by one swap-out at a time (it is locked); the other writes a file of its own
// name. Both succeed, and what the path holds is one of their versions.
TEST_P(integrity, two_swappers_writing_one_path_at_once_never_leave_a_stale_version) {
  for (const bool reuse : {true, false}) {
    tensor_swapper a(pool_, {.engine = GetParam(), .staging_buffers = 2, .reuse_files = reuse});
    tensor_swapper b(pool_, {.engine = GetParam(), .staging_buffers = 2, .reuse_files = reuse});
    const std::string path = dir_.file(reuse ? "shared" : "shared-unreused");
    {
      // A version and a spare beside it, by a third swapper: a and b then number their jobs
      // alike, and without reuse only the swapper's own number tells their files apart.
      tensor_swapper first(pool_, {.engine = GetParam(), .staging_buffers = 2, .reuse_files = reuse});
      for (const std::uint64_t seed : {std::uint64_t{1}, std::uint64_t{2}}) {
        auto v = pattern(std::size_t{4} << 20, seed);
        ASSERT_EQ(swap_out_one(first, v, path), 0);
      }
    }
    for (std::uint64_t round = 0; round < 6; ++round) {
      auto va = pattern(std::size_t{4} << 20, 100 + round);
      auto vb = pattern(std::size_t{4} << 20, 200 + round);
      const tensor_ref ra[] = {{va.data(), va.size()}};
      const tensor_ref rb[] = {{vb.data(), vb.size()}};
      const std::string paths[] = {path};
      const std::uint64_t ta = a.swap_out(ra, paths);
      const std::uint64_t tb = b.swap_out(rb, paths);
      const swap_result x = a.wait(ta)[0];
      const swap_result y = b.wait(tb)[0];
      ASSERT_EQ(x.error, 0) << x.message;
      ASSERT_EQ(y.error, 0) << y.message;
      std::vector<std::byte> back(va.size());
      ASSERT_EQ(swap_in_one(a, back, path).error, 0);
      EXPECT_TRUE(back == va || back == vb) << "reuse " << reuse << ", round " << round << ": a stale version";
    }
  }
  // Nothing but the paths and their spares is left: each swapper's reaper removed what its
  // commits displaced before the swapper was gone.
  for (const auto& e : fs::directory_iterator(dir_.path)) {
    EXPECT_EQ(e.path().string().find(".tensormem-tmp"), std::string::npos) << e.path();
  }
}

// A child forked while a swap-out is in flight shares the lock on the file being written (and
// keeps it while it lives). The parent's later swap-outs of the path, which would reuse that
// file as their spare, write files of their own names instead: none fails.
TEST_P(integrity, a_forked_child_holding_a_locked_spare_fails_no_later_swap_out) {
  const std::string path = dir_.file("forked");
  auto v = pattern(std::size_t{4} << 20, 1);
  {
    tensor_swapper first(pool_, {.engine = GetParam(), .staging_buffers = 2});
    ASSERT_EQ(swap_out_one(first, v, path), 0);
    ASSERT_EQ(swap_out_one(first, v, path), 0);  // a spare now exists
  }
  // The fork comes while the swap-out's first requests wait at the engine: its file is open
  // and locked then.
  auto arrived = std::make_shared<testing::gate>();
  auto go = std::make_shared<testing::gate>();
  std::string why;
  tensor_swapper s(pool_, {.staging_buffers = 2},
                   std::make_unique<testing::held_submit_engine>(io::make_engine(GetParam(), 32, why), arrived, go));
  const tensor_ref refs[] = {{v.data(), v.size()}};
  const std::string paths[] = {path};
  const std::uint64_t ticket = s.swap_out(refs, paths);
  arrived->pass();
  int to_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  const pid_t child = fork();
  if (child == 0) {  // keeps every descriptor it was given until the parent is done
    char c = 0;
    _exit(read(to_child[0], &c, 1) == 1 ? 0 : 1);
  }
  close(to_child[0]);
  go->open();
  ASSERT_EQ(s.wait(ticket)[0].error, 0);
  for (std::uint64_t round = 0; round < 4; ++round) {
    auto w = pattern(std::size_t{4} << 20, 10 + round);
    EXPECT_EQ(swap_out_one(s, w, path), 0) << round;
    std::vector<std::byte> back(w.size());
    EXPECT_EQ(swap_in_one(s, back, path).error, 0);
    EXPECT_EQ(back, w) << round;
  }
  EXPECT_EQ(write(to_child[1], "x", 1), 1);
  close(to_child[1]);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// A swap-in reads the version committed when it opened its file. Another swapper committing
// two newer versions meanwhile makes that file the path's spare at the first; the second would
// overwrite it in place, but finds it locked by the reader and writes a file of its own name.
TEST_P(integrity, a_file_being_read_is_never_rewritten_as_another_swappers_spare) {
  const std::string path = dir_.file("read");
  auto v1 = pattern(std::size_t{4} << 20, 1);
  tensor_swapper writer(pool_, {.engine = GetParam(), .staging_buffers = 2});
  ASSERT_EQ(swap_out_one(writer, v1, path), 0);
  auto arrived = std::make_shared<testing::gate>();
  auto go = std::make_shared<testing::gate>();
  std::string why;
  tensor_swapper reader(pool_, {.staging_buffers = 2},
                        std::make_unique<testing::held_submit_engine>(io::make_engine(GetParam(), 32, why), arrived,
                                                                      go));
  std::vector<std::byte> back(v1.size());
  const tensor_ref refs[] = {{back.data(), back.size()}};
  const std::string paths[] = {path};
  const std::uint64_t ticket = reader.swap_in(paths, refs);
  arrived->pass();  // the file is open; its reads wait at the engine
  for (std::uint64_t round = 2; round <= 3; ++round) {
    auto v = pattern(v1.size(), round);
    ASSERT_EQ(swap_out_one(writer, v, path), 0) << round;
  }
  go->open();
  const swap_result r = reader.wait(ticket)[0];
  EXPECT_EQ(r.error, 0) << r.message;
  EXPECT_EQ(back, v1);  // neither version 3 (written over it) nor a mix
  std::vector<std::byte> latest(v1.size());
  EXPECT_EQ(swap_in_one(writer, latest, path).error, 0);
  EXPECT_EQ(latest, pattern(v1.size(), 3));
}

// The header of a file too short for its tensor cannot be read (a disk error): that error,
// with the path, not a verdict on the file.
TEST_P(integrity, a_short_file_whose_header_cannot_be_read_names_the_error) {
  const std::string path = dir_.file("short");
  auto t = pattern(std::size_t{1} << 20, 9);
  {
    tensor_swapper writer(pool_, {.engine = GetParam(), .staging_buffers = 2});
    ASSERT_EQ(swap_out_one(writer, t, path), 0);
  }
  fs::resize_file(path, 4096 + 4096);
  const io::engine_kind kind = GetParam();
  const int rc = testing::with_failing_syscall(SYS_pread64, EIO, [&] {
    memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
    tensor_swapper s(pool, {.engine = kind, .staging_buffers = 2});
    std::vector<std::byte> back(t.size());
    const swap_result r = swap_in_one(s, back, path);
    return r.error == EIO && r.message == "cannot read the header of " + path + ": " + std::strerror(EIO) &&
           back == std::vector<std::byte>(t.size());
  });
  if (rc == 77) GTEST_SKIP() << "no seccomp filter can be installed here";
  EXPECT_EQ(rc, 0);
}

// A file cut short while it is read (after the swapper opened it): the read comes back
// short, and that is an error for the tensor, EIO, never success.
class truncating_engine final : public testing::forwarding_engine {
 public:
  truncating_engine(std::unique_ptr<io::io_engine> inner, std::string path)
      : forwarding_engine(std::move(inner)), path_(std::move(path)) {}
  void submit(std::span<const io::io_request> requests) override {
    for (const io::io_request& r : requests) {
      if (!r.write && !cut_) {
        fs::resize_file(path_, 4096 + 4096);
        cut_ = true;
      }
    }
    forwarding_engine::submit(requests);
  }

 private:
  std::string path_;
  bool cut_ = false;
};

TEST_P(integrity, a_file_cut_short_during_its_read_is_a_short_read_not_success) {
  const std::string path = dir_.file("short");
  auto t = pattern(std::size_t{1} << 20, 9);
  {
    tensor_swapper writer(pool_, {.engine = GetParam(), .staging_buffers = 2});
    ASSERT_EQ(swap_out_one(writer, t, path), 0);
  }
  std::string why;
  tensor_swapper s(pool_, {.staging_buffers = 2, .checksums = false},
                   std::make_unique<truncating_engine>(io::make_engine(GetParam(), 32, why), path));
  std::vector<std::byte> back(t.size());
  const swap_result r = swap_in_one(s, back, path);
  EXPECT_EQ(r.error, EIO) << r.message;
  EXPECT_NE(r.message.find("short read from " + path), std::string::npos) << r.message;
}

TEST_P(integrity, rewrites_reuse_the_spare_file_and_keep_every_version_exact) {
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2});
  const std::string path = dir_.file("v");
  const std::string spare = tensor_swapper::spare_path(path);
  std::vector<std::vector<std::byte>> versions = {pattern(std::size_t{2} << 20, 20), pattern(std::size_t{1} << 20, 21),
                                                  pattern(10000, 22), pattern(std::size_t{3} << 20, 23)};
  for (std::size_t v = 0; v < versions.size(); ++v) {
    ASSERT_EQ(swap_out_one(s, versions[v], path), 0) << "version " << v;
    std::vector<std::byte> back(versions[v].size());
    const swap_result r = swap_in_one(s, back, path);
    ASSERT_EQ(r.error, 0) << r.message;
    EXPECT_EQ(back, versions[v]) << "version " << v;
    // The file holds exactly this version (a longer spare was cut), the spare the one before.
    EXPECT_EQ(fs::file_size(path), 4096 + (versions[v].size() + 4095) / 4096 * 4096);
    if (v > 0) {
      EXPECT_EQ(fs::file_size(spare), 4096 + (versions[v - 1].size() + 4095) / 4096 * 4096);
    }
  }
  tensor_swapper::remove_files(path);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(spare));
}

TEST_P(integrity, one_swapper_shared_by_four_threads) {
  tensor_swapper s(pool_, {.engine = GetParam(), .queue_depth = 8, .staging_buffers = 3});
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        auto data = pattern(3000 + static_cast<std::size_t>(t) * 7000 + static_cast<std::size_t>(round), static_cast<std::uint64_t>(t * 100 + round));
        const std::string path = dir_.file("t" + std::to_string(t) + "-" + std::to_string(round % 3));
        if (swap_out_one(s, data, path) != 0) ++failures[static_cast<std::size_t>(t)];
        std::vector<std::byte> back(data.size());
        if (swap_in_one(s, back, path).error != 0 || back != data) ++failures[static_cast<std::size_t>(t)];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(failures[static_cast<std::size_t>(t)], 0) << "thread " << t;
  EXPECT_EQ(s.stats().tensors_out, 80U);
  EXPECT_EQ(s.stats().tensors_in, 80U);
}

// A file the reader does not own: O_NOATIME is refused (EPERM) to anyone but the owner, so
// the swapper opens it again without and reads it. The file is written as root, read in a
// child that switched to the user nobody (skipped where the test does not run as root).
TEST_P(integrity, a_file_of_another_user_reads_back) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to switch to another user";
  const io::engine_kind kind = GetParam();
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  fs::permissions(dir.path, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                fs::perms::others_read | fs::perms::others_exec);
  const std::string path = dir.file("t");
  auto t = pattern(100'000, 3);
  {
    memory::pinned_pool pool({.slab_bytes = std::size_t{1} << 20});
    tensor_swapper s(pool, {.engine = kind, .block_bytes = std::size_t{64} << 10, .staging_buffers = 2});
    ASSERT_EQ(swap_out_one(s, t, path), 0);
  }
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(77);
    memory::pinned_pool pool({.slab_bytes = std::size_t{1} << 20});
    tensor_swapper s(pool, {.engine = kind, .block_bytes = std::size_t{64} << 10, .staging_buffers = 2});
    std::vector<std::byte> back(t.size());
    const swap_result r = swap_in_one(s, back, path);
    _exit(r.error == 0 && back == t ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "cannot switch to the user nobody";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// What a path names when it is not a regular file, and that nothing of the swap-out is left
// beside it.
void expect_untouched_directory(const std::string& path) {
  EXPECT_TRUE(fs::is_directory(fs::symlink_status(path))) << path;
  EXPECT_TRUE(fs::exists(path + "/keep")) << path << "/keep";
  for (const auto& e : fs::directory_iterator(fs::path(path).parent_path())) {
    EXPECT_EQ(e.path().string().find(".tensormem-"), std::string::npos) << e.path() << " left behind";
  }
}

void make_directory_with_a_file(const std::string& path) {
  fs::create_directories(path);
  std::ofstream(path + "/keep") << "the user's file";
}

class counting_engine final : public testing::forwarding_engine {
 public:
  using forwarding_engine::forwarding_engine;
  void submit(std::span<const io::io_request> requests) override {
    submitted += requests.size();
    inner_->submit(requests);
  }
  std::size_t submitted = 0;
};

// The commit exchanges the new file with whatever the path names: a directory there used to
// be moved aside (to PATH.tensormem-spare, with everything in it) and reported as success.
// Such a path is refused before any byte is written.
TEST_P(integrity, a_swap_out_replaces_only_a_regular_file) {
  for (const bool reuse : {true, false}) {
    SCOPED_TRACE(reuse ? "reusing spares" : "fresh files");
    std::string fallback;
    auto engine = std::make_unique<counting_engine>(io::make_engine(GetParam(), 8, fallback));
    const counting_engine* counter = engine.get();
    tensor_swapper s(pool_, {.staging_buffers = 2, .reuse_files = reuse}, std::move(engine));
    auto t = pattern(10000, 40);
    const std::string dir = dir_.file(reuse ? "dir_r" : "dir_f");
    make_directory_with_a_file(dir);
    const tensor_ref refs[] = {{t.data(), t.size()}};
    const std::string to_dir[] = {dir};
    const swap_result r = s.wait(s.swap_out(refs, to_dir))[0];
    EXPECT_EQ(r.error, EISDIR);
    EXPECT_NE(r.message.find(dir + " is a directory; a swap-out replaces only a regular file"), std::string::npos)
        << r.message;
    expect_untouched_directory(dir);
    fs::remove_all(dir);

    // A symbolic link stays a link, and what it points to is not written.
    const std::string target = dir_.file("target");
    const std::string link = dir_.file("link");
    std::ofstream(target) << "the target";
    fs::create_symlink(target, link);
    const std::string to_link[] = {link};
    const swap_result l = s.wait(s.swap_out(refs, to_link))[0];
    EXPECT_EQ(l.error, EINVAL);
    EXPECT_NE(l.message.find("is a symbolic link"), std::string::npos) << l.message;
    EXPECT_TRUE(fs::is_symlink(link));
    EXPECT_EQ(fs::file_size(target), std::string("the target").size());
    fs::remove(link);
    fs::remove(target);

    // A pipe is neither opened (it would block) nor replaced.
    const std::string pipe = dir_.file("pipe");
    ASSERT_EQ(mkfifo(pipe.c_str(), 0600), 0);
    const std::string to_pipe[] = {pipe};
    const swap_result p = s.wait(s.swap_out(refs, to_pipe))[0];
    EXPECT_EQ(p.error, EINVAL);
    EXPECT_NE(p.message.find("is a pipe"), std::string::npos) << p.message;
    EXPECT_TRUE(fs::is_fifo(pipe));
    fs::remove(pipe);
    EXPECT_EQ(counter->submitted, 0U) << "bytes were written for a path that is refused";

    // The file written beside the path is never a link's target.
    const std::string victim = dir_.file("victim");
    const std::string path = dir_.file("p");
    std::ofstream(victim) << "not to be written";
    fs::create_symlink(victim, path + (reuse ? ".tensormem-spare" : ""));
    const std::string to_path[] = {path};
    if (reuse) {
      EXPECT_EQ(s.wait(s.swap_out(refs, to_path))[0].error, ELOOP);
      fs::remove(path + ".tensormem-spare");
    } else {
      fs::remove(path);
    }
    EXPECT_EQ(fs::file_size(victim), std::string("not to be written").size());
    fs::remove(victim);

    // The swapper works on afterwards.
    EXPECT_EQ(s.wait(s.swap_out(refs, to_path))[0].error, 0);
    std::vector<std::byte> back(t.size());
    EXPECT_EQ(swap_in_one(s, back, path).error, 0);
    EXPECT_EQ(back, t);
    tensor_swapper::remove_files(path);
  }
  // Packed, the path gets no file of its own, but a stale one there is removed on the first
  // swap-out: a link there is refused the same way.
  tensor_swapper packing(pool_, {.engine = GetParam(), .staging_buffers = 2, .pack_below = 1 << 20});
  auto small = pattern(3000, 43);
  const tensor_ref small_refs[] = {{small.data(), small.size()}};
  const std::string target = dir_.file("packed_target");
  const std::string link = dir_.file("packed_link");
  std::ofstream(target) << "the target";
  fs::create_symlink(target, link);
  const std::string to_link[] = {link};
  EXPECT_EQ(packing.wait(packing.swap_out(small_refs, to_link))[0].error, EINVAL);
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(fs::file_size(target), std::string("the target").size());
}

// The worker opens files under the swapper's lock: a pipe at a swap-in's path (or at the
// spare a swap-out writes) held it in open() until someone opened the pipe's other end, and
// with it every caller of the swapper, its destructor included. Such files, and devices and
// directories, are refused at once, naming what they are; the swapper works on afterwards.
TEST_P(integrity, a_swap_file_that_is_not_a_regular_file_is_refused_without_blocking) {
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2});
  auto t = pattern(10000, 44);
  const tensor_ref refs[] = {{t.data(), t.size()}};
  const std::string pipe = dir_.file("in_pipe");
  ASSERT_EQ(mkfifo(pipe.c_str(), 0600), 0);
  const std::string dir = dir_.file("in_dir");
  fs::create_directory(dir);
  const struct {
    std::string path;
    int error;
    const char* kind;
  } cases[] = {{pipe, EINVAL, "a pipe"}, {dir, EISDIR, "a directory"}, {"/dev/null", EINVAL, "a device"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.path);
    const hang_guard guard("a swap-in from " + c.path, std::chrono::seconds(20));
    const std::string from[] = {c.path};
    const swap_result r = s.wait(s.swap_in(from, refs))[0];
    EXPECT_EQ(r.error, c.error);
    EXPECT_NE(r.message.find("cannot open " + c.path + ": it is " + c.kind + "; swap files are regular files"),
              std::string::npos)
        << r.message;
  }
  EXPECT_TRUE(fs::is_fifo(pipe));

  // A swap-out writes the spare beside its path; a pipe there (no reader: the open would wait
  // for one) is refused, and the path keeps the version it had.
  const std::string path = dir_.file("spare_pipe");
  const std::string to_path[] = {path};
  ASSERT_EQ(s.wait(s.swap_out(refs, to_path))[0].error, 0);
  ASSERT_EQ(mkfifo(tensor_swapper::spare_path(path).c_str(), 0600), 0);
  auto other = pattern(10000, 45);
  const tensor_ref other_refs[] = {{other.data(), other.size()}};
  {
    const hang_guard guard("a swap-out beside a pipe", std::chrono::seconds(20));
    const swap_result r = s.wait(s.swap_out(other_refs, to_path))[0];
    EXPECT_EQ(r.error, EINVAL);
    EXPECT_NE(r.message.find("cannot create " + tensor_swapper::spare_path(path) +
                             ": it is a pipe; swap files are regular files"),
              std::string::npos)
        << r.message;
  }
  EXPECT_TRUE(fs::is_fifo(tensor_swapper::spare_path(path)));
  // A folder that is not there: the message names the tensor's path and the file it made.
  const std::string nowhere[] = {dir_.file("missing") + "/t"};
  const swap_result missing = s.wait(s.swap_out(other_refs, nowhere))[0];
  EXPECT_EQ(missing.error, ENOENT);
  EXPECT_EQ(missing.message.rfind("swap-out of " + nowhere[0] + ": cannot create " +
                                      tensor_swapper::spare_path(nowhere[0]) + ": No such file or directory",
                                  0),
            0U)
      << missing.message;
  std::vector<std::byte> back(t.size());
  EXPECT_EQ(swap_in_one(s, back, path).error, 0);
  EXPECT_EQ(back, t);
}

// Memory a swap-in writes may be in no other unwaited transfer; swap-outs may share memory.
// Each refusal names the path and queues nothing: the same paths go through afterwards.
TEST_P(integrity, memory_written_by_a_swap_in_is_in_no_other_unwaited_transfer) {
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2});
  auto a = pattern(8192, 51);
  auto b = pattern(8192, 52);
  const std::string pa[] = {dir_.file("a")};
  const std::string pb[] = {dir_.file("b")};
  const std::string both[] = {dir_.file("a"), dir_.file("b")};
  const tensor_ref ra[] = {{a.data(), a.size()}};
  const tensor_ref rb[] = {{b.data(), b.size()}};
  ASSERT_EQ(s.wait(s.swap_out(ra, pa))[0].error, 0);
  ASSERT_EQ(s.wait(s.swap_out(rb, pb))[0].error, 0);
  const auto want_a = a;
  const auto want_b = b;

  std::vector<std::byte> dest(8192 * 2, std::byte{0});
  // `held_by`: the unwaited transfer the refusal names (its path and ticket), where one holds
  // the memory.
  auto refused = [&](auto call, const std::string& named, const std::string& held_by = "") {
    try {
      call();
      ADD_FAILURE() << "not refused";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("overlap"), std::string::npos) << e.what();
      if (!held_by.empty()) {
        EXPECT_TRUE(std::string(e.what()).ends_with(held_by)) << e.what();
      }
    }
  };
  auto holder = [](const std::string& kind, const std::string& path, std::uint64_t ticket) {
    const std::string t = std::to_string(ticket);
    return " overlaps a " + kind + " not yet waited for (the tensor for " + path + ", ticket " + t + ": wait(" + t +
           ") or synchronize() collects it)";
  };
  // One swap-in batch whose destinations share a byte.
  const tensor_ref one_byte_shared[] = {{dest.data(), 8192}, {dest.data() + 8191, 8192}};
  refused([&] { (void)s.swap_in(both, one_byte_shared); }, dir_.file("a"));
  const tensor_ref reversed[] = {{dest.data() + 8191, 8192}, {dest.data(), 8192}};
  refused([&] { (void)s.swap_in(both, reversed); }, dir_.file("b"));
  EXPECT_TRUE(std::all_of(dest.begin(), dest.end(), [](std::byte x) { return x == std::byte{0}; }));
  // Touching is not sharing: the same paths, nothing queued before, read back exactly.
  const tensor_ref touching[] = {{dest.data(), 8192}, {dest.data() + 8192, 8192}};
  auto results = s.wait(s.swap_in(both, touching));
  ASSERT_EQ(results[0].error, 0);
  ASSERT_EQ(results[1].error, 0);
  EXPECT_TRUE(std::equal(want_a.begin(), want_a.end(), dest.begin()));
  EXPECT_TRUE(std::equal(want_b.begin(), want_b.end(), dest.begin() + 8192));

  // A swap-out not yet waited for: its memory may be read again, not written.
  const std::string pc[] = {dir_.file("c")};
  const std::string pd[] = {dir_.file("d")};
  const std::uint64_t out = s.swap_out(ra, pc);
  const tensor_ref last_byte_of_a[] = {{a.data() + a.size() - 1, 1}};
  refused([&] { (void)s.swap_in(pb, last_byte_of_a); }, dir_.file("b"), holder("swap-out", dir_.file("c"), out));
  const tensor_ref a_again[] = {{a.data(), a.size()}};
  const std::uint64_t out_again = s.swap_out(a_again, pd);
  refused([&] { (void)s.swap_in(pb, ra); }, dir_.file("b"), holder("swap-out", dir_.file("c"), out));
  EXPECT_EQ(s.wait(out_again)[0].error, 0);
  // the first swap-out still holds a
  refused([&] { (void)s.swap_in(pb, ra); }, dir_.file("b"), holder("swap-out", dir_.file("c"), out));
  EXPECT_EQ(s.wait(out)[0].error, 0);

  // A swap-in not yet waited for: its memory is in no other transfer, either way.
  std::vector<std::byte> target(8192, std::byte{0});
  const tensor_ref rt[] = {{target.data(), target.size()}};
  const std::uint64_t in = s.swap_in(pa, rt);
  const tensor_ref first_byte[] = {{target.data(), 1}};
  refused([&] { (void)s.swap_out(first_byte, pc); }, dir_.file("c"), holder("swap-in", dir_.file("a"), in));
  refused([&] { (void)s.swap_in(pb, first_byte); }, dir_.file("b"), holder("swap-in", dir_.file("a"), in));
  const tensor_ref just_past[] = {{target.data() + target.size(), 0}};  // no bytes: no memory
  EXPECT_EQ(s.wait(s.swap_out(just_past, pd))[0].error, 0);
  EXPECT_EQ(s.wait(in)[0].error, 0);
  EXPECT_EQ(target, want_a);
  // Waited for: free again.
  EXPECT_EQ(s.wait(s.swap_in(pb, rt))[0].error, 0);
  EXPECT_EQ(target, want_b);
}

TEST_P(integrity, empty_paths_and_paths_with_a_nul_byte_are_refused_before_anything_is_queued) {
  tensor_swapper s(pool_, {.engine = GetParam(), .staging_buffers = 2});
  auto t = pattern(100, 41);
  const tensor_ref refs[] = {{t.data(), t.size()}};
  const std::string empty[] = {""};
  const std::string nul[] = {dir_.file("a") + std::string(1, '\0') + "b"};
  for (const auto* paths : {&empty, &nul}) {
    EXPECT_THROW((void)s.swap_out(refs, *paths), std::invalid_argument);
    EXPECT_THROW((void)s.swap_in(*paths, refs), std::invalid_argument);
  }
  try {
    (void)s.swap_out(refs, nul);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("holds a NUL byte"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(dir_.path));
  EXPECT_FALSE(fs::exists(".tensormem-spare"));

  // discard and remove_files delete files: with "a\0b" they would delete "a".
  const std::string kept = dir_.file("kept");
  std::ofstream(kept) << "kept";
  const std::string kept_nul = kept + std::string(1, '\0') + "b";
  EXPECT_THROW(s.discard(kept_nul), std::invalid_argument);
  EXPECT_THROW(s.discard(""), std::invalid_argument);
  EXPECT_THROW(tensor_swapper::remove_files(kept_nul), std::invalid_argument);
  EXPECT_THROW(tensor_swapper::remove_files(""), std::invalid_argument);
  EXPECT_TRUE(fs::exists(kept));
}

// A directory made at the path while the tensor is being written (after the check at the
// start of the job): the exchange puts it back and the swap-out fails.
class directory_making_engine final : public testing::forwarding_engine {
 public:
  directory_making_engine(std::unique_ptr<io::io_engine> inner, std::string path)
      : forwarding_engine(std::move(inner)), path_(std::move(path)) {}
  void submit(std::span<const io::io_request> requests) override {
    if (!made_) make_directory_with_a_file(path_);
    made_ = true;
    inner_->submit(requests);
  }

 private:
  std::string path_;
  bool made_ = false;
};

// discard and remove_files delete swap files, which are regular files. Anything else at the
// path or at its spare's (a device node, a pipe, a socket, a symbolic link, a folder) was
// made by no swapper: refused, naming what it is, and nothing is removed (as root,
// discarding "/dev/null" deleted the machine's /dev/null). A packed slot is kept as well.
TEST_P(integrity, only_regular_files_are_discarded) {
  std::string fallback;
  tensor_swapper s(pool_, {.staging_buffers = 2, .pack_below = 1024}, io::make_engine(GetParam(), 8, fallback));
  const std::string fifo = dir_.file("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::string dir = dir_.file("dir");
  fs::create_directory(dir);
  const std::string target = dir_.file("target");
  std::ofstream(target) << "the target";
  const std::string link = dir_.file("link");
  fs::create_symlink(target, link);
  // (what is refused, the path the message names, what it is)
  std::vector<std::array<std::string, 3>> cases = {
      {fifo, fifo, "a pipe"}, {dir, dir, "a directory"}, {link, link, "a symbolic link"}};
  const std::string device = dir_.file("null");  // a node of the null device, where root may make one
  if (mknod(device.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0) cases.push_back({device, device, "a device"});
  // A swap file whose spare is a pipe: neither goes.
  auto t = pattern(5000, 7);
  const std::string real = dir_.file("real");
  ASSERT_EQ(swap_out_one(s, t, real), 0);
  const std::string spare = tensor_swapper::spare_path(real);
  fs::remove(spare);
  ASSERT_EQ(mkfifo(spare.c_str(), 0600), 0);
  cases.push_back({real, spare, "a pipe"});
  // A packed tensor at a path where a pipe now stands: its slot stays, and it reads back.
  auto small = pattern(100, 9);
  const std::string packed = dir_.file("packed");
  ASSERT_EQ(swap_out_one(s, small, packed), 0);
  ASSERT_EQ(mkfifo(packed.c_str(), 0600), 0);
  cases.push_back({packed, packed, "a pipe"});
  // A first packed swap-out removes the file an earlier one left at its path, and leaves a
  // pipe at the spare's path as it is.
  const std::string stale = dir_.file("stale");
  ASSERT_EQ(swap_out_one(s, t, stale), 0);  // 5000 bytes: a file of its own
  const std::string stale_spare = tensor_swapper::spare_path(stale);
  fs::remove(stale_spare);
  ASSERT_EQ(mkfifo(stale_spare.c_str(), 0600), 0);
  ASSERT_EQ(swap_out_one(s, small, stale), 0);  // 100 bytes: packed
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::is_fifo(stale_spare));
  std::vector<std::byte> stale_back(small.size());
  EXPECT_EQ(swap_in_one(s, stale_back, stale).error, 0);
  EXPECT_EQ(stale_back, small);
  for (const auto& [path, named, kind] : cases) {
    SCOPED_TRACE(path);
    struct stat before {};
    ASSERT_EQ(lstat(path.c_str(), &before), 0);
    for (const bool static_call : {false, true}) {
      try {
        if (static_call) {
          tensor_swapper::remove_files(path);
        } else {
          s.discard(path);
        }
        ADD_FAILURE() << "not refused";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(named + " is " + kind + "; only swap files (regular files) are removed"),
                  std::string::npos)
            << e.what();
      }
      struct stat after {};
      ASSERT_EQ(lstat(path.c_str(), &after), 0);
      EXPECT_EQ(after.st_mode, before.st_mode);
      EXPECT_EQ(after.st_ino, before.st_ino);
    }
  }
  EXPECT_TRUE(fs::exists(spare));
  EXPECT_EQ(fs::file_size(target), std::string("the target").size());
  std::vector<std::byte> back(small.size());
  EXPECT_EQ(swap_in_one(s, back, packed).error, 0);
  EXPECT_EQ(back, small);
  // Once the spare is a regular file again, both go.
  fs::remove(spare);
  std::ofstream(spare) << "old version";
  s.discard(real);
  EXPECT_FALSE(fs::exists(real));
  EXPECT_FALSE(fs::exists(spare));
}

TEST_P(integrity, a_directory_that_appears_during_a_swap_out_is_put_back) {
  for (const bool reuse : {true, false}) {
    SCOPED_TRACE(reuse ? "reusing spares" : "fresh files");
    const std::string path = dir_.file(reuse ? "late_r" : "late_f");
    std::string fallback;
    auto engine = std::make_unique<directory_making_engine>(io::make_engine(GetParam(), 8, fallback), path);
    tensor_swapper s(pool_, {.staging_buffers = 2, .reuse_files = reuse}, std::move(engine));
    auto t = pattern(10000, 42);
    const tensor_ref refs[] = {{t.data(), t.size()}};
    const std::string paths[] = {path};
    const swap_result r = s.wait(s.swap_out(refs, paths))[0];
    EXPECT_EQ(r.error, EISDIR);
    EXPECT_NE(r.message.find(path + " is a directory"), std::string::npos) << r.message;
    expect_untouched_directory(path);
    fs::remove_all(path);
  }
}

// The files in `dir`, by name.
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A process killed while it swaps out (without reuse: a file of the swap-out's own each time)
// leaves nothing beside the path: the new file has no name until it is whole (O_TMPFILE). The
// child swaps out again and again; once one of its open files is in the folder under another
// name than the path's and holds 8 MiB, it is killed. The path holds a whole version.
TEST_P(integrity, a_process_killed_while_it_swaps_out_leaves_nothing_beside_the_path) {
  const std::string path = dir_.file("t");
  const std::size_t bytes = std::size_t{32} << 20;
  const io::engine_kind kind = GetParam();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(ready[0]);
    try {
      memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
      tensor_swapper s(pool, {.engine = kind, .staging_buffers = 2, .reuse_files = false});
      auto first = pattern(bytes, 1);
      if (swap_out_one(s, first, path) != 0) _exit(2);
      if (write(ready[1], "r", 1) != 1) _exit(2);
      auto later = pattern(bytes, 2);
      for (;;) {
        if (swap_out_one(s, later, path) != 0) _exit(3);
      }
    } catch (...) {
      _exit(4);
    }
  }
  close(ready[1]);
  char byte = 0;
  const bool swapped_once = read(ready[0], &byte, 1) == 1;
  close(ready[0]);
  std::string seen;  // the link of the child's file being written
  const std::string fds = "/proc/" + std::to_string(child) + "/fd";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (swapped_once && seen.empty() && std::chrono::steady_clock::now() < deadline) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(fds, ec)) {
      std::error_code gone;
      const std::string to = fs::read_symlink(e.path(), gone).string();
      struct stat st {};
      if (!gone && to.rfind(dir_.path.string() + "/", 0) == 0 && to != path && stat(e.path().c_str(), &st) == 0 &&
          st.st_size >= (8 << 20)) {
        seen = to;
      }
    }
  }
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(swapped_once) << "the child failed before its first swap-out, status " << status;
  ASSERT_FALSE(seen.empty()) << "no file of the child's seen being written";
  EXPECT_NE(seen.find(" (deleted)"), std::string::npos) << seen;  // unnamed: "<folder>/#<inode> (deleted)"
  EXPECT_EQ(names_in(dir_.path), std::vector<std::string>{"t"});
  tensor_swapper s(pool_, {.engine = kind, .staging_buffers = 2});
  std::vector<std::byte> back(bytes);
  ASSERT_EQ(swap_in_one(s, back, path).error, 0);
  EXPECT_TRUE(back == pattern(bytes, 1) || back == pattern(bytes, 2));
}

// Versions swapped out without reuse, each from a file of its own, read back exact and leave
// nothing but the path: with unnamed files, and where the file system has none (O_TMPFILE
// refused as NFS refuses it, EOPNOTSUPP, or as a kernel without the flag does, EISDIR), from
// files named at once.
TEST_P(integrity, without_unnamed_files_own_files_are_named_at_once_and_nothing_is_left) {
  const std::string path = dir_.file("t");
  const auto versions = [&] {  // (its own pool: it runs in a forked child too)
    memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
    tensor_swapper s(pool, {.engine = GetParam(), .staging_buffers = 2, .reuse_files = false});
    for (std::uint64_t seed = 1; seed <= 3; ++seed) {
      auto v = pattern((std::size_t{3} << 20) + 100, seed);
      std::vector<std::byte> back(v.size());
      if (swap_out_one(s, v, path) != 0 || swap_in_one(s, back, path).error != 0 || back != v) return false;
    }
    s.synchronize();
    return true;
  };
  ASSERT_TRUE(versions());
  {
    const testing::named_temporaries named;
    EXPECT_TRUE(versions());
  }
  for (const int refusal : {EOPNOTSUPP, EISDIR}) {
    const int status = testing::without_unnamed_files(dir_.path, versions, refusal);
    if (status == 77) GTEST_SKIP() << "no seccomp filter here";
    EXPECT_EQ(status, 0) << refusal;
  }
  fs::remove(path);
  // The reaper removes what each commit displaced by the time the swapper is gone.
  EXPECT_TRUE(names_in(dir_.path).empty()) << names_in(dir_.path).front();
}

// A file system with unnamed files that cannot link one (no hard links): the swap-out whose
// link is refused copies its file into a new file of the name it was to take (by
// copy_file_range, or through a buffer where that is refused) and commits that; the swapper
// says so in its fallback and names its later files from the start. A failed copy fails that
// swap-out with its errno and reason, leaves nothing and keeps the path's version.
TEST_P(integrity, a_file_system_that_cannot_link_an_unnamed_file_copies_it_then_names_files) {
  const std::string path = dir_.file("t");
  const io::engine_kind kind = GetParam();
  const std::size_t bytes = (std::size_t{3} << 20) + 100;
  struct way {
    std::vector<std::pair<long, int>> failing;
    int error;  // of the first swap-out
  };
  for (const way& w : {way{{{SYS_linkat, EPERM}}, 0}, way{{{SYS_linkat, EOPNOTSUPP}, {SYS_copy_file_range, ENOSYS}}, 0},
                       way{{{SYS_linkat, EPERM}, {SYS_copy_file_range, EIO}}, EIO}}) {
    {
      tensor_swapper s(pool_, {.engine = kind, .staging_buffers = 2, .reuse_files = false});
      auto v0 = pattern(bytes, 0);
      ASSERT_EQ(swap_out_one(s, v0, path), 0);
    }
    const int status = testing::with_failing_syscalls(w.failing, [&] {
      memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
      tensor_swapper s(pool, {.engine = kind, .staging_buffers = 2, .reuse_files = false});
      auto v = pattern(bytes, 1);
      const tensor_ref refs[] = {{v.data(), v.size()}};
      const std::string paths[] = {path};
      const swap_result r = s.wait(s.swap_out(refs, paths))[0];
      const std::string reason = "swap-out of " + path + ": the file system cannot link its new file (" +
                                 std::strerror(w.failing.front().second) + ") and copying it to " + path +
                                 ".tensormem-tmp.";
      bool ok = r.error == w.error && (w.error == 0 || (r.message.rfind(reason, 0) == 0 &&
                                                        r.message.find(std::strerror(w.error)) != std::string::npos));
      if (!ok) std::fprintf(stderr, "first swap-out: %d %s\n", r.error, r.message.c_str());
      std::vector<std::byte> back(bytes);
      ok = ok && swap_in_one(s, back, path).error == 0 && back == pattern(bytes, w.error == 0 ? 1 : 0);
      ok = ok && s.stats().fallback.find("cannot link a file made without a name") != std::string::npos;
      for (std::uint64_t seed = 2; ok && seed <= 3; ++seed) {
        auto later = pattern(bytes, seed);
        ok = swap_out_one(s, later, path) == 0 && swap_in_one(s, back, path).error == 0 && back == later;
      }
      s.synchronize();
      return ok;
    });
    if (status == 77) GTEST_SKIP() << "no seccomp filter here";
    EXPECT_EQ(status, 0) << w.failing.size() << " failing, the last " << w.failing.back().first;
    // (what a commit displaced is gone once its swapper is: the reaper removes it)
    EXPECT_EQ(names_in(dir_.path), std::vector<std::string>{"t"});
  }
}

// The name an unnamed file takes at its commit is the job's own
// (`path.tensormem-tmp.<pid>.<swapper>.<job>`). A file left there (by an earlier process of
// this pid) is replaced, as a file named from the start would have been; a symbolic link
// there is left as it is and fails the swap-out (EEXIST), the path keeping its version.
TEST_P(integrity, a_file_at_the_name_an_unnamed_file_takes_is_replaced_and_a_link_fails_the_swap_out) {
  const std::string path = dir_.file("t");
  auto arrived = std::make_shared<testing::gate>();
  auto go = std::make_shared<testing::gate>();
  std::string why;
  tensor_swapper s(pool_, {.staging_buffers = 2, .reuse_files = false},
                   std::make_unique<testing::held_submit_engine>(io::make_engine(GetParam(), 32, why), arrived, go));
  // The first job's file, named at once and held at the engine, tells the names of the next.
  auto v1 = pattern(std::size_t{1} << 20, 1);
  std::string own;
  {
    const testing::named_temporaries named;
    const tensor_ref refs[] = {{v1.data(), v1.size()}};
    const std::string paths[] = {path};
    const std::uint64_t ticket = s.swap_out(refs, paths);
    arrived->pass();
    const std::vector<std::string> temporaries = testing::temporary_files_in(dir_.path);
    go->open();
    ASSERT_EQ(s.wait(ticket)[0].error, 0);
    ASSERT_EQ(temporaries.size(), 1U);
    own = dir_.file(temporaries[0]);
    ASSERT_EQ(own.substr(own.size() - 2), ".1");
  }
  const std::string second = own.substr(0, own.size() - 1) + "2";
  const std::string third = own.substr(0, own.size() - 1) + "3";
  { std::ofstream(second) << "left by an earlier process"; }
  auto v2 = pattern(std::size_t{1} << 20, 2);
  const swap_result r2 = [&] {
    const tensor_ref refs[] = {{v2.data(), v2.size()}};
    const std::string paths[] = {path};
    return s.wait(s.swap_out(refs, paths))[0];
  }();
  EXPECT_EQ(r2.error, 0) << r2.message;
  fs::create_symlink(dir_.file("elsewhere"), third);
  auto v3 = pattern(std::size_t{1} << 20, 3);
  const tensor_ref refs[] = {{v3.data(), v3.size()}};
  const std::string paths[] = {path};
  const swap_result r3 = s.wait(s.swap_out(refs, paths))[0];
  EXPECT_EQ(r3.error, EEXIST);
  EXPECT_NE(r3.message.find("cannot name its new file " + third + ": File exists"), std::string::npos) << r3.message;
  EXPECT_TRUE(fs::is_symlink(third));
  EXPECT_FALSE(fs::exists(dir_.file("elsewhere")));
  std::vector<std::byte> back(v2.size());
  ASSERT_EQ(swap_in_one(s, back, path).error, 0);
  EXPECT_EQ(back, v2);
  s.synchronize();
  fs::remove(third);
  EXPECT_EQ(names_in(dir_.path), std::vector<std::string>{"t"});
}

INSTANTIATE_TEST_SUITE_P(engines, integrity,
                         ::testing::Values(io::engine_kind::uring, io::engine_kind::threads),
                         [](const auto& p) { return std::string(io::to_string(p.param)); });

}  // namespace
}  // namespace tensormem::swap
