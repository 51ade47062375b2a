// Arena scripts with verification: the check of what each step could have changed finds
// overwritten tensors, and a long script with defragmentations stays verified.

#include "arena_ops.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tensormem/memory/host_resource.hpp"

namespace tensormem::cli {
namespace {

using names = std::vector<std::string>;

TEST(pattern_check, a_new_tensor_that_overlaps_live_ones_names_each_it_overwrote) {
  std::vector<std::byte> memory(8192);
  pattern_check p(memory.data());
  EXPECT_EQ(p.add("a", 0, 100), names{});
  EXPECT_EQ(p.add("b", 100, 100), names{});   // adjacent, not overlapping
  EXPECT_EQ(p.add("c", 150, 100), names{"b"});  // over b's upper half
  EXPECT_EQ(p.add("d", 1000, 500), names{});
  EXPECT_EQ(p.add("e", 1100, 10), names{"d"});  // inside d: found as the tensor below it
  EXPECT_EQ(p.add("f", 2000, 10), names{});
  EXPECT_EQ(p.add("g", 3000, 10), names{});
  // Starts below f and covers f and g: both are found among the tensors starting inside it.
  const names over = p.add("h", 1990, 1100);
  EXPECT_EQ(over, (names{"f", "g"}));
  EXPECT_EQ(p.check_all(), (names{"b", "d", "f", "g"}));
}

TEST(pattern_check, zero_byte_tensors_write_nothing_and_are_never_changed) {
  std::vector<std::byte> memory(256);
  pattern_check p(memory.data());
  EXPECT_EQ(p.add("a", 0, 64), names{});
  EXPECT_EQ(p.add("empty", 32, 0), names{});
  EXPECT_EQ(p.check_all(), names{});
  p.remove("empty");
  EXPECT_EQ(p.add("b", 32, 64), names{"a"});
}

TEST(pattern_check, moved_bytes_follow_their_tensor_and_unmoved_ones_are_found) {
  std::vector<std::byte> memory(4096);
  pattern_check p(memory.data());
  ASSERT_EQ(p.add("a", 1000, 300), names{});
  ASSERT_EQ(p.add("b", 2000, 300), names{});
  std::memmove(memory.data(), memory.data() + 1000, 300);  // a moves down, as a defragmentation would
  p.relocate("a", 0);
  EXPECT_EQ(p.check_all(), names{});
  p.relocate("b", 500);  // the bytes did not go with it
  EXPECT_EQ(p.check_all(), names{"b"});
  // After a removal the range is free: a new tensor there overwrites nobody.
  p.remove("b");
  EXPECT_EQ(p.add("c", 2000, 100), names{});
  EXPECT_EQ(p.add("d", 250, 100), names{"a"});  // over a's new place, not its old one
}

// A random script in an arena 5 % over its peak: many defragmentations, every step verified.
TEST(arena_ops, a_random_script_with_defragmentations_is_verified_at_every_step) {
  for (const auto policy : {arena::defrag_policy::minimal_move, arena::defrag_policy::full_compaction}) {
    std::mt19937_64 rng(11);
    std::vector<arena_op> ops;
    std::vector<std::string> live;
    std::uint64_t live_bytes = 0, peak = 0;
    std::vector<std::uint64_t> size_of;
    for (std::size_t n = 0; n < 3000; ++n) {
      if (live.size() < 40 && (live.empty() || rng() % 100 < 55)) {
        const std::uint64_t bytes = 256 * (1 + rng() % 64);
        const std::string name = "t" + std::to_string(n);
        ops.push_back({.allocate = true, .name = name, .bytes = bytes, .line = n + 1});
        live.push_back(name);
        size_of.push_back(bytes);
        live_bytes += bytes;
        peak = std::max(peak, live_bytes);
      } else {
        const std::size_t k = rng() % live.size();
        ops.push_back({.allocate = false, .name = live[k], .bytes = 0, .line = n + 1});
        live_bytes -= size_of[k];
        live[k] = live.back();
        live.pop_back();
        size_of[k] = size_of.back();
        size_of.pop_back();
      }
    }
    memory::host_resource host;
    arena::contiguous_arena a(host, peak + peak / 20, {.alignment = 256, .policy = policy});
    const arena_run_result r = run_arena_ops(a, ops, true, 16);
    EXPECT_EQ(r.failures, names{});
    ASSERT_TRUE(r.verified.has_value());
    EXPECT_TRUE(*r.verified);
    EXPECT_GT(a.stats().defragmentations, 10U);
    EXPECT_EQ(r.steps, ops.size());
  }
}

}  // namespace
}  // namespace tensormem::cli
