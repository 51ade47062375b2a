// A swapper in a child forked while its transfers are in flight: the child's calls are
// refused, dropping it there waits for nothing and touches no file, and the parent's
// transfers finish and read back as written.

#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/swap/tensor_swapper.hpp"
#include "../io/forked_child.hpp"
#include "swap_test_support.hpp"

namespace tensormem::swap {
namespace {

using io::testing::in_forked_child;
using io::testing::refused_in_child;
using testing::pattern;
using testing::scratch_dir;

class swap_fork_test : public ::testing::TestWithParam<io::engine_kind> {};

struct tensor_set {
  std::vector<std::vector<std::byte>> tensors;
  std::vector<tensor_ref> refs;
  std::vector<std::string> paths;
};

// `count` tensors of `large` bytes, every `small_every`-th one of `small` bytes (packed),
// filled from seeds `seed`, `seed + 1`, ..., at files t0, t1, ... of `dir`.
tensor_set some_tensors(const scratch_dir& dir, int count, int small_every, std::size_t small, std::size_t large,
                        std::uint64_t seed) {
  tensor_set set;
  set.tensors.reserve(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) {
    const std::size_t bytes = i % small_every == small_every - 1 ? small : large;
    set.tensors.push_back(pattern(bytes, seed + static_cast<std::uint64_t>(i)));
    set.refs.push_back({set.tensors.back().data(), bytes});
    set.paths.push_back(dir.file("t" + std::to_string(i)));
  }
  return set;
}

void expect_read_back(tensor_swapper& s, const std::vector<std::vector<std::byte>>& tensors,
                      const std::vector<std::string>& paths) {
  std::vector<std::vector<std::byte>> back;
  std::vector<tensor_ref> back_refs;
  for (const auto& t : tensors) {
    back.emplace_back(t.size());
    back_refs.push_back({back.back().data(), t.size()});
  }
  for (const swap_result& r : s.wait(s.swap_in(paths, back_refs))) EXPECT_EQ(r.error, 0) << r.message;
  for (std::size_t i = 0; i < tensors.size(); ++i) EXPECT_EQ(back[i], tensors[i]) << paths[i];
}

TEST_P(swap_fork_test, transfers_in_flight_across_a_fork_finish_in_the_parent_and_the_child_is_refused) {
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  memory::pinned_pool pool({.slab_bytes = std::size_t{16} << 20});
  auto s = std::make_unique<tensor_swapper>(
      pool, swap_options{.engine = GetParam(), .queue_depth = 8, .block_bytes = std::size_t{1} << 20,
                         .staging_buffers = 4, .pack_below = 65536});
  // Tensors of 2 MiB (files of their own) and of 40,000 bytes (packed), written once before.
  tensor_set set = some_tensors(dir, 20, 4, 40000, std::size_t{2} << 20, 100);
  auto& tensors = set.tensors;
  auto& refs = set.refs;
  const auto& paths = set.paths;
  for (const swap_result& r : s->wait(s->swap_out(refs, paths))) ASSERT_EQ(r.error, 0) << r.message;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    tensors[i] = pattern(tensors[i].size(), 200 + i);
    refs[i] = {tensors[i].data(), tensors[i].size()};
  }
  const std::uint64_t ticket = s->swap_out(refs, paths);  // in flight across the fork

