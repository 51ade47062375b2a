// Objects with threads of their own in a child forked after they were made: every call is
// refused with forked_child_error, dropping them waits for nothing, and the parent's object
// and its transfers in flight across the fork are undisturbed.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tensormem/io/file_io.hpp"
#include "tensormem/io/fork_guard.hpp"
#include "tensormem/io/io_engine.hpp"
#include "../swap/swap_test_support.hpp"
#include "forked_child.hpp"

namespace tensormem::io {
namespace {

using swap::testing::hang_guard;
using swap::testing::pattern;
using swap::testing::scratch_dir;
using testing::in_forked_child;
using testing::refused_in_child;

TEST(fork_guard, a_guard_is_forked_in_every_later_child_and_nowhere_else) {
  const detail::fork_guard parent_made;
  const std::uint64_t before = detail::forks_seen();
  EXPECT_FALSE(parent_made.forked());
  EXPECT_NO_THROW(parent_made.require_same_process("a thing"));
  const int rc = in_forked_child([&] {
    if (detail::forks_seen() != before + 1) return 1;
    if (!parent_made.forked()) return 2;
    const detail::fork_guard child_made;
    if (child_made.forked()) return 3;
    if (refused_in_child("a thing", [&] { parent_made.require_same_process("a thing"); }) != 0) return 4;
    // The message names both processes.
    try {
      parent_made.require_same_process("a thing");
    } catch (const forked_child_error& e) {
      const std::string m = e.what();
      if (m.find("process " + std::to_string(getppid())) == std::string::npos) return 5;
      if (m.find("process " + std::to_string(getpid())) == std::string::npos) return 6;
    }
    // A grandchild: both guards are forked there.
    const int grandchild = in_forked_child([&] { return parent_made.forked() && child_made.forked() ? 0 : 1; });
    return grandchild == 0 ? 0 : 7;
  });
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(detail::forks_seen(), before);  // the parent counts no fork of its own
  EXPECT_FALSE(parent_made.forked());
}

int destructions = 0;
struct counted {
  ~counted() { ++destructions; }
};

TEST(fork_guard, a_member_made_before_a_fork_is_destroyed_only_where_it_was_made) {
  destructions = 0;
  auto member = std::make_unique<detail::unless_forked<counted>>();
  const int rc = in_forked_child([&] {
    member.reset();
    const int in_child_of_parents = destructions;
    { const detail::unless_forked<counted> own; }
    return in_child_of_parents == 0 && destructions == 1 ? 0 : 1;
  });
  EXPECT_EQ(rc, 0);
  member.reset();
  EXPECT_EQ(destructions, 1);
}

// A file of `bytes` pseudo-random bytes (seed 7).
std::string file_of(const scratch_dir& dir, const std::string& name, std::size_t bytes) {
  const std::string path = dir.file(name);
  const auto data = pattern(bytes, 7);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data.data()),
                                              static_cast<std::streamsize>(data.size()));
  return path;
}

class fork_engine_test : public ::testing::TestWithParam<engine_kind> {};

TEST_P(fork_engine_test, reads_in_flight_across_a_fork_complete_in_the_parent_only) {
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  constexpr std::size_t block = std::size_t{1} << 20;
  constexpr std::size_t blocks = 32;
  const std::string path = file_of(dir, "data", block * blocks);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::string reason;
  std::unique_ptr<io_engine> engine = make_engine(GetParam(), 16, reason);
  const char* what = engine->kind() == engine_kind::uring ? "an io_uring engine" : "a thread-pool I/O engine";
  std::vector<std::byte> into(block * blocks);
  std::vector<io_request> reads;
  for (std::size_t i = 0; i < blocks; ++i) reads.push_back({fd, i * block, into.data() + i * block, block, false, i});
  engine->submit(reads);
  const int rc = in_forked_child([&] {
    int bad = refused_in_child(what, [&] { engine->submit(reads); });
    bad |= refused_in_child(what, [&] { engine->wait(1); }) << 1;
    std::vector<std::span<std::byte>> regions{std::span<std::byte>(into)};
    bad |= refused_in_child(what, [&] { engine->register_buffers(regions); }) << 2;
    engine.reset();  // waits for nothing; the ring's completions stay the parent's
    return bad;
  });
  EXPECT_EQ(rc, 0);
  std::map<std::uint64_t, std::int64_t> results;
  {
    const hang_guard guard("the parent's reads after the fork", std::chrono::seconds(60));
    while (engine->outstanding() != 0) {
      for (const io_completion& c : engine->wait(1)) results[c.user_data] = c.result;
    }
  }
  ASSERT_EQ(results.size(), blocks);
  for (const auto& [id, result] : results) EXPECT_EQ(result, static_cast<std::int64_t>(block)) << id;
  EXPECT_EQ(std::memcmp(into.data(), pattern(block * blocks, 7).data(), into.size()), 0);
  close(fd);
}

