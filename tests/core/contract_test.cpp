// Contracts under misuse and at the edges of 64-bit arithmetic: foreign handles, the O(1)
// allocator's size classes and waste bound, the lower bound near 2^64, the planner's
// argument checks, and the plan validator against a brute-force oracle.

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensormem/core/align.hpp"
#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/planner.hpp"
#include "tensormem/core/tlsf_allocator.hpp"
#include "tensormem/trace/trace_io.hpp"

namespace tensormem::core {
namespace {

constexpr std::uint64_t max64 = std::numeric_limits<std::uint64_t>::max();

// ---------------------------------------------------------------- foreign handles

template <class A>
class foreign_handles : public ::testing::Test {};
using allocator_types = ::testing::Types<best_fit_allocator, tlsf_allocator>;
TYPED_TEST_SUITE(foreign_handles, allocator_types);

TYPED_TEST(foreign_handles, another_allocators_handle_is_refused_and_changes_nothing) {
  TypeParam a(1 << 20, 256);
  TypeParam b(1 << 20, 256);
  const allocation mine = *a.allocate(1000);
  const allocation theirs = *b.allocate(1000);
  // Same offset, bytes, node and generation: only the owner tells them apart.
  ASSERT_EQ(mine.offset, theirs.offset);
  ASSERT_EQ(mine.bytes, theirs.bytes);
  EXPECT_EQ(a.try_deallocate(theirs), free_status::foreign_handle);
  EXPECT_EQ(a.used(), 1024U);
  EXPECT_THROW(a.deallocate(theirs), allocator_misuse);
  EXPECT_EQ(a.used(), 1024U);
  EXPECT_EQ(a.check_invariants(), "");
  a.deallocate(mine);
  b.deallocate(theirs);
  EXPECT_EQ(a.used(), 0U);
  EXPECT_EQ(b.used(), 0U);
}

// A handle kept after its free names a block that a later allocation of the same size may
// reuse (same node, offset and size): only the generation tells the two apart, and the old
// handle must not free the new allocation.
TYPED_TEST(foreign_handles, a_stale_handle_to_a_reused_block_is_refused) {
  TypeParam a(growing, 256);
  const allocation old = *a.allocate(1000);
  const allocation keep = *a.allocate(256);
  a.deallocate(old);
  const allocation reused = *a.allocate(1000);
  ASSERT_EQ(reused.offset, old.offset);
  ASSERT_EQ(reused.bytes, old.bytes);
  EXPECT_EQ(a.try_deallocate(old), free_status::stale_handle);
  EXPECT_THROW(a.deallocate(old), allocator_misuse);
  EXPECT_EQ(a.used(), 1024U + 256U);
  EXPECT_EQ(a.check_invariants(), "");
  a.deallocate(reused);
  a.deallocate(keep);
  EXPECT_EQ(a.used(), 0U);
  EXPECT_EQ(a.try_deallocate(reused), free_status::stale_handle);  // a double free
}

TEST(foreign_handles, message_names_the_cause) {
  best_fit_allocator a;
  best_fit_allocator b;
  (void)a.allocate(256);
  const allocation theirs = *b.allocate(256);
  try {
    a.deallocate(theirs);
    FAIL() << "no exception";
  } catch (const allocator_misuse& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to another allocator"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- size classes

// Independent model of the classes: below 16 units one class per unit count, above that
// 16 classes per power of two. class_min(c) is the least unit count of class c.
std::uint64_t class_min(unsigned c) {
  if (c < 16) return c;
  const unsigned exponent = c / 16 - 1;
  return (std::uint64_t{16} + c % 16) << exponent;
}

TEST(tlsf_size_classes, floor_and_ceil_match_the_model_at_every_class_edge) {
  for (const std::uint64_t alignment : {std::uint64_t{1}, std::uint64_t{256}}) {
    const tlsf_allocator a(growing, alignment);
    const unsigned shift = static_cast<unsigned>(std::countr_zero(alignment));
    std::vector<std::uint64_t> units;
    for (unsigned c = 0; class_min(c) < (max64 >> shift) && c < 64 * 16; ++c) {
      const std::uint64_t edge = class_min(c);
      for (std::uint64_t d = 0; d < 3; ++d) {
        if (edge >= d) units.push_back(edge - d);
        if (edge + d <= (max64 >> shift)) units.push_back(edge + d);
      }
    }
    units.push_back(max64 >> shift);
    for (const std::uint64_t u : units) {
      const std::uint64_t bytes = u << shift;
      // Reference: floor = largest class whose minimum is <= u; ceil = smallest class whose
      // minimum is >= u.
      unsigned floor_ref = 0;
      while (class_min(floor_ref + 1) <= u && floor_ref + 1 < 61 * 16) ++floor_ref;
      const unsigned ceil_ref = class_min(floor_ref) == u ? floor_ref : floor_ref + 1;
      ASSERT_EQ(a.size_class_floor(bytes), floor_ref) << "units " << u << " alignment " << alignment;
      ASSERT_EQ(a.size_class_ceil(bytes), ceil_ref) << "units " << u << " alignment " << alignment;
    }
  }
}

TEST(tlsf_size_classes, every_unit_count_up_to_65536_matches_the_model) {
  const tlsf_allocator a(growing, 1);
  unsigned c = 0;
  for (std::uint64_t u = 0; u <= 65536; ++u) {
    while (class_min(c + 1) <= u) ++c;
    ASSERT_EQ(a.size_class_floor(u), c) << u;
    ASSERT_EQ(a.size_class_ceil(u), class_min(c) == u ? c : c + 1) << u;
  }
}

// ---------------------------------------------------------------- waste bound

// The header's bound: when the O(1) allocator grows the arena (or fails) for a request of
// `need` bytes, no free hole below the high-water mark holds need + need/16 bytes or more
// (need/16 is the width of need's class; below 16 units classes are exact and no hole of
// need bytes may be skipped), and a free block at the end of the arena is smaller than need.
void check_waste_bound(const tlsf_allocator& a, std::uint64_t need, std::uint64_t old_peak,
                       std::uint64_t step) {
  const std::uint64_t units = need / a.alignment();
  const std::uint64_t slack = units >= 16 ? (units >> 4) * a.alignment() : 0;
  std::uint64_t end = 0;  // the blocks visited must tile [0, peak): a walk that skips one checks nothing
  a.for_each_block([&](std::uint64_t offset, std::uint64_t bytes, bool is_free) {
    ASSERT_EQ(offset, end) << "step " << step << ": the walk skipped a block";
    end = offset + bytes;
    if (!is_free) return;
    if (offset + bytes == old_peak) {
      ASSERT_LT(bytes, need) << "step " << step << ": a free tail of " << bytes
                             << " bytes was skipped for " << need;
    } else if (slack == 0) {
      ASSERT_LT(bytes, need) << "step " << step << ": a hole of " << bytes << " bytes was skipped for " << need;
    } else {
      ASSERT_LT(bytes, need + slack) << "step " << step << ": a hole of " << bytes
                                     << " bytes was skipped for " << need;
    }
  });
  ASSERT_EQ(end, a.peak()) << "step " << step << ": the walk ended before the high-water mark";
}

std::uint64_t scaled_ops(std::uint64_t full) {
#ifdef TENSORMEM_SANITIZED
  return full / 10;
#else
  return full;
#endif
}

void run_waste_bound(std::uint64_t capacity, std::uint64_t alignment, std::uint64_t low,
                     std::uint64_t high, std::uint64_t seed, std::uint64_t ops) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  tlsf_allocator a(capacity, alignment);
  std::vector<allocation> live;
  std::uniform_int_distribution<std::uint64_t> size(low, high);
  for (std::uint64_t step = 0; step < ops; ++step) {
    if (live.empty() || rng() % 100 < 55) {
      const std::uint64_t bytes = size(rng);
      const std::uint64_t need = *align_up(bytes, alignment);
      const std::uint64_t old_peak = a.peak();
      const auto got = a.allocate(bytes);
      if (!got || a.peak() > old_peak) check_waste_bound(a, need, old_peak, step);
      if (::testing::Test::HasFatalFailure()) return;
      if (got) live.push_back(*got);
    } else {
      const std::size_t i = rng() % live.size();
      a.deallocate(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
    if (step % 64 == 0) {
      ASSERT_EQ(a.check_invariants(), "") << "step " << step;
    }
  }
}

TEST(tlsf_waste_bound, holds_at_every_growth_with_long_lists) {
  // Sizes within a few classes make lists longer than the scan limit.
  run_waste_bound(growing, 256, 64 * 256, 80 * 256, 7, scaled_ops(200'000));
}

TEST(tlsf_waste_bound, holds_at_every_growth_and_failure_fixed_capacity) {
  run_waste_bound(std::uint64_t{1} << 24, 1, 1, 1 << 16, 8, scaled_ops(200'000));
}

TEST(tlsf_waste_bound, holds_for_small_exact_classes) {
  run_waste_bound(1 << 14, 16, 1, 15 * 16, 9, scaled_ops(100'000));
}

// A free tail in the request's own class, listed behind more than scan_limit smaller blocks
// of that class, is the only fit: it must be taken (not skipped, and not "extended" by a
// negative amount).
TEST(tlsf_waste_bound, a_free_tail_behind_the_scan_limit_is_taken) {
  for (const std::uint64_t capacity : {growing, std::uint64_t{1} << 20}) {
    tlsf_allocator a(capacity, 1);
    std::vector<allocation> holes;
    for (int i = 0; i < 12; ++i) {
      holes.push_back(*a.allocate(100));
      (void)a.allocate(1);  // keeps the holes apart
    }
    const allocation tail = *a.allocate(103);
    ASSERT_EQ(a.size_class_floor(100), a.size_class_floor(103));
    a.deallocate(tail);  // listed first ...
    for (const allocation& h : holes) a.deallocate(h);  // ... then pushed behind 12 others
    const std::uint64_t peak = a.peak();
    const auto got = a.allocate(102);
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->offset, tail.offset);
    EXPECT_EQ(a.peak(), peak);
    EXPECT_EQ(a.check_invariants(), "");
  }
}

// ---------------------------------------------------------------- lower bound near 2^64

TEST(lower_bound_arithmetic, sizes_at_and_near_two_to_the_64) {
  EXPECT_EQ(lower_bound(std::vector<buffer>{{"a", 0, 1, std::uint64_t{1} << 63, {}}}),
            std::uint64_t{1} << 63);
  EXPECT_EQ(lower_bound(std::vector<buffer>{{"a", 0, 2, std::uint64_t{1} << 62, {}},
                                            {"b", 1, 3, std::uint64_t{1} << 62, {}}}),
            std::uint64_t{1} << 63);
  EXPECT_EQ(lower_bound(std::vector<buffer>{{"a", 0, 1, max64, {}}}), max64);
  EXPECT_EQ(lower_bound(std::vector<buffer>{{"a", 0, 1, max64, {}}, {"b", 1, 2, max64, {}}}), max64);
  EXPECT_THROW(lower_bound(std::vector<buffer>{{"a", 0, 2, max64, {}}, {"b", 1, 3, 1, {}}}),
               std::overflow_error);
  EXPECT_THROW(lower_bound(std::vector<buffer>{{"a", 0, 2, max64, {}}}, 256), std::overflow_error);
  // Empty and inverted lifetimes are never alive.
  EXPECT_EQ(lower_bound(std::vector<buffer>{{"a", 5, 5, 100, {}}, {"b", 9, 3, 100, {}}, {"c", 0, 1, 7, {}}}), 7U);
}

TEST(lower_bound_arithmetic, matches_brute_force_on_random_instances) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 300; ++round) {
    std::vector<buffer> b;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      const std::uint64_t lower = rng() % 10;
      const std::uint64_t upper = rng() % 10;  // sometimes empty or inverted
      b.push_back({std::to_string(i), lower, upper, (rng() % 4 == 0) ? (std::uint64_t{1} << 61) + rng() % 5 : rng() % 1000, {}});
    }
    std::uint64_t best = 0;
    for (std::uint64_t t = 0; t < 10; ++t) {
      std::uint64_t live = 0;
      for (const buffer& x : b) {
        if (x.lower <= t && t < x.upper) live += x.bytes;
      }
      best = std::max(best, live);
    }
    ASSERT_EQ(lower_bound(b), best) << "round " << round;
  }
}

// ---------------------------------------------------------------- planner arguments

TEST(planner_arguments, sizes_that_add_past_two_to_the_64_are_rejected_clearly) {
  const std::vector<buffer> b = {{"a", 0, 2, std::uint64_t{1} << 63, {}},
                                 {"b", 1, 3, std::uint64_t{1} << 63, {}}};
  try {
    (void)plan(b);
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("2^64"), std::string::npos) << e.what();
  }
}

TEST(planner_arguments, the_largest_representable_buffer_is_planned) {
  const std::vector<buffer> b = {{"a", 0, 1, max64, {}}};
  const plan_result r = plan(b);
  ASSERT_EQ(r.offsets.size(), 1U);
  EXPECT_EQ(r.offsets[0], 0U);
  EXPECT_EQ(r.arena_bytes, max64);
  EXPECT_EQ(r.lower_bound, max64);
  EXPECT_EQ(validate(b, r.offsets, r.arena_bytes), "");
}

TEST(planner_arguments, half_of_the_address_space_twice) {
  const std::vector<buffer> b = {{"a", 0, 2, std::uint64_t{1} << 62, {}},
                                 {"b", 1, 3, std::uint64_t{1} << 62, {}}};
  const plan_result r = plan(b);
  EXPECT_EQ(r.lower_bound, std::uint64_t{1} << 63);
  EXPECT_EQ(r.arena_bytes, std::uint64_t{1} << 63);
  EXPECT_EQ(validate(b, r.offsets, r.arena_bytes), "");
}

TEST(planner_arguments, time_limits_that_are_not_a_duration_are_rejected) {
  const std::vector<buffer> b = {{"a", 0, 2, 10, {}}, {"b", 1, 3, 10, {}}};
  plan_options o;
  o.time_limit_seconds = std::nan("");
  EXPECT_THROW((void)plan(b, o), std::invalid_argument);
  o.time_limit_seconds = -1;
  EXPECT_THROW((void)plan(b, o), std::invalid_argument);
  o.time_limit_seconds = 1e300;  // longer than the clock counts: no limit, still plans
  const plan_result r = plan(b, o);
  EXPECT_EQ(r.arena_bytes, 20U);
  o.time_limit_seconds = std::numeric_limits<double>::infinity();
  EXPECT_EQ(plan(b, o).arena_bytes, 20U);
}

TEST(planner_arguments, a_huge_limit_still_runs_the_search) {
  // MiniMalloc's C: the greedy orders stay above the lower bound; the search reaches it.
  // A limit of 1e10 s must not turn into "no time at all".
  const std::vector<buffer> b = trace::read_trace(std::string(TENSORMEM_TEST_DATA) + "/traces/minimalloc_C.csv");
  plan_options o;
  o.search = false;
  const plan_result greedy = plan(b, o);
  ASSERT_GT(greedy.arena_bytes, greedy.lower_bound) << "the instance no longer needs the search";
  o.search = true;
  o.time_limit_seconds = 1e10;
  const plan_result r = plan(b, o);
  EXPECT_EQ(r.arena_bytes, r.lower_bound);
  EXPECT_EQ(validate(b, r.offsets, r.arena_bytes), "");
}

// ---------------------------------------------------------------- validator oracle

// Brute force: every pair that overlaps in time (half-open, empty lifetimes never) and in
// bytes is a conflict; every end must lie within the arena.
bool brute_force_valid(const std::vector<buffer>& b, const std::vector<std::uint64_t>& offsets,
                       std::uint64_t arena) {
  for (std::size_t i = 0; i < b.size(); ++i) {
    if (offsets[i] + b[i].bytes > arena) return false;
    for (std::size_t j = i + 1; j < b.size(); ++j) {
      const bool time = b[i].lower < b[j].upper && b[j].lower < b[i].upper &&
                        b[i].lower < b[i].upper && b[j].lower < b[j].upper;
      const bool space = offsets[i] < offsets[j] + b[j].bytes && offsets[j] < offsets[i] + b[i].bytes &&
                         b[i].bytes != 0 && b[j].bytes != 0;
      if (time && space) return false;
    }
  }
  return true;
}

TEST(validate_oracle, agrees_with_brute_force_on_random_plans) {
  std::mt19937_64 rng(12);
  int invalid = 0;
  for (int round = 0; round < 20'000; ++round) {
    const std::size_t n = 1 + rng() % 7;
    std::vector<buffer> b;
    std::vector<std::uint64_t> offsets;
    std::uint64_t highest = 0;
    for (std::size_t i = 0; i < n; ++i) {
      // Small ranges so that offsets and times collide often; some lifetimes inverted or
      // empty, some sizes zero.
      b.push_back({std::to_string(i), rng() % 6, rng() % 6, rng() % 5, {}});
      offsets.push_back(rng() % 8);
      highest = std::max(highest, offsets.back() + b.back().bytes);
    }
    const std::uint64_t arena = highest + rng() % 3 - (rng() % 4 == 0 ? 1 : 0);
    const bool expect = brute_force_valid(b, offsets, arena);
    const std::string got = validate(b, offsets, arena);
    ASSERT_EQ(got.empty(), expect) << "round " << round << ": " << got;
    invalid += expect ? 0 : 1;
  }
  EXPECT_GT(invalid, 1000);  // both outcomes were exercised
}

TEST(validate_oracle, an_inverted_lifetime_does_not_hide_a_real_overlap) {
  // b has an inverted lifetime at a's offset: its "end" must not erase a from the sweep.
  const std::vector<buffer> b = {{"a", 0, 10, 8, {}}, {"b", 7, 2, 8, {}}, {"c", 5, 6, 8, {}}};
  EXPECT_NE(validate(b, std::vector<std::uint64_t>{0, 0, 4}, 12).find("'c' and 'a' overlap"),
            std::string::npos);
}

TEST(validate_oracle, each_branch_reports_its_fault) {
  const std::vector<buffer> b = {{"a", 0, 2, 10, {}}, {"b", 1, 3, 10, {}}};
  EXPECT_EQ(validate(b, std::vector<std::uint64_t>{0, 10}, 20, 3), "alignment is not a power of two");
  EXPECT_NE(validate(b, std::vector<std::uint64_t>{0}, 20).find("1 offsets for 2"), std::string::npos);
  EXPECT_NE(validate(b, std::vector<std::uint64_t>{0, 12}, 24, 8).find("not a multiple of 8"), std::string::npos);
  EXPECT_EQ(validate(b, std::vector<std::uint64_t>{0, max64 - 3}, max64),
            "'b' at offset 18446744073709551612 with 10 bytes ends past 2^64 - 1");
  EXPECT_NE(validate(b, std::vector<std::uint64_t>{0, 10}, 19).find("past the arena"), std::string::npos);
  // Overlap found through the next live range (b starts below a) and the previous one.
  EXPECT_NE(validate(b, std::vector<std::uint64_t>{5, 0}, 20).find("'b' and 'a' overlap"), std::string::npos);
  EXPECT_NE(validate(b, std::vector<std::uint64_t>{0, 5}, 20).find("'b' and 'a' overlap"), std::string::npos);
  EXPECT_EQ(validate(b, std::vector<std::uint64_t>{0, 10}, 20), "");
}

}  // namespace
}  // namespace tensormem::core
