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
  offset_allocator_baseline a(0, 256);
  std::vector<offset_allocator_baseline::handle> live;
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
  offset_allocator_baseline a(0, 256);
  EXPECT_EQ(a.peak(), 0U);
  std::vector<offset_allocator_baseline::handle> h;
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

}  // namespace
}  // namespace tensormem::bench