INSTANTIATE_TEST_SUITE_P(engines, fork_engine_test, ::testing::Values(engine_kind::uring, engine_kind::threads),
                         [](const auto& param_info) { return std::string(to_string(param_info.param)); });

TEST(fork_file_io, a_write_in_flight_across_a_fork_lands_and_the_child_is_refused) {
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  constexpr std::size_t bytes = std::size_t{32} << 20;
  const auto data = pattern(bytes, 11);
  const std::string path = dir.file("out");
  file_io_options o;
  o.queue_depth = 8;
  auto io = std::make_unique<async_file_io>(o);
  const std::uint64_t ticket = io->write(data.data(), bytes, path, 0);
  const int rc = in_forked_child([&] {
    const char* what = "an async_file_io";
    std::vector<std::byte> b(4096);
    int bad = refused_in_child(what, [&] { io->write(b.data(), b.size(), path + ".child", 0); });
    bad |= refused_in_child(what, [&] { io->read(b.data(), b.size(), path, 0); }) << 1;
    bad |= refused_in_child(what, [&] { io->wait(); }) << 2;
    bad |= refused_in_child(what, [&] { io->wait_for(ticket); }) << 3;
    bad |= refused_in_child(what, [&] { io->pending(); }) << 4;
    bad |= refused_in_child(what, [&] { io->stats(); }) << 5;
    io.reset();
    return bad;
  });
  EXPECT_EQ(rc, 0);
  EXPECT_FALSE(std::filesystem::exists(path + ".child"));
  file_io_error e;
  {
    const hang_guard guard("the parent's write after the fork", std::chrono::seconds(60));
    e = io->wait_for(ticket);
  }
  EXPECT_EQ(e.error, 0) << e.message;
  std::vector<std::byte> back(bytes);
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(back.data()), static_cast<std::streamsize>(bytes));
  EXPECT_EQ(back, data);
  EXPECT_EQ(io->pending(), 0U);
}

// Forks at many instants of busy rings (requests queued, submitted, completing, operations
// finishing): the child drops the object at once, leaving whatever a ring's thread was
// changing at the fork (a sanitized build reports a double free as the child's failure).
class fork_file_io_test : public ::testing::TestWithParam<engine_kind> {};

TEST_P(fork_file_io_test, a_child_forked_at_any_instant_drops_busy_rings_cleanly) {
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  constexpr std::size_t bytes = std::size_t{4} << 20;
  const auto data = pattern(bytes, 12);
  file_io_options o;
  o.engine = GetParam();
  o.rings = 2;
  o.queue_depth = 4;
  o.block_bytes = std::size_t{128} << 10;
  auto io = std::make_unique<async_file_io>(o);
  for (int round = 0; round < 24; ++round) {
    const std::string path = dir.file("out" + std::to_string(round % 3));
    const std::uint64_t ticket = io->write(data.data(), bytes, path, 0);
    std::this_thread::sleep_for(std::chrono::microseconds(round * 60));  // later into the write
    const int rc = in_forked_child([&] {
      io.reset();
      return 0;
    });
    EXPECT_EQ(rc, 0) << "round " << round;
    file_io_error e;
    {
      const hang_guard guard("the parent's write after a fork", std::chrono::seconds(60));
      e = io->wait_for(ticket);
    }
    ASSERT_EQ(e.error, 0) << "round " << round << ": " << e.message;
  }
  std::vector<std::byte> back(bytes);
  std::ifstream(dir.file("out2"), std::ios::binary)
      .read(reinterpret_cast<char*>(back.data()), static_cast<std::streamsize>(bytes));
  EXPECT_EQ(back, data);
}

INSTANTIATE_TEST_SUITE_P(engines, fork_file_io_test, ::testing::Values(engine_kind::uring, engine_kind::threads),
                         [](const auto& param_info) { return std::string(to_string(param_info.param)); });

}  // namespace
}  // namespace tensormem::io
