// Behaviour shared by both online allocators, written once as a typed suite.

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/tlsf_allocator.hpp"

namespace tensormem::core {
namespace {

template <class A>
class allocator_test : public ::testing::Test {};
using allocator_types = ::testing::Types<best_fit_allocator, tlsf_allocator>;
TYPED_TEST_SUITE(allocator_test, allocator_types);

constexpr std::uint64_t max64 = std::numeric_limits<std::uint64_t>::max();

template <class A>
allocation must_allocate(A& a, std::uint64_t bytes) {
  auto r = a.allocate(bytes);
  EXPECT_TRUE(r.has_value()) << "allocation of " << bytes << " bytes failed";
  EXPECT_EQ(a.check_invariants(), "");
  return r.value_or(allocation{});
}

// InfiniTensor's allocator scenarios.
TYPED_TEST(allocator_test, freed_block_is_reused_by_equal_request) {
  TypeParam a;
  const auto x = must_allocate(a, 1000);
  const auto b = must_allocate(a, 3000);
  const auto c = must_allocate(a, 2000);
  (void)x;
  (void)c;
  a.free(b.offset, 3000);
  const auto d = must_allocate(a, 3000);
  EXPECT_EQ(d.offset, b.offset);
  EXPECT_EQ(a.stats().free_blocks, 0U);
}

TYPED_TEST(allocator_test, adjacent_frees_merge_into_one_block) {
  TypeParam a;
  const auto x = must_allocate(a, 1000);
  const auto b = must_allocate(a, 3000);
  const auto c = must_allocate(a, 2000);
  (void)x;
  a.free(b.offset, 3000);
  a.free(c.offset, 2000);
  EXPECT_EQ(a.check_invariants(), "");
  const allocator_stats s = a.stats();
  EXPECT_EQ(s.free_blocks, 1U);
  EXPECT_EQ(s.largest_free_bytes, b.bytes + c.bytes);
  EXPECT_EQ(s.free_bytes, b.bytes + c.bytes);
  // The merged block starts at b: a request of its whole size lands there.
  const auto d = must_allocate(a, b.bytes + c.bytes);
  EXPECT_EQ(d.offset, b.offset);
}

TYPED_TEST(allocator_test, tail_block_is_extended) {
  TypeParam a;
  must_allocate(a, 1000);
  must_allocate(a, 3000);
  const auto c = must_allocate(a, 2000);
  const std::uint64_t peak_before = a.peak();
  a.deallocate(c);
  const auto d = must_allocate(a, 2 * c.bytes);
  EXPECT_EQ(d.offset, c.offset);
  EXPECT_EQ(a.stats().free_blocks, 0U);
  EXPECT_EQ(a.peak(), peak_before + c.bytes);
}

TYPED_TEST(allocator_test, smallest_fitting_hole_is_chosen) {
  TypeParam a(growing, 1);
  std::vector<allocation> blocks;
  for (std::uint64_t bytes : {100U, 1U, 40U, 1U, 60U, 1U, 40U, 1U}) blocks.push_back(must_allocate(a, bytes));
  a.deallocate(blocks[0]);
  a.deallocate(blocks[2]);
  a.deallocate(blocks[4]);
  a.deallocate(blocks[6]);
  // 40 fits the holes of 100, 40, 60 and 40: best fit takes the lowest 40.
  EXPECT_EQ(must_allocate(a, 40).offset, blocks[2].offset);
  EXPECT_EQ(must_allocate(a, 40).offset, blocks[6].offset);
  EXPECT_EQ(must_allocate(a, 50).offset, blocks[4].offset);
}

TYPED_TEST(allocator_test, sizes_round_up_to_alignment) {
  TypeParam a(growing, 512);
  const auto x = must_allocate(a, 1);
  const auto y = must_allocate(a, 513);
  EXPECT_EQ(x.bytes, 512U);
  EXPECT_EQ(y.offset, 512U);
  EXPECT_EQ(y.bytes, 1024U);
  EXPECT_EQ(a.peak(), 1536U);
  EXPECT_EQ(a.used(), 1536U);
  a.free(y.offset, 513);  // the size asked for is accepted
  EXPECT_EQ(a.used(), 512U);
}

TYPED_TEST(allocator_test, alignment_edges) {
  EXPECT_THROW(TypeParam(growing, 0), std::invalid_argument);
  EXPECT_THROW(TypeParam(growing, 3), std::invalid_argument);
  EXPECT_THROW(TypeParam(growing, 768), std::invalid_argument);
  TypeParam one(growing, 1);
  EXPECT_EQ(must_allocate(one, 3).offset, 0U);
  EXPECT_EQ(must_allocate(one, 5).offset, 3U);
  TypeParam big(growing, std::uint64_t{1} << 40);
  EXPECT_EQ(must_allocate(big, 1).bytes, std::uint64_t{1} << 40);
  // A request that overflows 64 bits when rounded up fails cleanly.
  TypeParam a;
  EXPECT_FALSE(a.allocate(std::numeric_limits<std::uint64_t>::max()).has_value());
  EXPECT_FALSE(a.allocate(std::numeric_limits<std::uint64_t>::max() - 100).has_value());
  EXPECT_EQ(a.check_invariants(), "");
  EXPECT_EQ(a.peak(), 0U);
  // The boundary: 2^64 - 255 bytes do not round up to a 64-bit count of 256-byte units;
  // 2^64 - 256 do (and fit a growing arena).
  TypeParam edge;
  EXPECT_FALSE(edge.allocate(max64 - 254).has_value());
  EXPECT_EQ(edge.peak(), 0U);
  const auto top = edge.allocate(max64 - 255);
  ASSERT_TRUE(top.has_value());
  EXPECT_EQ(top->bytes, max64 - 255);
  EXPECT_EQ(edge.peak(), max64 - 255);
  EXPECT_EQ(edge.check_invariants(), "");
}

TYPED_TEST(allocator_test, zero_bytes) {
  TypeParam a;
  const auto z = a.allocate(0);
  ASSERT_TRUE(z.has_value());
  EXPECT_EQ(z->bytes, 0U);
  EXPECT_EQ(z->offset, 0U);
  EXPECT_EQ(a.peak(), 0U);
  const auto x = must_allocate(a, 256);
  a.deallocate(*z);
  a.free(0, 0);
  EXPECT_EQ(a.used(), 256U);
  EXPECT_EQ(a.check_invariants(), "");
  a.deallocate(x);
  EXPECT_EQ(a.used(), 0U);
}

TYPED_TEST(allocator_test, fixed_capacity_used_exactly) {
  TypeParam a(4096, 256);
  std::vector<allocation> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(must_allocate(a, 256));
  EXPECT_FALSE(a.allocate(1).has_value());
  EXPECT_EQ(a.stats().free_bytes, 0U);
  EXPECT_EQ(a.stats().free_blocks, 0U);
  a.deallocate(blocks[3]);
  a.deallocate(blocks[5]);
  const allocator_stats s = a.stats();
  EXPECT_EQ(s.free_bytes, 512U);
  EXPECT_EQ(s.free_blocks, 2U);
  EXPECT_EQ(s.largest_free_bytes, 256U);
  EXPECT_DOUBLE_EQ(s.fragmentation(), 0.5);
  EXPECT_FALSE(a.allocate(512).has_value());  // enough bytes, no single hole
  EXPECT_EQ(a.check_invariants(), "");
  EXPECT_EQ(must_allocate(a, 256).offset, blocks[3].offset);
}

TYPED_TEST(allocator_test, fixed_capacity_tail_counts_as_free) {
  TypeParam a(10000, 1);
  const auto x = must_allocate(a, 1000);
  const auto y = must_allocate(a, 1000);
  a.deallocate(y);
  allocator_stats s = a.stats();
  EXPECT_EQ(s.free_bytes, 9000U);
  EXPECT_EQ(s.free_blocks, 1U);
  EXPECT_EQ(s.largest_free_bytes, 9000U);
  EXPECT_TRUE(a.allocate(9000).has_value());
  EXPECT_FALSE(a.allocate(1).has_value());
  (void)x;
}

TYPED_TEST(allocator_test, capacities_above_2_pow_40) {
  const std::uint64_t tib = std::uint64_t{1} << 40;
  TypeParam a(4 * tib, 4096);
  const auto x = must_allocate(a, tib);
  const auto y = must_allocate(a, 2 * tib);
  const auto z = must_allocate(a, tib - 4096);
  EXPECT_EQ(y.offset, tib);
  EXPECT_EQ(z.offset, 3 * tib);
  EXPECT_FALSE(a.allocate(8192).has_value());
  a.deallocate(y);
  const auto w = must_allocate(a, tib + 12345);
  EXPECT_EQ(w.offset, tib);
  EXPECT_EQ(a.used(), x.bytes + z.bytes + w.bytes);
  TypeParam g;  // growing past 2^60
  for (int i = 0; i < 8; ++i) must_allocate(g, std::uint64_t{1} << 60);
  EXPECT_EQ(g.peak(), std::uint64_t{1} << 63);
  EXPECT_TRUE(g.allocate((std::uint64_t{1} << 63) - 256).has_value());
  EXPECT_FALSE(g.allocate(256 * 2).has_value());  // would pass 2^64
  EXPECT_EQ(g.check_invariants(), "");
}

template <class A>
void expect_unchanged(const A& a, const allocator_stats& before) {
  const allocator_stats after = a.stats();
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.peak_bytes, before.peak_bytes);
  EXPECT_EQ(after.free_blocks, before.free_blocks);
  EXPECT_EQ(after.live_allocations, before.live_allocations);
  EXPECT_EQ(a.check_invariants(), "");
}

TYPED_TEST(allocator_test, misuse_is_reported_and_changes_nothing) {
  TypeParam a;
  const auto x = must_allocate(a, 1000);
  const auto y = must_allocate(a, 2000);
  const auto z = must_allocate(a, 3000);
  a.deallocate(y);
  const allocator_stats before = a.stats();

  // Unknown offset.
  EXPECT_EQ(a.try_free(x.offset + 256, 256), free_status::not_allocated);
  try {
    a.free(x.offset + 256, 256);
    ADD_FAILURE() << "free of an unknown offset did not throw";
  } catch (const allocator_misuse& e) {
    EXPECT_NE(std::string(e.what()).find("offset 256"), std::string::npos) << e.what();
  }
  expect_unchanged(a, before);
  // The largest 64-bit offset (the offset index's mark for an empty slot) holds nothing,
  // whatever size is given: that of the block at offset 0, of the block freed above, or of
  // none. (The index used to answer with an empty slot's stale node, and a free there with
  // that node's size freed the block at offset 0.)
  for (const std::uint64_t bytes : {x.bytes, y.bytes, z.bytes, std::uint64_t{0}, max64}) {
    EXPECT_EQ(a.try_free(max64, bytes), free_status::not_allocated) << bytes;
    EXPECT_THROW(a.free(max64, bytes), allocator_misuse);
  }
  expect_unchanged(a, before);
  // Double free through the offset API and through the handle.
  EXPECT_THROW(a.free(y.offset, 2000), allocator_misuse);
  EXPECT_THROW(a.deallocate(y), allocator_misuse);
  EXPECT_NE(a.try_deallocate(y), free_status::ok);
  expect_unchanged(a, before);
  // Size that does not match.
  EXPECT_EQ(a.try_free(z.offset, 100), free_status::size_mismatch);
  try {
    a.free(z.offset, 5000);
    ADD_FAILURE() << "free with the wrong size did not throw";
  } catch (const allocator_misuse& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("5000 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("holds 3072 bytes"), std::string::npos) << what;
  }
  allocation wrong = z;
  wrong.bytes = 256;
  EXPECT_THROW(a.deallocate(wrong), allocator_misuse);
  expect_unchanged(a, before);
  // The zero-byte allocation's handle with a size written into it is not that handle.
  allocation forged = *a.allocate(0);
  EXPECT_EQ(a.try_deallocate(forged), free_status::ok);
  forged.bytes = 256;
  EXPECT_EQ(a.try_deallocate(forged), free_status::foreign_handle);
  forged.owner = x.owner;
  EXPECT_EQ(a.try_deallocate(forged), free_status::stale_handle);
  EXPECT_THROW(a.deallocate(forged), allocator_misuse);
  expect_unchanged(a, before);
  // A stale handle whose offset was handed out again is still refused by the O(1) allocator
  // (generation check); best fit sees a live block at that offset with another size.
  const auto reused = must_allocate(a, 1024);
  EXPECT_EQ(reused.offset, y.offset);
  EXPECT_NE(a.try_deallocate(y), free_status::ok);
  a.deallocate(reused);
  a.deallocate(x);
  a.deallocate(z);
  EXPECT_EQ(a.used(), 0U);
  EXPECT_EQ(a.check_invariants(), "");
}

// A reserve changes no handle: the same random stream, with a reserve before it and another
// in its middle (while recycled nodes wait), hands out the same offsets, sizes, node indices
// and generations as without, and the blocks and statistics agree after every step.
TYPED_TEST(allocator_test, reserve_changes_no_handle) {
  TypeParam plain;
  TypeParam reserved;
  reserved.reserve(40);
  std::mt19937_64 rng(11);
  std::vector<std::pair<allocation, allocation>> live;
  for (int step = 0; step < 4000; ++step) {
    if (step == 1500) reserved.reserve(700);
    if (live.empty() || rng() % 100 < 52) {
      const std::uint64_t bytes = 1 + rng() % (std::uint64_t{1} << (rng() % 2 == 0 ? 14 : 26));
      const auto p = must_allocate(plain, bytes);
      const auto r = must_allocate(reserved, bytes);
      ASSERT_EQ(std::tie(p.offset, p.bytes, p.node, p.generation), std::tie(r.offset, r.bytes, r.node, r.generation))
          << "step " << step;
      live.emplace_back(p, r);
    } else {
      const std::size_t i = rng() % live.size();
      plain.deallocate(live[i].first);
      reserved.deallocate(live[i].second);
      live[i] = live.back();
      live.pop_back();
    }
    const allocator_stats ps = plain.stats();
    const allocator_stats rs = reserved.stats();
    ASSERT_EQ(std::tie(ps.free_blocks, ps.largest_free_bytes, ps.peak_bytes, ps.used_bytes),
              std::tie(rs.free_blocks, rs.largest_free_bytes, rs.peak_bytes, rs.used_bytes))
        << "step " << step;
  }
  EXPECT_EQ(reserved.check_invariants(), "");
}

}  // namespace
}  // namespace tensormem::core
