// The benchmarks' OffsetAllocator baseline must be a correct allocator for its speed to mean
// anything: live blocks never overlap and stay aligned, and freeing everything merges the
// arena back so that one allocation can again start at offset 0.

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "../../bench/offset_allocator_baseline.hpp"

namespace tensormem::bench {
namespace {

TEST(offset_allocator_baseline, random_sequences_never_overlap_and_merge_back) {
  std::mt19937_64 rng(7);
  offset_allocator_baseline_with_peak a(0, 256);
  std::vector<offset_allocator_baseline_with_peak::handle> live;
  std::map<std::uint64_t, std::uint64_t> by_offset;  // model: offset -> bytes of live blocks
  for (int step = 0; step < 200'000; ++step) {
    if (live.empty() || (live.size() < 2000 && rng() % 100 < 55)) {
      const std::uint64_t bytes = 1 + rng() % (1 << (rng() % 22));
      const auto r = a.allocate(bytes);
      ASSERT_TRUE(r.has_value());
      const std::uint64_t offset = a.offset_of(*r);
      const std::uint64_t held = a.bytes_of(*r);
      ASSERT_EQ(offset % 256, 0U);
      ASSERT_GE(held, bytes);
      ASSERT_LT(held, bytes + 256);
      ASSERT_GE(a.peak(), offset + held);
      auto next = by_offset.lower_bound(offset);
      if (next != by_offset.end()) {
        ASSERT_LE(offset + held, next->first) << "overlaps the block above";
      }
      if (next != by_offset.begin()) {
        const auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, offset) << "overlaps the block below";
      }
      by_offset.emplace(offset, held);
      live.push_back(*r);
    } else {
      const std::size_t k = rng() % live.size();
      by_offset.erase(a.offset_of(live[k]));
      a.deallocate(live[k]);
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (const auto& b : live) a.deallocate(b);
  const auto whole = a.allocate((std::uint64_t{1} << 31) * 256);  // everything merged: from 0
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(a.offset_of(*whole), 0U);
}

// The high-water mark the benchmarks report: the highest end handed out, not lowered by frees.
TEST(offset_allocator_baseline, peak_is_the_highest_end_handed_out) {
  offset_allocator_baseline_with_peak a(0, 256);
  EXPECT_EQ(a.peak(), 0U);
  std::vector<offset_allocator_baseline_with_peak::handle> h;
  for (std::uint64_t i = 0; i < 3; ++i) {
    h.push_back(*a.allocate(100));
    EXPECT_EQ(a.offset_of(h.back()), 256U * i);
    EXPECT_EQ(a.peak(), 256U * (i + 1));
  }
  a.deallocate(h[2]);
  EXPECT_EQ(a.peak(), 768U);
  const auto big = a.allocate(1000);  // the freed top block merged with the free arena above
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(a.offset_of(*big), 512U);
  EXPECT_EQ(a.bytes_of(*big), 1024U);
  EXPECT_EQ(a.peak(), 1536U);
}

// The timed form keeps no high-water mark; otherwise it is the same allocator: the same
// handles, step for step, as the form the benchmarks take their marks from.
TEST(offset_allocator_baseline, the_timed_form_places_as_the_form_with_a_peak) {
  std::mt19937_64 rng(11);
  offset_allocator_baseline timed(0, 256);
  offset_allocator_baseline_with_peak marked(0, 256);
  std::vector<offset_allocator_baseline::handle> live;
  for (int step = 0; step < 100'000; ++step) {
    if (live.empty() || (live.size() < 1000 && rng() % 100 < 55)) {
      const std::uint64_t bytes = 1 + rng() % (1 << (rng() % 22));
      const auto t = timed.allocate(bytes);
      const auto m = marked.allocate(bytes);
      ASSERT_TRUE(t.has_value() && m.has_value());
      ASSERT_EQ(t->offset, m->offset) << "step " << step;
      ASSERT_EQ(t->node, m->node) << "step " << step;
      live.push_back(*t);
    } else {
      const std::size_t k = rng() % live.size();
      timed.deallocate(live[k]);
      marked.deallocate({live[k].offset, live[k].node});
      live[k] = live.back();
      live.pop_back();
    }
  }
}

// The node pool is made once, as OffsetAllocator's: an allocation that would need a node
// more fails and changes nothing; freeing gives nodes back.
TEST(offset_allocator_baseline, a_full_node_pool_fails_the_allocation_and_frees_refill_it) {
  offset_allocator_baseline_with_peak a(0, 256, 4);  // the free arena takes one node
  std::vector<offset_allocator_baseline_with_peak::handle> h;
  for (std::uint64_t i = 0; i < 3; ++i) {
    const auto r = a.allocate(256);
    ASSERT_TRUE(r.has_value()) << i;
    EXPECT_EQ(a.offset_of(*r), 256 * i);
    h.push_back(*r);
  }
  EXPECT_FALSE(a.allocate(256).has_value());  // four nodes in use: three blocks and the rest
  EXPECT_EQ(a.peak(), 768U);
  a.deallocate(h[1]);  // a free block between two live ones: still four nodes
  EXPECT_FALSE(a.allocate(512).has_value());
  a.deallocate(h[2]);  // merges with the block below and the rest: two nodes
  const auto r = a.allocate(512);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(a.offset_of(*r), 256U);
  EXPECT_EQ(a.peak(), 768U);
}

}  // namespace
}  // namespace tensormem::bench
