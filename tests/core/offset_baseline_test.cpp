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
  std::vector<core::allocation> live;
  std::map<std::uint64_t, std::uint64_t> by_offset;  // model: offset -> bytes of live blocks
  for (int step = 0; step < 200'000; ++step) {
    if (live.empty() || (live.size() < 2000 && rng() % 100 < 55)) {
      const std::uint64_t bytes = 1 + rng() % (1 << (rng() % 22));
      const auto r = a.allocate(bytes);
      ASSERT_TRUE(r.has_value());
      ASSERT_EQ(r->offset % 256, 0U);
      ASSERT_GE(r->bytes, bytes);
      auto next = by_offset.lower_bound(r->offset);
      if (next != by_offset.end()) {
        ASSERT_LE(r->offset + r->bytes, next->first) << "overlaps the block above";
      }
      if (next != by_offset.begin()) {
        const auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, r->offset) << "overlaps the block below";
      }
      by_offset.emplace(r->offset, r->bytes);
      live.push_back(*r);
    } else {
      const std::size_t k = rng() % live.size();
      by_offset.erase(live[k].offset);
      a.deallocate(live[k]);
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (const auto& b : live) a.deallocate(b);
  const auto whole = a.allocate((std::uint64_t{1} << 31) * 256);  // everything merged: from 0
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->offset, 0U);
}

}  // namespace
}  // namespace tensormem::bench