  const int rc = in_forked_child([&] {
    const char* what = "a tensor swapper";
    std::vector<std::byte> b(4096);
    const std::vector<tensor_ref> one{{b.data(), b.size()}};
    const std::vector<std::string> child_path{dir.file("child")};
    const auto soon = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
    int bad = refused_in_child(what, [&] { s->swap_out(one, child_path); });
    bad |= refused_in_child(what, [&] { s->swap_in(child_path, one); }) << 1;
    bad |= refused_in_child(what, [&] { s->wait(ticket); }) << 2;
    bad |= refused_in_child(what, [&] { s->wait_until(ticket, soon); }) << 3;
    bad |= refused_in_child(what, [&] { s->done(ticket); }) << 4;
    bad |= refused_in_child(what, [&] { s->outstanding(ticket); }) << 5;
    bad |= refused_in_child(what, [&] { s->unfinished(ticket); }) << 6;
    bad |= refused_in_child(what, [&] { s->discard(paths[0]); }) << 7;
    bad |= refused_in_child(what, [&] { s->synchronize(); }) << 8;
    bad |= refused_in_child(what, [&] { s->synchronize_until(soon); }) << 9;
    bad |= refused_in_child(what, [&] { s->stats(); }) << 10;
    bad |= refused_in_child(what, [&] { s->timers(); }) << 11;
    bad |= refused_in_child(what, [&] { tensor_swapper::ticket_wait claim(*s, ticket); }) << 12;
    s.reset();  // waits for nothing, commits and removes nothing
    return bad == 0 ? 0 : 1 + (bad & 63);  // an exit status keeps 8 bits
  });
  EXPECT_EQ(rc, 0);

  std::vector<swap_result> results;
  {
    const testing::hang_guard guard("the parent's swap-out after the fork", std::chrono::seconds(60));
    results = s->wait(ticket);
  }
  for (const swap_result& r : results) EXPECT_EQ(r.error, 0) << r.message;
  expect_read_back(*s, tensors, paths);
  // Each unpacked path holds its file and the spare its first version became; the packed
  // ones and the child's path have none; nothing temporary is left.
  std::set<std::string> expected;
  for (std::size_t i = 0; i < paths.size(); ++i) {
    if (tensors[i].size() > 65536) {
      expected.insert(paths[i]);
      expected.insert(tensor_swapper::spare_path(paths[i]));
    }
  }
  std::set<std::string> found;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) found.insert(e.path().string());
  EXPECT_EQ(found, expected);
}

// Forks at many instants of a busy swapper (its worker queuing, the engine completing, the
// committer closing, the reaper unlinking): the child drops the swapper at once. Whatever a
// parent thread was changing at the fork is left alone there, so no child frees a
// half-changed container (a sanitized build reports a double free as the child's failure).
TEST_P(swap_fork_test, a_child_forked_at_any_instant_drops_a_busy_swapper_cleanly) {
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  memory::pinned_pool pool({.slab_bytes = std::size_t{8} << 20});
  auto s = std::make_unique<tensor_swapper>(
      pool, swap_options{.engine = GetParam(), .queue_depth = 4, .block_bytes = std::size_t{256} << 10,
                         .staging_buffers = 2, .pack_below = 8192});
  const tensor_set set = some_tensors(dir, 12, 3, 6000, std::size_t{1} << 20, 300);
  const auto& paths = set.paths;
  for (int round = 0; round < 24; ++round) {
    const std::uint64_t ticket = s->swap_out(set.refs, paths);
    // Later rounds fork later into the transfer: 0 to ~2 ms after it was queued.
    std::this_thread::sleep_for(std::chrono::microseconds(round * 80));
    const int rc = in_forked_child([&] {
      s.reset();
      return 0;
    });
    EXPECT_EQ(rc, 0) << "round " << round;
    std::vector<swap_result> results;
    {
      const testing::hang_guard guard("the parent's swap-out after a fork", std::chrono::seconds(60));
      results = s->wait(ticket);
    }
    for (const swap_result& r : results) ASSERT_EQ(r.error, 0) << "round " << round << ": " << r.message;
  }
  expect_read_back(*s, set.tensors, paths);
}

INSTANTIATE_TEST_SUITE_P(engines, swap_fork_test, ::testing::Values(io::engine_kind::uring, io::engine_kind::threads),
                         [](const auto& param_info) { return std::string(io::to_string(param_info.param)); });

}  // namespace
}  // namespace tensormem::swap
