// Raw file transfers (DeepSpeed's aio_handle semantics): byte equality with plain writes at
// any offset, no truncation, progress without the caller, and every failure reported with
// its path and errno (at queuing, or per operation by wait).

#include <gtest/gtest.h>

#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <system_error>
#include <thread>

#include "tensormem/io/file_io.hpp"
#include "tensormem/io/path_argument.hpp"
#include "../swap/swap_test_support.hpp"

namespace tensormem::io {
namespace {

using swap::testing::pattern;
using swap::testing::scratch_dir;
using swap::testing::aligned_buffer;
using swap::testing::file_bytes;

void write_plain(const std::string& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

struct config {
  engine_kind engine;
  unsigned rings;
};

class file_io_test : public ::testing::TestWithParam<config> {
 protected:
  file_io_options options(std::size_t block = 64 << 10) const {
    file_io_options o;
    o.block_bytes = block;
    o.queue_depth = 8;
    o.rings = GetParam().rings;
    o.engine = GetParam().engine;
    return o;
  }
};

// Random operations, aligned (O_DIRECT) and not (buffered), at random offsets of one file:
// the file equals a model kept with plain writes, and reads return the model's bytes.
TEST_P(file_io_test, random_reads_and_writes_match_a_plain_model) {
  scratch_dir dir;
  const std::string path = (dir.path / "raw").string();
  std::vector<std::byte> model;
  std::mt19937_64 rng(17);
  async_file_io io(options());
  for (int round = 0; round < 40; ++round) {
    const bool aligned = rng() % 2 == 0;
    const std::size_t bytes = aligned ? 4096 * (1 + rng() % 64) : 1 + rng() % 300'000;
    const std::uint64_t offset = aligned ? 4096 * (rng() % 64) : rng() % 200'000;
    aligned_buffer buffer(bytes + 1);
    std::byte* at = buffer.data + (aligned ? 0 : 1);  // unaligned buffers too
    const bool write = model.size() < offset + bytes || rng() % 2 == 0;
    if (write) {
      const auto data = pattern(bytes, rng());
      std::memcpy(at, data.data(), bytes);
      io.write(at, bytes, path, offset);
      const auto r = io.wait();
      ASSERT_EQ(r.completed, 1U);
      ASSERT_TRUE(r.errors.empty()) << r.errors[0].message;
      if (model.size() < offset + bytes) model.resize(offset + bytes);  // a hole reads as zeros
      std::memcpy(model.data() + offset, data.data(), bytes);
      ASSERT_EQ(file_bytes(path), model) << "round " << round;
    } else {
      io.read(at, bytes, path, offset);
      const auto r = io.wait();
      ASSERT_TRUE(r.errors.empty()) << r.errors[0].message;
      ASSERT_EQ(std::memcmp(at, model.data() + offset, bytes), 0) << "round " << round;
    }
  }
  const file_io_stats s = io.stats();
  EXPECT_GT(s.direct_ops, 0U);
  EXPECT_GT(s.buffered_ops, 0U);
  EXPECT_EQ(s.ops, 40U);
  EXPECT_EQ(s.failed, 0U);
}

// Many operations queued at once over several files; the bytes reach the disk while the
// caller sleeps (only the rings' threads can move them); wait counts every one.
TEST_P(file_io_test, queued_operations_complete_without_the_caller) {
  scratch_dir dir;
  constexpr int count = 24;
  constexpr std::size_t bytes = std::size_t{1} << 20;
  std::vector<std::unique_ptr<aligned_buffer>> buffers;
  async_file_io io(options());
  for (int i = 0; i < count; ++i) {
    buffers.push_back(std::make_unique<aligned_buffer>(bytes));
    const auto data = pattern(bytes, static_cast<std::uint64_t>(i));
    std::memcpy(buffers.back()->data, data.data(), bytes);
    io.write(buffers.back()->data, bytes, (dir.path / std::to_string(i)).string(), 0);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (io.stats().ops < count && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(io.stats().ops, static_cast<std::uint64_t>(count));
  EXPECT_EQ(io.pending(), static_cast<std::size_t>(count));
  const auto r = io.wait();
  EXPECT_EQ(r.completed, static_cast<std::size_t>(count));
  EXPECT_TRUE(r.errors.empty());
  EXPECT_EQ(io.wait().completed, 0U) << "a second wait finds nothing new";
  for (int i = 0; i < count; ++i) {
    EXPECT_EQ(file_bytes((dir.path / std::to_string(i)).string()), pattern(bytes, static_cast<std::uint64_t>(i)));
  }
  EXPECT_EQ(io.stats().requests, count * bytes / (64 << 10));
}

// A write never truncates: the bytes around the written range stay.
TEST_P(file_io_test, a_write_keeps_the_bytes_around_it) {
  scratch_dir dir;
  const std::string path = (dir.path / "keep").string();
  auto before = pattern(3 * 4096, 1);
  write_plain(path, before);
  aligned_buffer b(4096);
  std::memset(b.data, 0x5a, 4096);
  async_file_io io(options());
  io.write(b.data, 4096, path, 4096);
  ASSERT_TRUE(io.wait().errors.empty());
  std::memset(before.data() + 4096, 0x5a, 4096);
  EXPECT_EQ(file_bytes(path), before);
}

TEST_P(file_io_test, errors_at_queuing_name_the_path_and_queue_nothing) {
  scratch_dir dir;
  async_file_io io(options());
  aligned_buffer b(8192);
  const std::string missing = (dir.path / "no" / "such" / "dir" / "f").string();
  try {
    io.write(b.data, 8192, missing, 0);
    FAIL() << "a write into a missing directory was queued";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOENT);
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  const std::string small = (dir.path / "small").string();
  write_plain(small, pattern(5000, 2));
  try {
    io.read(b.data, 8192, small, 0);
    FAIL() << "a read past the end of the file was queued";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), EINVAL);
    EXPECT_NE(std::string(e.what()).find("has 5000 bytes; reading 8192 at offset 0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(io.read(b.data, 10, small, 4991), std::system_error);  // one byte too far
  EXPECT_EQ(io.pending(), 0U);
  EXPECT_EQ(io.wait().completed, 0U);
  EXPECT_THROW(io.write(nullptr, 1, small, 0), std::invalid_argument);
  EXPECT_THROW(io.write(b.data, 1, small, UINT64_MAX), std::invalid_argument);
  // The largest file offset: a range that ends there passes the argument check (and this
  // file is too short for it); one byte further is refused as an argument.
  constexpr auto last = static_cast<std::uint64_t>(INT64_MAX);
  EXPECT_THROW(io.read(b.data, 10, small, last - 10), std::system_error);
  EXPECT_THROW(io.read(b.data, 10, small, last - 9), std::invalid_argument);
}

// A pipe held the caller in open() (a read until a writer came, a write until a reader did);
// a device or a directory failed later or not at all. Only regular files are opened; the
// refusal names what the path is and queues nothing.
TEST_P(file_io_test, only_regular_files_are_opened_and_a_pipe_never_blocks) {
  scratch_dir dir;
  async_file_io io(options());
  aligned_buffer b(4096);
  const std::string pipe = dir.file("pipe");
  ASSERT_EQ(mkfifo(pipe.c_str(), 0600), 0);
  const std::string folder = dir.file("folder");
  std::filesystem::create_directory(folder);
  const struct {
    std::string path;
    bool write;
    int error;
    const char* kind;
  } cases[] = {{pipe, false, EINVAL, "a pipe"},      {pipe, true, EINVAL, "a pipe"},
               {folder, false, EISDIR, "a directory"}, {"/dev/null", false, EINVAL, "a device"},
               {"/dev/null", true, EINVAL, "a device"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.path + (c.write ? " (write)" : " (read)"));
    const swap::testing::hang_guard guard("async_file_io opening " + c.path, std::chrono::seconds(20));
    try {
      if (c.write) {
        io.write(b.data, 4096, c.path, 0);
      } else {
        io.read(b.data, 4096, c.path, 0);
      }
      ADD_FAILURE() << "queued";
    } catch (const std::system_error& e) {
      EXPECT_EQ(e.code().value(), c.error);
      EXPECT_NE(std::string(e.what()).find(std::string("cannot open ") + c.path + (c.write ? " for writing" : " for reading") +
                                           ": it is " + c.kind + ", not a regular file"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(io.pending(), 0U);
  EXPECT_TRUE(std::filesystem::is_fifo(pipe));
  // The open adds O_NONBLOCK and clears it again: a buffered read of pages that are not in
  // the page cache waits for them (io_uring may end such a read with EAGAIN on a file opened
  // O_NONBLOCK) and completes whole.
  const std::string plain = dir.file("plain");
  const std::vector<std::byte> bytes = pattern(1 << 20, 8);
  write_plain(plain, bytes);
  const int fd = ::open(plain.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fdatasync(fd), 0);
  ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
  file_io_options buffered = options();
  buffered.direct = false;
  async_file_io cold(buffered);
  aligned_buffer back(bytes.size());
  cold.read(back.data, bytes.size(), plain, 0);
  const auto r = cold.wait();
  EXPECT_TRUE(r.errors.empty()) << r.errors[0].message;
  EXPECT_EQ(std::memcmp(back.data, bytes.data(), bytes.size()), 0);
}

// Without follow_links a link at the path is refused for reading and writing, dangling or
// not, and nothing is written or created where it points; with it (the default) the link is
// followed, as a user's path is.
TEST_P(file_io_test, a_link_is_refused_where_the_files_are_the_callers_own) {
  scratch_dir dir;
  const std::string target = dir.file("target");
  const std::vector<std::byte> before = pattern(4096, 3);
  write_plain(target, before);
  const std::string to_target = dir.file("to_target");
  const std::string dangling = dir.file("dangling");
  std::filesystem::create_symlink(target, to_target);
  std::filesystem::create_symlink(dir.file("nowhere"), dangling);
  file_io_options own = options();
  own.follow_links = false;
  async_file_io io(own);
  aligned_buffer b(4096);
  std::memset(b.data, 0x5a, 4096);
  for (const std::string& link : {to_target, dangling}) {
    for (const bool write : {false, true}) {
      SCOPED_TRACE(link + (write ? " (write)" : " (read)"));
      try {
        if (write) {
          io.write(b.data, 4096, link, 0);
        } else {
          io.read(b.data, 4096, link, 0);
        }
        ADD_FAILURE() << "queued";
      } catch (const std::system_error& e) {
        EXPECT_EQ(e.code().value(), EINVAL);
        EXPECT_NE(std::string(e.what()).find("cannot open " + link + (write ? " for writing" : " for reading") +
                                             ": it is a symbolic link, not a regular file"),
                  std::string::npos)
            << e.what();
      }
    }
  }
  EXPECT_EQ(io.pending(), 0U);
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(dir.file("nowhere"))));
  // A regular file is still written and read, and the target kept its bytes.
  const std::string own_file = dir.file("own");
  io.write(b.data, 4096, own_file, 0);
  EXPECT_TRUE(io.wait().errors.empty());
  aligned_buffer back(4096);
  io.read(back.data, 4096, target, 0);
  EXPECT_TRUE(io.wait().errors.empty());
  EXPECT_EQ(std::memcmp(back.data, before.data(), 4096), 0);
  // Followed by default.
  async_file_io follows(options());
  follows.write(b.data, 4096, to_target, 0);
  EXPECT_TRUE(follows.wait().errors.empty());
  io.read(back.data, 4096, target, 0);
  EXPECT_TRUE(io.wait().errors.empty());
  EXPECT_EQ(std::memcmp(back.data, b.data, 4096), 0);
  // Followed, a dangling link is a missing file (ENOENT) for a read, not a refused link.
  try {
    follows.read(back.data, 4096, dangling, 0);
    ADD_FAILURE() << "a read through a dangling link was queued";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOENT) << e.what();
    EXPECT_EQ(std::string(e.what()).find("symbolic link"), std::string::npos) << e.what();
  }
}

// "a\0b" would name the file "a" at the system call: such a path, and an empty one, are
// refused before any file is opened, and the file the prefix names keeps its bytes.
TEST_P(file_io_test, empty_paths_and_paths_with_a_nul_byte_are_refused) {
  scratch_dir dir;
  async_file_io io(options());
  aligned_buffer b(4096);
  std::memset(b.data, 0, 4096);
  const std::string kept = dir.file("kept");
  const std::vector<std::byte> original = pattern(4096, 7);
  write_plain(kept, original);
  const std::string nul = kept + std::string(1, '\0') + "x";
  const std::string fresh = dir.file("fresh") + std::string(1, '\0');
  for (const std::string& path : {nul, fresh, std::string()}) {
    EXPECT_THROW(io.write(b.data, 4096, path, 0), std::invalid_argument);
    EXPECT_THROW(io.read(b.data, 4096, path, 0), std::invalid_argument);
  }
  try {
    io.write(b.data, 4096, nul, 0);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("holds a NUL byte"), std::string::npos) << e.what();
  }
  EXPECT_EQ(io.pending(), 0U);
  EXPECT_EQ(io.wait().completed, 0U);
  EXPECT_EQ(file_bytes(kept), original);
  EXPECT_FALSE(std::filesystem::exists(dir.file("fresh")));
  for (std::size_t i = 0; i < 4096; ++i) ASSERT_EQ(b.data[i], std::byte{0}) << i;  // nothing read
}

// The file shrinks between queuing and the transfer: the read fails with EIO and says how
// many bytes came; the other operation of the same wait succeeds.
class truncating_engine final : public swap::testing::forwarding_engine {
 public:
  truncating_engine(std::unique_ptr<io_engine> inner, std::string path)
      : forwarding_engine(std::move(inner)), path_(std::move(path)) {}
  void submit(std::span<const io_request> requests) override {
    if (!path_.empty()) {
      if (::truncate(path_.c_str(), 6000) != 0) ADD_FAILURE() << "truncate";
      path_.clear();
    }
    inner_->submit(requests);
  }

 private:
  std::string path_;
};

// An engine out of memory for its first `submits` submissions and `waits` waits: it throws
// std::bad_alloc, as a real engine does, taking or returning nothing.
class out_of_memory_engine final : public swap::testing::forwarding_engine {
 public:
  out_of_memory_engine(std::unique_ptr<io_engine> inner, std::shared_ptr<std::atomic<int>> submits,
                       std::shared_ptr<std::atomic<int>> waits)
      : forwarding_engine(std::move(inner)), submits_(std::move(submits)), waits_(std::move(waits)) {}
  void submit(std::span<const io_request> requests) override {
    if (submits_->fetch_sub(1) > 0) throw std::bad_alloc();
    inner_->submit(requests);
  }
  std::vector<io_completion> wait(std::size_t min_completions) override {
    if (waits_->fetch_sub(1) > 0) throw std::bad_alloc();
    return inner_->wait(min_completions);
  }

 private:
  std::shared_ptr<std::atomic<int>> submits_, waits_;
};

// A ring's thread out of memory does not end the process (an exception escaping a thread
// would): the requests its engine could not take fail their operation with ENOMEM, the
// completions it could not collect are collected after a pause, and the handle goes on.
TEST(file_io, a_ring_out_of_memory_fails_what_it_could_not_submit_and_waits_again) {
  scratch_dir dir;
  auto submits = std::make_shared<std::atomic<int>>(1);
  auto waits = std::make_shared<std::atomic<int>>(0);
  file_io_options o;
  o.block_bytes = 4096;
  o.make_engine = [&](unsigned qd) {
    return std::make_unique<out_of_memory_engine>(make_thread_engine(qd, 2), submits, waits);
  };
  async_file_io io(o);
  aligned_buffer b(16384);
  std::memcpy(b.data, pattern(16384, 8).data(), 16384);
  const std::string path = dir.file("f");
  const std::uint64_t refused = io.write(b.data, 16384, path, 0);
  auto r = io.wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(60));
  ASSERT_TRUE(r.has_value()) << "an operation whose requests were lost is waited for for ever";
  EXPECT_EQ(r->completed, 1U);
  ASSERT_EQ(r->errors.size(), 1U);
  EXPECT_EQ(r->errors[0].ticket, refused);
  EXPECT_EQ(r->errors[0].error, ENOMEM);
  EXPECT_EQ(r->errors[0].message, "write to " + path + " failed: " + std::generic_category().message(ENOMEM));
  EXPECT_EQ(io.stats().failed, 1U);
  EXPECT_EQ(io.stats().bytes_written, 0U);
  // Three waits fail: the ring waits again and the completions come.
  waits->store(3);
  io.write(b.data, 16384, path, 0);
  r = io.wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(60));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->completed, 1U);
  EXPECT_TRUE(r->errors.empty());
  EXPECT_LT(waits->load(), 0) << "the engine's waits did not fail";
  EXPECT_EQ(file_bytes(path), pattern(16384, 8));
  EXPECT_EQ(io.stats().bytes_written, 16384U);
}

// Counts the requests handed to it.
class counting_engine final : public swap::testing::forwarding_engine {
 public:
  counting_engine(std::unique_ptr<io_engine> inner, std::shared_ptr<std::atomic<std::size_t>> count)
      : forwarding_engine(std::move(inner)), count_(std::move(count)) {}
  void submit(std::span<const io_request> requests) override {
    *count_ += requests.size();
    inner_->submit(requests);
  }

 private:
  std::shared_ptr<std::atomic<std::size_t>> count_;
};

// Each ring has an engine of its own, and an operation's blocks are dealt to the rings in
// turn, the next operation going on from the ring after the last one used.
TEST(file_io, blocks_are_dealt_to_the_rings_in_turn) {
  scratch_dir dir;
  std::vector<std::shared_ptr<std::atomic<std::size_t>>> counts;
  file_io_options o;
  o.rings = 3;
  o.block_bytes = 4096;
  o.make_engine = [&](unsigned qd) {
    counts.push_back(std::make_shared<std::atomic<std::size_t>>(0));
    return std::make_unique<counting_engine>(make_thread_engine(qd, 1), counts.back());
  };
  async_file_io io(o);
  ASSERT_EQ(counts.size(), 3U);
  aligned_buffer b(9 * 4096);
  std::memcpy(b.data, pattern(9 * 4096, 4).data(), 9 * 4096);
  const std::string path = dir.file("f");
  io.write(b.data, 7 * 4096, path, 0);  // blocks 0-6: rings 0, 1, 2, 0, 1, 2, 0
  ASSERT_TRUE(io.wait().errors.empty());
  EXPECT_EQ(*counts[0], 3U);
  EXPECT_EQ(*counts[1], 2U);
  EXPECT_EQ(*counts[2], 2U);
  io.write(b.data + 7 * 4096, 2 * 4096, path, 7 * 4096);  // rings 1 and 2
  ASSERT_TRUE(io.wait().errors.empty());
  EXPECT_EQ(*counts[0], 3U);
  EXPECT_EQ(*counts[1], 3U);
  EXPECT_EQ(*counts[2], 3U);
  EXPECT_EQ(io.stats().requests, 9U);
  EXPECT_EQ(file_bytes(path), pattern(9 * 4096, 4));
}

// Under O_DIRECT the blocks are rounded up to whole 4096-byte pages: a block size of 5,000
// bytes moves 8,192 per request, one of 1,000 bytes 4,096.
TEST(file_io, direct_blocks_are_rounded_up_to_whole_pages) {
  scratch_dir dir;
  for (const std::size_t block : {std::size_t{5000}, std::size_t{1000}}) {
    file_io_options o;
    o.engine = engine_kind::threads;
    o.block_bytes = block;
    async_file_io io(o);
    aligned_buffer b(65536);
    std::memcpy(b.data, pattern(65536, 5).data(), 65536);
    const std::string path = dir.file("d" + std::to_string(block));
    io.write(b.data, 65536, path, 0);
    ASSERT_TRUE(io.wait().errors.empty());
    const file_io_stats st = io.stats();
    if (st.direct_ops == 0) GTEST_SKIP() << "O_DIRECT refused here: " << st.fallback;
    EXPECT_EQ(st.requests, block == 5000 ? 8U : 16U) << "block_bytes " << block;
    EXPECT_EQ(file_bytes(path), pattern(65536, 5));
  }
}

// A wait with a deadline that passes collects nothing: the operations stay pending, their
// buffers in use, and the next wait collects them all.
TEST(file_io, a_wait_that_gives_up_collects_nothing) {
  using clock = std::chrono::steady_clock;
  scratch_dir dir;
  auto gate = std::make_shared<swap::testing::gate>();
  file_io_options o;
  o.make_engine = [gate](unsigned depth) {
    return std::make_unique<swap::testing::gated_engine>(make_thread_engine(depth, 1), gate);
  };
  async_file_io io(o);
  aligned_buffer b(8192);
  std::memset(b.data, 0x3c, 8192);
  const std::string path = dir.file("f");
  io.write(b.data, 8192, path, 0);
  io.write(b.data, 4096, path, 8192);
  const auto start = clock::now();
  EXPECT_FALSE(io.wait_until(start + std::chrono::milliseconds(100)).has_value());
  EXPECT_GE(clock::now() - start, std::chrono::milliseconds(100));
  EXPECT_EQ(io.pending(), 2U);
  gate->open();
  const auto r = io.wait_until(clock::now() + std::chrono::seconds(60));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->completed, 2U);
  EXPECT_TRUE(r->errors.empty());
  EXPECT_EQ(io.pending(), 0U);
  EXPECT_EQ(file_bytes(path), std::vector<std::byte>(12288, std::byte{0x3c}));
  const auto none = io.wait_until(clock::now() - std::chrono::milliseconds(1));  // nothing queued
  ASSERT_TRUE(none.has_value());
  EXPECT_EQ(none->completed, 0U);
}

// A file's folder is synced after a rename into it (a checkpoint's save); a folder that is
// not there is an error naming it and the caller.
TEST(file_io, the_folder_of_a_path_is_synced_or_named_in_the_error) {
  scratch_dir dir;
  EXPECT_NO_THROW(sync_folder_of("test", (dir.path / "ck").string()));
  EXPECT_NO_THROW(sync_folder_of("test", "ck"));  // no folder named: the current one
  const std::string missing = (dir.path / "gone" / "ck").string();
  try {
    sync_folder_of("offloaded_optimizer::save", missing);
    ADD_FAILURE() << "no error";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOENT);
    EXPECT_NE(std::string(e.what()).find("offloaded_optimizer::save: cannot sync the folder '" +
                                         (dir.path / "gone").string() + "' of " + missing),
              std::string::npos) << e.what();
  }
}

// What is at a path itself, a symbolic link not followed: the checks that keep the swapper and
// the checkpoint's save from removing or replacing anything but a file rest on it.
TEST(file_io, the_mode_at_a_path_is_that_of_the_path_itself) {
  scratch_dir dir;
  const std::string file = (dir.path / "file").string();
  const std::string link = (dir.path / "link").string();
  const std::string pipe = (dir.path / "pipe").string();
  const std::string folder = (dir.path / "folder").string();
  std::ofstream(file) << "x";
  ASSERT_EQ(::symlink(file.c_str(), link.c_str()), 0);
  ASSERT_EQ(::mkfifo(pipe.c_str(), 0600), 0);
  ASSERT_EQ(::mkdir(folder.c_str(), 0700), 0);
  EXPECT_FALSE(mode_at((dir.path / "nothing").string()).has_value());
  EXPECT_FALSE(mode_at(file + "/below").has_value());  // lstat fails (ENOTDIR)
  ASSERT_TRUE(mode_at(file).has_value());
  EXPECT_TRUE(S_ISREG(*mode_at(file)));
  EXPECT_TRUE(S_ISLNK(*mode_at(link)));  // the link itself, not the file it names
  EXPECT_STREQ(kind_of_file(*mode_at(link)), "a symbolic link");
  EXPECT_STREQ(kind_of_file(*mode_at(pipe)), "a pipe");
  EXPECT_STREQ(kind_of_file(*mode_at(folder)), "a directory");
  EXPECT_EQ(not_a_file_error(*mode_at(folder)), EISDIR);
  EXPECT_EQ(not_a_file_error(*mode_at(pipe)), EINVAL);
  EXPECT_EQ(not_a_file_error(*mode_at(link)), EINVAL);
  // Where a regular file is wanted: nothing and a regular file pass, a link only when allowed.
  EXPECT_FALSE(not_a_file_at((dir.path / "nothing").string()).has_value());
  EXPECT_FALSE(not_a_file_at(file).has_value());
  EXPECT_FALSE(not_a_file_at(link, /*link_allowed=*/true).has_value());
  const struct {
    std::string path;
    int error;
    const char* kind;
  } refused[] = {{link, EINVAL, "a symbolic link"}, {pipe, EINVAL, "a pipe"}, {folder, EISDIR, "a directory"},
                 {"/dev/null", EINVAL, "a device"}};
  for (const auto& r : refused) {
    for (const bool link_allowed : {false, true}) {
      if (link_allowed && r.path == link) continue;
      SCOPED_TRACE(r.path + (link_allowed ? " (links allowed)" : ""));
      const auto there = not_a_file_at(r.path, link_allowed);
      ASSERT_TRUE(there.has_value());
      EXPECT_EQ(there->error, r.error);
      EXPECT_STREQ(there->kind, r.kind);
    }
  }
}

TEST(file_io, a_short_read_fails_its_operation_alone) {
  scratch_dir dir;
  const std::string path = (dir.path / "shrinks").string();
  write_plain(path, pattern(16384, 3));
  file_io_options o;
  o.block_bytes = 4096;
  o.make_engine = [&](unsigned qd) { return std::make_unique<truncating_engine>(make_thread_engine(qd, 2), path); };
  async_file_io io(o);
  aligned_buffer b(16384);
  const std::uint64_t ticket = io.read(b.data, 16384, path, 0);
  const auto r = io.wait();
  ASSERT_EQ(r.completed, 1U);
  ASSERT_EQ(r.errors.size(), 1U);
  EXPECT_EQ(r.errors[0].ticket, ticket);  // names the operation that failed
  EXPECT_EQ(r.errors[0].error, EIO);
  EXPECT_EQ(r.errors[0].path, path);
  EXPECT_NE(r.errors[0].message.find("short read from " + path), std::string::npos) << r.errors[0].message;
  EXPECT_EQ(io.stats().failed, 1U);
  // The handle goes on working.
  write_plain(path, pattern(8192, 4));
  io.read(b.data, 8192, path, 0);
  EXPECT_TRUE(io.wait().errors.empty());
  EXPECT_EQ(std::memcmp(b.data, pattern(8192, 4).data(), 8192), 0);
}

// wait_for collects one operation by its ticket: its own result, the others left for wait;
// a failed one reports its own error; unknown and collected tickets are refused.
TEST(file_io, wait_for_collects_one_operation) {
  scratch_dir dir;
  const std::string good = (dir.path / "good").string();
  const std::string shrinks = (dir.path / "shrinks").string();
  write_plain(shrinks, pattern(16384, 5));
  file_io_options o;
  o.block_bytes = 4096;
  o.make_engine = [&](unsigned qd) { return std::make_unique<truncating_engine>(make_thread_engine(qd, 2), shrinks); };
  async_file_io io(o);
  aligned_buffer a(16384), b(16384), c(16384);
  std::memcpy(a.data, pattern(16384, 6).data(), 16384);
  // The engine truncates `shrinks` to 6000 bytes at its first submission (the first read's).
  const std::uint64_t bad = io.read(b.data, 16384, shrinks, 0);
  const std::uint64_t r = io.read(c.data, 4096, shrinks, 0);
  const std::uint64_t w = io.write(a.data, 16384, good, 0);
  EXPECT_NE(w, bad);
  const file_io_error fw = io.wait_for(w);
  EXPECT_EQ(fw.error, 0) << fw.message;
  EXPECT_TRUE(fw.path.empty());
  EXPECT_EQ(file_bytes(good), pattern(16384, 6));
  const file_io_error fb = io.wait_for(bad);
  EXPECT_EQ(fb.error, EIO);
  EXPECT_EQ(fb.path, shrinks);
  EXPECT_EQ(fb.ticket, bad);
  EXPECT_THROW(io.wait_for(bad), std::invalid_argument);
  EXPECT_THROW(io.wait_for(12345), std::invalid_argument);
  EXPECT_EQ(io.pending(), 1U);
  const auto rest = io.wait();  // only the third operation is left
  EXPECT_EQ(rest.completed, 1U);
  EXPECT_THROW(io.wait_for(r), std::invalid_argument);
}

// validate reads the range back and compares: a buffer changed after its write landed is
// caught (the caller broke the contract; the file holds the old bytes).
TEST(file_io, validation_catches_a_buffer_that_differs_from_the_file) {
  scratch_dir dir;
  const std::string path = (dir.path / "v").string();
  async_file_io io;
  aligned_buffer b(1 << 16);
  std::memset(b.data, 1, b.size);
  io.write(b.data, b.size, path, 0, true);
  ASSERT_TRUE(io.wait().errors.empty());  // the same bytes: valid
  io.write(b.data, b.size, path, 0, true);
  while (io.stats().ops < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  b.data[100] = std::byte{2};
  const auto r = io.wait();
  ASSERT_EQ(r.errors.size(), 1U);
  EXPECT_EQ(r.errors[0].error, EBADMSG);
  EXPECT_EQ(r.errors[0].message,
            "validation of " + path + " failed: the file's 65536 bytes at offset 0 differ from the buffer");
  io.read(b.data, b.size, path, 0, true);
  EXPECT_TRUE(io.wait().errors.empty());
  EXPECT_EQ(b.data[100], std::byte{1});
}

// Several threads queue and wait on one handle (run under ThreadSanitizer too).
TEST(file_io, threads_share_one_handle) {
  scratch_dir dir;
  file_io_options o;
  o.block_bytes = 16 << 10;
  o.rings = 2;
  async_file_io io(o);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      aligned_buffer b(1 << 17);
      for (int i = 0; i < 10; ++i) {
        const auto data = pattern(b.size, static_cast<std::uint64_t>(t * 100 + i));
        std::memcpy(b.data, data.data(), b.size);
        const std::string path = (dir.path / ("t" + std::to_string(t))).string();
        io.write(b.data, b.size, path, 0);
        EXPECT_TRUE(io.wait().errors.empty());
        std::memset(b.data, 0, b.size);
        io.read(b.data, b.size, path, 0);
        EXPECT_TRUE(io.wait().errors.empty());
        EXPECT_EQ(std::memcmp(b.data, data.data(), b.size), 0);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(io.stats().ops, 80U);
}

// A full disk: a 1 MiB tmpfs in a private mount namespace of a child (root only). The write
// that does not fit fails with ENOSPC at wait; the one that fits succeeds.
TEST(file_io, a_full_disk_fails_the_write_with_enospc) {
  scratch_dir dir;
  EXPECT_FULL_DISK_CHILD(swap::testing::in_small_tmpfs(dir.path, "size=1m", [&] {
    file_io_options o;
    o.engine = engine_kind::uring;
    async_file_io io(o);
    aligned_buffer small(256 << 10);
    aligned_buffer big(4 << 20);
    // One after the other: queued together, the big write's blocks may take the space
    // first, and then both fail.
    io.write(small.data, small.size, (dir.path / "fits").string(), 0);
    const auto first = io.wait();
    io.write(big.data, big.size, (dir.path / "too-big").string(), 0);
    const auto r = io.wait();
    return first.completed == 1 && first.errors.empty() &&
           r.completed == 1 && r.errors.size() == 1 && r.errors[0].error == ENOSPC &&
           r.errors[0].path == (dir.path / "too-big").string() &&
           r.errors[0].message.find("No space left") != std::string::npos;
  }));
}

// A write past the largest file the process may make (RLIMIT_FSIZE here; a file system's own
// limit, 16 TiB on ext4 with 4 KiB blocks, fails the same way) fails its operation alone with
// EFBIG and the path; an existing file keeps its bytes and size, and a new file is left
// created and empty, as documented. In a child, which lowers its limit.
TEST(file_io, a_write_past_the_largest_file_fails_alone_and_the_file_keeps_its_bytes) {
  scratch_dir dir;
  const std::string kept = (dir.path / "kept").string();
  const std::string fresh = (dir.path / "fresh").string();
  const std::string fits = (dir.path / "fits").string();
  const std::vector<std::byte> before = pattern(8192, 5);
  write_plain(kept, before);
  for (const engine_kind kind : {engine_kind::uring, engine_kind::threads}) {
    const pid_t pid = fork();
    if (pid == 0) {
      std::signal(SIGXFSZ, SIG_IGN);
      const rlimit limit{1 << 20, 1 << 20};
      if (setrlimit(RLIMIT_FSIZE, &limit) != 0) _exit(77);
      file_io_options o;
      o.engine = kind;
      o.block_bytes = 4096;
      async_file_io io(o);
      aligned_buffer b(8192);
      std::memcpy(b.data, pattern(8192, 6).data(), 8192);
      const std::uint64_t past = io.write(b.data, 8192, kept, 2 << 20);
      const std::uint64_t past_new = io.write(b.data, 4096, fresh, 1 << 20);
      io.write(b.data, 8192, fits, 4096);
      const auto r = io.wait();
      int code = 0;
      if (r.completed != 3 || r.errors.size() != 2) code = 1;
      for (const file_io_error& e : r.errors) {
        const std::string& want = e.ticket == past ? kept : fresh;
        if ((e.ticket != past && e.ticket != past_new) || e.error != EFBIG || e.path != want ||
            e.message.find("File too large") == std::string::npos || e.message.find(want) == std::string::npos)
          code = 2;
      }
      _exit(code);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    ASSERT_NE(WEXITSTATUS(status), 77) << "setrlimit refused";
    EXPECT_EQ(WEXITSTATUS(status), 0) << to_string(kind);
    EXPECT_EQ(file_bytes(kept), before) << to_string(kind);
    EXPECT_TRUE(std::filesystem::is_regular_file(fresh)) << to_string(kind);
    EXPECT_TRUE(file_bytes(fresh).empty()) << to_string(kind);
    std::vector<std::byte> want(4096, std::byte{0});
    const auto written = pattern(8192, 6);
    want.insert(want.end(), written.begin(), written.end());
    EXPECT_EQ(file_bytes(fits), want) << to_string(kind);
    std::filesystem::remove(fresh);
    std::filesystem::remove(fits);
  }
}

TEST(file_io, options_are_checked) {
  file_io_options o;
  o.block_bytes = 0;
  EXPECT_THROW(async_file_io{o}, std::invalid_argument);
  o = {};
  o.queue_depth = 0;
  EXPECT_THROW(async_file_io{o}, std::invalid_argument);
  o = {};
  o.rings = 0;
  EXPECT_THROW(async_file_io{o}, std::invalid_argument);
  o.rings = max_rings + 1;  // each ring is a thread: 100,000 of them took minutes, then failed
  try {
    async_file_io io{o};
    ADD_FAILURE() << "257 rings were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("rings must be 1 to 256, not 257"), std::string::npos) << e.what();
  }
  o.rings = max_rings;  // the most: accepted (a thread each, and a worker each for these engines)
  o.engine = engine_kind::threads;
  o.queue_depth = 1;
  EXPECT_EQ(async_file_io{o}.stats().engine, "threads");
}

// A thread that cannot be started (EAGAIN at the user's process limit) is an exception from
// the constructor, the threads started before it ended: a joinable std::thread destroyed
// during the unwinding called std::terminate and ended the whole process.
TEST(file_io, a_thread_that_cannot_start_is_an_exception_not_the_end_of_the_process) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's runtime needs threads of its own in the limited child";
#endif
  const int engine = swap::testing::with_thread_limit(0, [] {
    try {
      const auto e = make_thread_engine(8, 8);
      return 1;  // a worker started: the limit did not hold
    } catch (const std::system_error& e) {
      if (e.code() != std::errc::resource_unavailable_try_again) return 2;
      return std::string(e.what()).starts_with("a thread-pool I/O engine: cannot start a thread (a limit on") ? 0 : 3;
    }
  });
  ASSERT_NE(engine, 77) << "the child could not drop root or set its process limit";
  EXPECT_EQ(engine, 0);
  for (const engine_kind kind : {engine_kind::uring, engine_kind::threads}) {
    const int rings = swap::testing::with_thread_limit(0, [kind] {
      file_io_options o;
      o.rings = 8;
      o.queue_depth = 1;  // one worker per thread engine
      o.engine = kind;
      try {
        async_file_io io{o};
        return 1;
      } catch (const std::system_error& e) {  // (the engine's or the ring's thread)
        if (e.code() != std::errc::resource_unavailable_try_again) return 2;
        return std::string(e.what()).find(": cannot start a thread (a limit on") != std::string::npos ? 0 : 3;
      }
    });
    EXPECT_EQ(rings, 0) << to_string(kind);
  }
}

// Runs body(path) in a child that may start only `threads` more threads, as a user of its own
// (swap::testing::with_thread_limit); `path` names a file in a scratch folder it may write in.
template <class Body>
int with_thread_limit_and_a_file(std::size_t threads, Body body) {
  const scratch_dir dir(std::filesystem::perms::all);
  const std::string path = dir.file("f");
  return swap::testing::with_thread_limit(threads, [&] { return body(path); });
}

// The stats' fallback lists every reason, "; " between them.
TEST(file_io, fallback_reasons_are_joined) {
  std::string reasons;
  detail::append_reason(reasons, "io_uring unavailable");
  EXPECT_EQ(reasons, "io_uring unavailable");
  detail::append_reason(reasons, "buffered I/O");
  EXPECT_EQ(reasons, "io_uring unavailable; buffered I/O");
}

// Fewer ring threads than rings asked (a limit on threads): async_file_io keeps the rings whose
// threads started, they take every block, and the stats say so. (Before, the constructor threw
// when one ring's thread could not start.)
TEST(file_io, rings_short_of_threads_keep_those_that_started) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's runtime needs threads of its own in the limited child";
#endif
  const int status = with_thread_limit_and_a_file(3, [](const std::string& path) {
    file_io_options o;
    o.engine = engine_kind::uring;
    o.rings = 8;
    o.block_bytes = 4096;  // 64 blocks dealt out in turn
    async_file_io io(o);
    const file_io_stats st = io.stats();
    if (st.engine != "uring") return 76;
    if (st.fallback.find("async_file_io started 3 of its 8 rings' threads (a limit on threads)") == std::string::npos) {
      return 1;
    }
    aligned_buffer b(1 << 18), back(1 << 18);
    for (std::size_t k = 0; k < (1 << 18); ++k) b.data[k] = static_cast<std::byte>(k % 251);
    io.write(b.data, 1 << 18, path, 0);
    if (!io.wait().errors.empty()) return 2;
    io.read(back.data, 1 << 18, path, 0);
    if (!io.wait().errors.empty()) return 3;
    return std::memcmp(back.data, b.data, 1 << 18) == 0 ? 0 : 4;
  });
  if (status == 76 || status == 77) GTEST_SKIP() << "not reached here (" << status << ")";
  EXPECT_EQ(status, 0);
}

// Fewer worker threads than asked (a limit on threads): the thread engine keeps those that
// started, they move every request, and make_engine's fallback reason says how many. (Before,
// the engine was refused whenever one of its threads could not start.)
TEST(file_io, a_thread_engine_short_of_threads_keeps_those_that_started) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's runtime needs threads of its own in the limited child";
#endif
  const int status = with_thread_limit_and_a_file(3, [](const std::string& path) {
    std::string reason;
    const auto e = make_engine(engine_kind::threads, 16, reason);
    if (e->workers() != 3) return 1;
    if (reason != "the thread-pool I/O engine started 3 of its 8 threads (a limit on threads)") return 2;
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0) return 3;
    std::vector<std::vector<char>> out(40, std::vector<char>(4096)), in(40, std::vector<char>(4096));
    std::vector<io_request> writes, reads;
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::fill(out[i].begin(), out[i].end(), static_cast<char>('a' + i % 26));
      writes.push_back({fd, i * 4096, out[i].data(), 4096, true, i});
      reads.push_back({fd, i * 4096, in[i].data(), 4096, false, i});
    }
    for (auto* batch : {&writes, &reads}) {
      e->submit(*batch);
      std::size_t done = 0;
      while (e->outstanding() != 0) {
        for (const io_completion& c : e->wait(1)) {
          if (c.result != 4096) return 4;
          ++done;
        }
      }
      if (done != batch->size()) return 5;
    }
    ::close(fd);
    return in == out ? 0 : 6;
  });
  ASSERT_NE(status, 77) << "the child could not drop root or set its process limit";
  EXPECT_EQ(status, 0);
}

