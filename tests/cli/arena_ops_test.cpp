// Arena scripts with verification: the check of what each step could have changed finds
// overwritten tensors, and a long script with defragmentations stays verified.

#include "arena_ops.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensormem/memory/host_resource.hpp"
#include "tensormem/trace/trace_io.hpp"

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

// Every parse error names the script and the line it is on, a line too long included
// (reported by the reader before the line is split into words).
TEST(arena_ops, parse_errors_name_the_line) {
  auto message = [](const std::string& script) {
    std::istringstream in(script);
    try {
      parse_arena_ops(in, "s.txt");
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("parsed");
  };
  EXPECT_EQ(message("alloc a 1\n# a comment\nfrobnicate b\n"),
            "s.txt:3: unknown step 'frobnicate' (expected alloc or free)");
  EXPECT_EQ(message("alloc a 1\nalloc b 1 2\n"), "s.txt:2: unexpected '2' at the end of the step");
  EXPECT_EQ(message("alloc a 18446744073709551616\n"),
            "s.txt:1: BYTES does not fit in 64 bits: '18446744073709551616'");
  const std::string fits(trace::max_line_bytes, ' ');
  EXPECT_EQ(message("alloc a 1\n" + fits + "\nfree a\n"), "parsed");
  EXPECT_EQ(message("alloc a 1\n" + fits + " \nfree a\n"),
            "s.txt:2: line longer than " + std::to_string(trace::max_line_bytes) + " bytes");
}

// The built-in ZeRO-3 scenario: 24 groups, each gathered twice (forward and backward), with
// an activation and a gradient; every tensor it allocates it frees, and it runs at its
// capacity (5 % over its peak) without a failed step, verified.
TEST(arena_ops, the_zero3_scenario_frees_all_it_allocates_over_24_groups) {
  const std::optional<arena_scenario> sc = find_arena_scenario("zero3");
  ASSERT_TRUE(sc.has_value());
  std::istringstream in(sc->script);
  const std::vector<arena_op> ops = parse_arena_ops(in, "zero3");
  std::map<std::string, int> allocations;
  std::map<std::string, int> live;
  for (const arena_op& op : ops) {
    if (op.allocate) {
      ++allocations[op.name];
      EXPECT_EQ(live[op.name]++, 0) << op.name;
    } else {
      EXPECT_EQ(live[op.name]--, 1) << op.name;
    }
  }
  EXPECT_EQ(allocations.size(), 3U * 24U);
  for (int l = 0; l < 24; ++l) {
    const std::string n = std::to_string(l);
    EXPECT_EQ(allocations["w" + n], 2) << n;
    EXPECT_EQ(allocations["act" + n], 1) << n;
    EXPECT_EQ(allocations["grad" + n], 1) << n;
  }
  for (const auto& [name, count] : live) EXPECT_EQ(count, 0) << name << " left allocated";
  memory::host_resource host;
  arena::contiguous_arena a(host, sc->capacity, {.alignment = sc->alignment});
  const arena_run_result r = run_arena_ops(a, ops, true, 16);
  EXPECT_EQ(r.failures, names{});
  ASSERT_TRUE(r.verified.has_value());
  EXPECT_TRUE(*r.verified);
  EXPECT_EQ(a.stats().live_tensors, 0U);
}

}  // namespace
}  // namespace tensormem::cli
