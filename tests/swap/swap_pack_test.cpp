// Packed small tensors: one unnamed file per directory, slots from an offset allocator. By
// content against an oracle over random rewrites that move paths between pack and files,
// with failures, corruption, misuse and discards.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "swap_test_support.hpp"
#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/swap/tensor_swapper.hpp"

namespace tensormem::swap {
namespace {

namespace fs = std::filesystem;
using testing::pattern;
using testing::scratch_dir;

class pack_test : public ::testing::TestWithParam<io::engine_kind> {
 protected:
  swap_options options(std::size_t pack_below) const {
    return {.engine = GetParam(), .queue_depth = 16, .block_bytes = std::size_t{64} << 10,
            .staging_buffers = 4, .pack_below = pack_below};
  }
};

// A tensor's memory: from the pinned pool (aligned: moved straight) or a vector at an odd
// address (staged).
struct tensor_memory {
  std::vector<std::byte> heap;
  void* pinned = nullptr;
  tensor_ref ref;
};

// Random rounds: each rewrites a random subset of paths with new bytes of a new size (some
// packed, some above the threshold and so in files of their own), then every path is read
// back and compared with what was last written; the paths are where the contract says.
TEST_P(pack_test, random_rewrites_between_pack_and_files_read_back_what_was_written) {
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  memory::pinned_pool pool({.slab_bytes = std::size_t{16} << 20});
  const std::size_t pack_below = 100'000;
  tensor_swapper swapper(pool, options(pack_below));
  std::mt19937_64 rng(11);
  constexpr int paths_count = 40;
  std::map<std::string, std::vector<std::byte>> oracle;
  for (int round = 0; round < 8; ++round) {
    std::vector<std::string> paths;
    std::vector<tensor_memory> mem(paths_count);
    std::vector<tensor_ref> refs;
    for (int i = 0; i < paths_count; ++i) {
      if (round > 0 && rng() % 3 == 0) continue;  // left as it is
      const std::string path = dir.file("t" + std::to_string(i));
      std::size_t bytes = rng() % 5 == 0 ? pack_below + 1 + rng() % 200'000 : rng() % (pack_below + 1);
      if (rng() % 7 == 0) bytes = pack_below;  // the edge: packed
      if (rng() % 11 == 0) bytes = 0;
      oracle[path] = pattern(bytes, rng());
      tensor_memory& m = mem[static_cast<std::size_t>(i)];
      if (rng() % 2 == 0 && bytes > 0) {
        m.pinned = pool.allocate((bytes + 4095) / 4096 * 4096, 4096);
        std::memcpy(m.pinned, oracle[path].data(), bytes);
        m.ref = {m.pinned, bytes};
      } else {
        m.heap.resize(bytes + 1);
        std::copy(oracle[path].begin(), oracle[path].end(), m.heap.begin() + 1);
        m.ref = {m.heap.data() + 1, bytes};
      }
      paths.push_back(path);
      refs.push_back(m.ref);
    }
    for (const swap_result& r : swapper.wait(swapper.swap_out(refs, paths))) {
      ASSERT_EQ(r.error, 0) << r.path << ": " << r.message;
    }
    for (auto& m : mem) {
      if (m.pinned != nullptr) pool.free(m.pinned);
    }
    // Read everything back into fresh memory.
    std::vector<std::string> all;
    std::vector<std::vector<std::byte>> back;
    std::vector<tensor_ref> back_refs;
    for (const auto& [path, bytes] : oracle) {
      all.push_back(path);
      back.emplace_back(bytes.size());
    }
    for (auto& b : back) back_refs.push_back({b.data(), b.size()});
    const auto results = swapper.wait(swapper.swap_in(all, back_refs));
    std::uint64_t packed = 0;
    for (std::size_t k = 0; k < all.size(); ++k) {
      ASSERT_EQ(results[k].error, 0) << all[k] << ": " << results[k].message;
      EXPECT_EQ(back[k], oracle[all[k]]) << all[k] << " in round " << round;
      const bool in_pack = oracle[all[k]].size() <= pack_below;
      packed += in_pack ? 1 : 0;
      // A packed path has no file (a file left by an earlier version is gone); a file
      // tensor's file is at its path.
      EXPECT_EQ(fs::exists(all[k]), !in_pack) << all[k] << " in round " << round;
    }
    EXPECT_EQ(swapper.stats().packed_tensors, packed);
  }
}

// Uniform rewrites: the pack stays within twice the live bytes (each new version takes a
// slot beside the current one, which is freed when the new one is complete).
TEST_P(pack_test, rewrites_reuse_freed_slots) {
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  memory::pinned_pool pool({.slab_bytes = std::size_t{16} << 20});
  tensor_swapper swapper(pool, options(std::size_t{1} << 20));
  constexpr std::size_t count = 64;
  constexpr std::size_t bytes = 64 << 10;
  std::vector<std::byte*> data;
  std::vector<tensor_ref> refs;
  std::vector<std::string> paths;
  for (std::size_t i = 0; i < count; ++i) {
    data.push_back(static_cast<std::byte*>(pool.allocate(bytes, 4096)));
    refs.push_back({data.back(), bytes});
    paths.push_back(dir.file("p" + std::to_string(i)));
  }
  for (std::size_t round = 0; round < 10; ++round) {
    for (std::size_t i = 0; i < count; ++i) {
      const auto v = pattern(bytes, round * 1000 + i);
      std::memcpy(data[i], v.data(), bytes);
    }
    for (const auto& r : swapper.wait(swapper.swap_out(refs, paths))) ASSERT_EQ(r.error, 0) << r.message;
    EXPECT_LE(swapper.stats().pack_file_bytes, 2 * count * bytes) << "round " << round;
  }
  for (std::size_t i = 0; i < count; ++i) std::memset(data[i], 0, bytes);
  for (const auto& r : swapper.wait(swapper.swap_in(paths, refs))) ASSERT_EQ(r.error, 0) << r.message;
  for (std::size_t i = 0; i < count; ++i) {
    EXPECT_EQ(std::memcmp(data[i], pattern(bytes, 9 * 1000 + i).data(), bytes), 0) << i;
  }
  for (std::byte* p : data) pool.free(p);
}

// The descriptor of the pack in `dir` (an unnamed file: its link reads "<dir>/#... (deleted)"
// or the unlinked name).
int pack_descriptor(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = fs::read_symlink(e.path(), ec).string();
    if (!ec && target.starts_with(dir.string() + "/") && target.ends_with("(deleted)")) {
      return std::stoi(e.path().filename().string());
    }
  }
  return -1;
}

// The status flags of open file `fd` (/proc/self/fdinfo), -1 where they cannot be read.
long status_flags(int fd) {
  std::ifstream info("/proc/self/fdinfo/" + std::to_string(fd));
  std::string key;
  long flags = -1;
  while (info >> key && key != "flags:") {
  }
  info >> std::oct >> flags;
  return flags;
}

// Whether files in `dir`'s file system open with O_DIRECT (tried on a file made there).
bool direct_allowed_in(const fs::path& dir) {
  const fs::path probe = dir / ".direct-probe";
  std::ofstream(probe) << "x";
  const int fd = open(probe.c_str(), O_RDONLY | O_DIRECT);
  if (fd >= 0) close(fd);
  fs::remove(probe);
  return fd >= 0;
}

// The pack moves its bytes straight (O_DIRECT) where the swapper asks for it and the file
// system allows it, through the page cache otherwise.
TEST_P(pack_test, the_pack_is_moved_straight_where_asked_and_allowed) {
  for (const bool direct : {true, false}) {
    scratch_dir dir;
    ASSERT_FALSE(dir.path.empty());
    memory::pinned_pool pool({.slab_bytes = std::size_t{4} << 20});
    swap_options o = options(std::size_t{1} << 20);
    o.direct = direct;
    tensor_swapper swapper(pool, o);
    auto a = pattern(10'000, 3);
    const tensor_ref refs[] = {{a.data(), a.size()}};
    const std::string paths[] = {dir.file("a")};
    ASSERT_EQ(swapper.wait(swapper.swap_out(refs, paths)).at(0).error, 0);
    const int pack = pack_descriptor(dir.path);
    ASSERT_GE(pack, 0) << "no pack file open for " << dir.path;
    const long flags = status_flags(pack);
    ASSERT_GE(flags, 0);
    EXPECT_EQ((flags & O_DIRECT) != 0, direct && direct_allowed_in(dir.path)) << "direct asked: " << direct;
    std::vector<std::byte> back(a.size());
    const tensor_ref back_refs[] = {{back.data(), back.size()}};
    ASSERT_EQ(swapper.wait(swapper.swap_in(paths, back_refs)).at(0).error, 0);
    EXPECT_EQ(back, a);
  }
}

TEST_P(pack_test, corruption_mismatch_discard_and_misuse_are_reported) {
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  memory::pinned_pool pool({.slab_bytes = std::size_t{4} << 20});
  tensor_swapper swapper(pool, options(std::size_t{1} << 20));
  auto a = pattern(10'000, 1);
  auto b = pattern(20'000, 2);
  const tensor_ref refs[] = {{a.data(), a.size()}, {b.data(), b.size()}};
  const std::string paths[] = {dir.file("a"), dir.file("b")};
  for (const auto& r : swapper.wait(swapper.swap_out(refs, paths))) ASSERT_EQ(r.error, 0) << r.message;

  // Another size: refused before any byte moves.
  std::vector<std::byte> wrong(10'001);
  const tensor_ref wrong_ref{wrong.data(), wrong.size()};
  auto r = swapper.wait(swapper.swap_in({&paths[0], 1}, {&wrong_ref, 1}));
  EXPECT_EQ(r.at(0).error, EINVAL);
  EXPECT_NE(r.at(0).message.find("holds 10000 bytes"), std::string::npos) << r.at(0).message;

  // A flipped bit in the pack: the checksum kept in the index catches it.
  const int fd = pack_descriptor(dir.path);
  ASSERT_GE(fd, 0) << "no pack file open for " << dir.path;
  const int writable = open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDWR);
  ASSERT_GE(writable, 0);
  // Find one of the tensors' first bytes in the pack and flip a bit there.
  std::vector<std::byte> pack_bytes(std::size_t{64} << 10);
  const auto got = pread(writable, pack_bytes.data(), pack_bytes.size(), 0);
  ASSERT_GT(got, 0);
  const auto at = std::search(pack_bytes.begin(), pack_bytes.begin() + got, b.begin(), b.begin() + 64);
  ASSERT_NE(at, pack_bytes.begin() + got) << "b's bytes are not in the pack";
  const auto offset = static_cast<off_t>(at - pack_bytes.begin()) + 100;
  std::byte flipped = pack_bytes[static_cast<std::size_t>(offset)] ^ std::byte{0x10};
  ASSERT_EQ(pwrite(writable, &flipped, 1, offset), 1);
  ASSERT_EQ(fsync(writable), 0);
  close(writable);
  std::vector<std::byte> b_back(b.size());
  const tensor_ref b_ref{b_back.data(), b_back.size()};
  r = swapper.wait(swapper.swap_in({&paths[1], 1}, {&b_ref, 1}));
  EXPECT_EQ(r.at(0).error, EBADMSG) << r.at(0).message;
  // a is untouched.
  std::vector<std::byte> a_back(a.size());
  const tensor_ref a_ref{a_back.data(), a_back.size()};
  r = swapper.wait(swapper.swap_in({&paths[0], 1}, {&a_ref, 1}));
  ASSERT_EQ(r.at(0).error, 0) << r.at(0).message;
  EXPECT_EQ(a_back, a);

  // Discard: the slot is freed and the path reads as never written; a busy path refuses.
  const auto ticket = swapper.swap_out({&refs[1], 1}, {&paths[1], 1});
  EXPECT_THROW(swapper.discard(paths[1]), std::invalid_argument);
  ASSERT_EQ(swapper.wait(ticket).at(0).error, 0);
  EXPECT_EQ(swapper.stats().packed_tensors, 2U);
  swapper.discard(paths[0]);
  EXPECT_EQ(swapper.stats().packed_tensors, 1U);
  r = swapper.wait(swapper.swap_in({&paths[0], 1}, {&a_ref, 1}));
  EXPECT_EQ(r.at(0).error, ENOENT) << r.at(0).message;
  EXPECT_NE(r.at(0).message.find("or discarded"), std::string::npos) << r.at(0).message;
}

// A packed swap-out that fails (the file-size limit stops the pack from growing) keeps the
// version before it; the slot it took is given back.
TEST_P(pack_test, a_failed_packed_swap_out_keeps_the_old_version) {
  const io::engine_kind kind = GetParam();
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string a_path = dir.file("a");
  const std::string big_path = dir.file("big");
  const pid_t pid = fork();
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
    tensor_swapper swapper(pool, {.engine = kind, .queue_depth = 8, .block_bytes = std::size_t{64} << 10,
                                  .staging_buffers = 4, .pack_below = std::size_t{4} << 20});
    auto a = pattern(50'000, 5);
    const tensor_ref a_ref{a.data(), a.size()};
    bool ok = swapper.wait(swapper.swap_out({&a_ref, 1}, {&a_path, 1})).at(0).error == 0;
    rlimit limit{1 << 20, 1 << 20};
    setrlimit(RLIMIT_FSIZE, &limit);
    auto big = pattern(std::size_t{2} << 20, 6);
    const tensor_ref big_out{big.data(), big.size()};
    ok = ok && swapper.wait(swapper.swap_out({&big_out, 1}, {&big_path, 1})).at(0).error == EFBIG;
    // The failed slot was given back: a's next version fits below the limit.
    auto a2 = pattern(50'000, 7);
    const tensor_ref a2_ref{a2.data(), a2.size()};
    ok = ok && swapper.wait(swapper.swap_out({&a2_ref, 1}, {&a_path, 1})).at(0).error == 0;
    std::vector<std::byte> back(a2.size());
    const tensor_ref back_ref{back.data(), back.size()};
    ok = ok && swapper.wait(swapper.swap_in({&a_path, 1}, {&back_ref, 1})).at(0).error == 0 && back == a2;
    std::vector<std::byte> big_back(big.size());
    const tensor_ref big_ref{big_back.data(), big_back.size()};
    ok = ok && swapper.wait(swapper.swap_in({&big_path, 1}, {&big_ref, 1})).at(0).error == ENOENT;
    ok = ok && swapper.stats().packed_tensors == 1;
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// A full disk: a 4 MiB tmpfs in a mount namespace of a child of its own (root only). The
// pack grows by fallocate; the tensor that does not fit fails with ENOSPC before a byte is
// written, and what was packed before stays readable.
TEST_P(pack_test, a_full_disk_fails_the_tensor_that_does_not_fit) {
  const io::engine_kind kind = GetParam();
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  EXPECT_FULL_DISK_CHILD(testing::in_small_tmpfs(dir.path, "size=4m", [&] {
    memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
    tensor_swapper swapper(pool, {.engine = kind, .queue_depth = 8, .block_bytes = std::size_t{64} << 10,
                                  .staging_buffers = 4, .pack_below = std::size_t{8} << 20});
    const std::string a_path = dir.file("a");
    const std::string big_path = dir.file("big");
    auto a = pattern(std::size_t{1} << 20, 8);
    const tensor_ref a_ref{a.data(), a.size()};
    bool ok = swapper.wait(swapper.swap_out({&a_ref, 1}, {&a_path, 1})).at(0).error == 0;
    auto big = pattern(std::size_t{6} << 20, 9);
    const tensor_ref big_ref{big.data(), big.size()};
    const auto r = swapper.wait(swapper.swap_out({&big_ref, 1}, {&big_path, 1}));
    ok = ok && r.at(0).error == ENOSPC && r.at(0).message.find("cannot grow the pack") != std::string::npos;
    std::vector<std::byte> back(a.size());
    const tensor_ref back_ref{back.data(), back.size()};
    return ok && swapper.wait(swapper.swap_in({&a_path, 1}, {&back_ref, 1})).at(0).error == 0 && back == a;
  }));
}

// Where the file system has no unnamed files, the pack is a file of the swapper's own created
// under a fresh name and unlinked at once. Names already taken, by a link to a user's file, a
// dangling link or a stale file, are passed over and left as they are: no byte goes through
// them, and nothing is created where a link points.
TEST_P(pack_test, without_unnamed_files_the_pack_takes_a_free_name_and_leaves_taken_ones_alone) {
  const io::engine_kind kind = GetParam();
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const auto taken = [&](int n) {
    return dir.path / (".tensormem-pack." + std::to_string(getpid()) + "." + std::to_string(n));
  };
  const auto read_all = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const int status = testing::without_unnamed_files(dir.path, [&] {
    const fs::path notes = dir.path / "notes";
    std::ofstream(notes) << "the user's notes";
    const fs::path nowhere = dir.path / "nowhere";
    fs::create_symlink(notes, taken(0));
    fs::create_symlink(nowhere, taken(1));
    std::ofstream(taken(2)) << "stale";
    memory::pinned_pool pool({.slab_bytes = std::size_t{4} << 20});
    tensor_swapper swapper(pool, {.engine = kind, .queue_depth = 8, .block_bytes = std::size_t{64} << 10,
                                  .staging_buffers = 4, .pack_below = std::size_t{1} << 20});
    bool ok = true;
    std::vector<std::vector<std::byte>> bytes;
    std::vector<tensor_ref> refs;
    std::vector<std::string> paths;
    for (std::size_t i = 0; i < 3; ++i) bytes.push_back(pattern(5'000 + 30'000 * i, 20 + i));
    for (std::size_t i = 0; i < 3; ++i) {
      refs.push_back({bytes[i].data(), bytes[i].size()});
      paths.push_back(dir.file("t" + std::to_string(i)));
    }
    for (const auto& r : swapper.wait(swapper.swap_out(refs, paths))) ok = ok && r.error == 0;
    std::vector<std::vector<std::byte>> back;
    std::vector<tensor_ref> back_refs;
    for (std::size_t i = 0; i < 3; ++i) back.emplace_back(bytes[i].size());
    for (std::size_t i = 0; i < 3; ++i) back_refs.push_back({back[i].data(), back[i].size()});
    for (const auto& r : swapper.wait(swapper.swap_in(paths, back_refs))) ok = ok && r.error == 0;
    ok = ok && back == bytes && swapper.stats().packed_tensors == 3;
    if (!ok) std::fprintf(stderr, "the packed tensors did not come back\n");
    // The pack is open, unlinked; the taken names are as they were; nothing else is there.
    const int pack = pack_descriptor(dir.path);
    ok = ok && pack >= 0;
    // Moved straight (O_DIRECT, set after the creation) where this file system allows it.
    const bool direct_here = direct_allowed_in(dir.path);
    const long flags = status_flags(pack);
    ok = ok && flags >= 0 && ((flags & O_DIRECT) != 0) == direct_here;
    if (!ok) std::fprintf(stderr, "pack %d, flags %lo, O_DIRECT here: %d\n", pack, flags, direct_here);
    ok = ok && read_all(notes) == "the user's notes" && fs::read_symlink(taken(0)) == notes;
    ok = ok && !fs::exists(fs::symlink_status(nowhere)) && fs::read_symlink(taken(1)) == nowhere;
    ok = ok && read_all(taken(2)) == "stale";
    std::size_t entries = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path)) ++entries;
    ok = ok && entries == 4;  // notes and the three taken names; packed tensors have no files
    if (!ok) std::fprintf(stderr, "the pack went through a taken name\n");
    return ok;
  });
  if (status == 77) GTEST_SKIP() << "cannot install a seccomp filter here";
  EXPECT_EQ(status, 0);
}

// A kernel that does not know O_TMPFILE opens the folder itself and refuses to write it
// (EISDIR): the pack is a named file unlinked at once there too.
TEST_P(pack_test, a_kernel_without_unnamed_files_gets_a_named_pack) {
  const io::engine_kind kind = GetParam();
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const int status = testing::without_unnamed_files(dir.path, [&] {
    memory::pinned_pool pool({.slab_bytes = std::size_t{4} << 20});
    tensor_swapper swapper(pool, {.engine = kind, .staging_buffers = 2, .pack_below = std::size_t{1} << 20});
    auto t = pattern(7'000, 31);
    std::vector<std::byte> back(t.size());
    const std::string path = dir.file("t");
    const tensor_ref out{t.data(), t.size()}, in{back.data(), back.size()};
    bool ok = swapper.wait(swapper.swap_out({&out, 1}, {&path, 1})).at(0).error == 0;
    ok = ok && swapper.wait(swapper.swap_in({&path, 1}, {&in, 1})).at(0).error == 0;
    ok = ok && back == t && swapper.stats().packed_tensors == 1 && pack_descriptor(dir.path) >= 0;
    return ok && fs::is_empty(dir.path);
  }, EISDIR);
  if (status == 77) GTEST_SKIP() << "cannot install a seccomp filter here";
  EXPECT_EQ(status, 0);
}

// One batch of packed and unpacked tensors, out and back in: the packed ones are read in
// the order of their slots, the others as given, and every tensor comes back.
TEST_P(pack_test, a_batch_of_packed_and_unpacked_tensors_comes_back) {
  const io::engine_kind kind = GetParam();
  scratch_dir dir;
  memory::pinned_pool pool({.slab_bytes = std::size_t{4} << 20});
  tensor_swapper swapper(pool, {.engine = kind, .staging_buffers = 2, .pack_below = std::size_t{64} << 10});
  std::vector<std::vector<std::byte>> bytes;
  std::vector<tensor_ref> refs, back_refs;
  std::vector<std::string> paths;
  for (std::size_t i = 0; i < 6; ++i) bytes.push_back(pattern(i % 2 == 0 ? 3'000 + 1'000 * i : 100'000 + i, 40 + i));
  for (std::size_t i = 0; i < 6; ++i) {
    refs.push_back({bytes[i].data(), bytes[i].size()});
    paths.push_back(dir.file("m" + std::to_string(i)));
  }
  for (const auto& r : swapper.wait(swapper.swap_out(refs, paths))) EXPECT_EQ(r.error, 0) << r.message;
  EXPECT_EQ(swapper.stats().packed_tensors, 3U);
  std::vector<std::vector<std::byte>> back;
  for (const auto& b : bytes) back.emplace_back(b.size());
  for (auto& b : back) back_refs.push_back({b.data(), b.size()});
  std::reverse(back_refs.begin(), back_refs.end());
  std::reverse(paths.begin(), paths.end());
  for (const auto& r : swapper.wait(swapper.swap_in(paths, back_refs))) {
    EXPECT_EQ(r.error, 0) << r.message;
    EXPECT_EQ(r.message, "");  // a success has no words
  }
  EXPECT_EQ(back, bytes);
}

// A pack opened buffered by choice says nothing of O_DIRECT; opened for O_DIRECT where the
// file system takes it, it moves straight and says nothing either; only a refusal is noted.
TEST_P(pack_test, a_pack_notes_buffered_io_only_where_o_direct_was_refused) {
  const io::engine_kind kind = GetParam();
  scratch_dir dir;
  const fs::path probe = dir.path / "probe";
  const int fd = open(probe.c_str(), O_CREAT | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
  const bool takes_direct = fd >= 0;
  if (fd >= 0) close(fd);
  fs::remove(probe);
  for (const bool direct : {false, true}) {
    SCOPED_TRACE(direct ? "direct" : "buffered");
    memory::pinned_pool pool({.slab_bytes = std::size_t{4} << 20});
    tensor_swapper swapper(pool, {.engine = kind, .staging_buffers = 2, .direct = direct,
                                  .pack_below = std::size_t{1} << 20});
    auto t = pattern(7'000, 32);
    const std::string path = dir.file(direct ? "d" : "b");
    const tensor_ref out{t.data(), t.size()};
    ASSERT_EQ(swapper.wait(swapper.swap_out({&out, 1}, {&path, 1})).at(0).error, 0);
    const swap_stats st = swapper.stats();
    EXPECT_EQ(st.packed_tensors, 1U);
    EXPECT_EQ(st.direct, direct && takes_direct);
    EXPECT_EQ(st.fallback.find("O_DIRECT refused") != std::string::npos, direct && !takes_direct) << st.fallback;
  }
}

// No free name among the pack's tries: the swap-out fails with EEXIST and says where, and
// nothing is created behind the dangling links that took the names.
TEST_P(pack_test, without_unnamed_files_and_no_free_name_the_swap_out_fails) {
  const io::engine_kind kind = GetParam();
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const int status = testing::without_unnamed_files(dir.path, [&] {
    for (int n = 0; n < 1000; ++n) {
      const std::string name = ".tensormem-pack." + std::to_string(getpid()) + "." + std::to_string(n);
      fs::create_symlink(dir.path / "target", dir.path / name);
    }
    memory::pinned_pool pool({.slab_bytes = std::size_t{4} << 20});
    tensor_swapper swapper(pool, {.engine = kind, .queue_depth = 8, .block_bytes = std::size_t{64} << 10,
                                  .staging_buffers = 4, .pack_below = std::size_t{1} << 20});
    auto a = pattern(10'000, 30);
    const tensor_ref a_ref{a.data(), a.size()};
    const std::string a_path = dir.file("a");
    const auto r = swapper.wait(swapper.swap_out({&a_ref, 1}, {&a_path, 1}));
    const std::string want = "cannot create a pack file in " + dir.path.string() + ": ";
    const bool ok = r.at(0).error == EEXIST && r.at(0).message.starts_with(want) &&
                    !fs::exists(fs::symlink_status(dir.path / "target")) && !fs::exists(a_path);
    if (!ok) std::fprintf(stderr, "error %d: %s\n", r.at(0).error, r.at(0).message.c_str());
    return ok;
  });
  if (status == 77) GTEST_SKIP() << "cannot install a seccomp filter here";
  EXPECT_EQ(status, 0);
}

INSTANTIATE_TEST_SUITE_P(engines, pack_test,
                         ::testing::Values(io::engine_kind::uring, io::engine_kind::threads),
                         [](const auto& param_info) { return std::string(io::to_string(param_info.param)); });

}  // namespace
}  // namespace tensormem::swap