// io_uring cancels a request it cannot start a kernel worker for (its workers count against
// the user's limit on processes and threads). The ring then moves it by blocking calls on its
// own thread: the operation succeeds, its bytes are right, and the stats say what happened.
// (Before, it failed with ECANCELED.)
TEST(file_io, a_request_io_uring_cannot_start_is_moved_by_blocking_calls_and_reported) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's runtime needs threads of its own in the limited child";
#endif
  // The ring's thread alone: no kernel worker.
  const int status = with_thread_limit_and_a_file(1, [](const std::string& path) {
    file_io_options o;
    o.engine = engine_kind::uring;
    async_file_io io(o);
    if (io.stats().engine != "uring") return 76;
    constexpr std::size_t bytes = 1 << 20;
    aligned_buffer b(bytes);
    for (std::size_t k = 0; k < bytes; ++k) b.data[k] = static_cast<std::byte>(k % 253);
    io.write(b.data, bytes, path, 0);
    if (!io.wait().errors.empty()) return 2;
    const file_io_stats st = io.stats();
    if (st.synchronous_requests == 0) return 75;  // done without a worker: nothing to show
    if (st.fallback.find("io_uring could not start a kernel worker for") == std::string::npos) return 3;
    aligned_buffer back(bytes);
    io.read(back.data, bytes, path, 0);
    if (!io.wait().errors.empty()) return 4;
    return std::memcmp(back.data, b.data, bytes) == 0 ? 0 : 5;
  });
  if (status == 75 || status == 76 || status == 77) GTEST_SKIP() << "not reached here (" << status << ")";
  EXPECT_EQ(status, 0);
}

INSTANTIATE_TEST_SUITE_P(engines, file_io_test,
                         ::testing::Values(config{engine_kind::uring, 1}, config{engine_kind::uring, 3},
                                           config{engine_kind::threads, 2}),
                         [](const auto& param_info) {
                           return std::string(to_string(param_info.param.engine)) + "_rings" +
                                  std::to_string(param_info.param.rings);
                         });

}  // namespace
}  // namespace tensormem::io
