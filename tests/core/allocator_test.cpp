// Behaviour shared by both online allocators, written once as a typed suite.

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
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
  EXPECT_EQ(a.stats().fragmentation(), 0.0);  // nothing free: none, not 0 / 0
  a.deallocate(blocks[3]);
  a.deallocate(blocks[5]);
  const allocator_stats s = a.stats();
  EXPECT_EQ(s.free_bytes, 512U);
  EXPECT_EQ(s.free_blocks, 2U);
  EXPECT_EQ(s.largest_free_bytes, 256U);
  EXPECT_EQ(s.peak_bytes, 4096U);
  EXPECT_EQ(s.used_bytes, 3584U);
  EXPECT_EQ(s.live_allocations, 14U);
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

// A fixed arena taken whole by one allocation, and one unit more refused, at capacities on
// either side of the allocators' 64- and 4096-list boundaries (the O(1) allocator's exact lists
// end at the capacity: a request past it must not read beyond them).
TYPED_TEST(allocator_test, the_whole_capacity_in_one_allocation_and_a_unit_more_refused) {
  for (const std::uint64_t units : {1U, 2U, 63U, 64U, 65U, 127U, 128U, 4095U, 4096U, 4097U, 65535U, 65536U, 65537U}) {
    SCOPED_TRACE(units);
    TypeParam a(units * 256, 256);
    EXPECT_FALSE(a.allocate(units * 256 + 1).has_value());
    EXPECT_FALSE(a.allocate((units + 1) * 256).has_value());
    const allocation whole = must_allocate(a, units * 256);
    EXPECT_EQ(whole.offset, 0U);
    EXPECT_FALSE(a.allocate(1).has_value());
    a.deallocate(whole);
    EXPECT_FALSE(a.allocate((units + 1) * 256).has_value());
    EXPECT_EQ(must_allocate(a, units * 256 - 255).offset, 0U);
    EXPECT_EQ(a.check_invariants(), "");
  }
}

// One hole of h units below a used unit, then a request of r units, for sizes on either side
// of 64, 4096 and 65536 units (the bitmap words and groups of the O(1) allocator's lists):
// the hole is taken exactly when it holds the request, else the arena grows.
TYPED_TEST(allocator_test, a_hole_is_taken_only_when_it_holds_the_request) {
  const std::vector<std::uint64_t> sizes = {1,    10,   63,   64,   65,   4031, 4032, 4040, 4095, 4096,
                                            4097, 8127, 8128, 8191, 8192, 65472, 65535, 65536, 65537};
  for (const std::uint64_t h : sizes) {
    for (const std::uint64_t r : sizes) {
      SCOPED_TRACE(::testing::Message() << "hole " << h << " units, request " << r);
      TypeParam a(growing, 256);
      const allocation hole = must_allocate(a, h * 256);
      must_allocate(a, 256);
      a.deallocate(hole);
      const allocation got = must_allocate(a, r * 256);
      EXPECT_EQ(got.offset, h >= r ? 0 : (h + 1) * 256);
      EXPECT_EQ(a.peak(), h >= r ? (h + 1) * 256 : (h + 1 + r) * 256);
    }
  }
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
  // A live block's handle with another node index written into it: every node of the pool,
  // the indices just past it, and those at the top of the range, which the node types use
  // as marks. Each is refused as not naming a live allocation, and the message path reads
  // no node it does not have. (The pool holds at most a few hundred nodes here.)
  std::vector<std::uint32_t> nodes(512);
  std::iota(nodes.begin(), nodes.end(), 0U);
  for (const std::uint32_t top : {0xfffffff0U, 0xfffffffcU, 0xfffffffdU, 0xfffffffeU, 0xffffffffU}) nodes.push_back(top);
  for (const std::uint32_t n : nodes) {
    if (n == x.node) continue;
    allocation other = x;
    other.node = n;
    EXPECT_EQ(a.try_deallocate(other), free_status::stale_handle) << n;
    try {
      a.deallocate(other);
      ADD_FAILURE() << "a handle naming node " << n << " was taken";
    } catch (const allocator_misuse& e) {
      EXPECT_NE(std::string(e.what()).find("does not name a live allocation"), std::string::npos) << e.what();
    }
  }
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

// The O(1) allocator's size classes (sizes of exact_units units and more; alignment 1 here, so
// 65,536 bytes and more, 4,096 bytes to a class) at the edges of its scan window: a class
// list is newest first, and only its first scan_limit blocks are looked at.
namespace tlsf_edges {
constexpr std::uint64_t base = tlsf_allocator::exact_units;  // the first class: [base, base + 4096)

// Frees `sizes` in the order given, each below a used byte, so that none merges.
std::vector<allocation> free_in_order(tlsf_allocator& a, const std::vector<std::uint64_t>& sizes) {
  std::vector<allocation> holes;
  for (const std::uint64_t bytes : sizes) {
    holes.push_back(must_allocate(a, bytes));
    must_allocate(a, 1);
  }
  for (const allocation& h : holes) a.deallocate(h);
  return holes;
}
}  // namespace tlsf_edges

// A block that enters the scanned window when one ahead of it leaves is looked at: the
// window's largest size is no longer known then.
TEST(tlsf_edges, a_block_that_enters_the_scan_window_is_seen) {
  using namespace tlsf_edges;
  tlsf_allocator a(growing, 1);
  std::vector<std::uint64_t> sizes = {base + 3464};  // freed first: ninth in its list
  for (std::uint64_t i = 0; i < tlsf_allocator::scan_limit; ++i) sizes.push_back(base + i);
  const std::vector<allocation> holes = free_in_order(a, sizes);
  const std::uint64_t peak = a.peak();
  // Beyond the window: not found, the arena grows (the documented waste bound).
  EXPECT_EQ(must_allocate(a, base + 3000).offset, peak);  // (kept: freed, it would list first)
  must_allocate(a, base + 3);  // takes the window's block of that size exactly
  const allocation entered = must_allocate(a, base + 3000);
  EXPECT_EQ(entered.offset, holes[0].offset);
  EXPECT_EQ(a.check_invariants(), "");
}

// A free block at the end of the arena that sits beyond its list's window is still taken,
// whole or in part, before the arena grows.
TEST(tlsf_edges, a_free_tail_beyond_the_scan_window_is_taken_before_growing) {
  using namespace tlsf_edges;
  for (const std::uint64_t request : {base + 3000, base + 4000}) {
    SCOPED_TRACE(request);
    tlsf_allocator a(growing, 1);
    std::vector<allocation> holes;
    for (std::uint64_t i = 0; i < tlsf_allocator::scan_limit + 2; ++i) {
      holes.push_back(must_allocate(a, base + i));
      must_allocate(a, 1);
    }
    const allocation tail = must_allocate(a, base + 4000);
    a.deallocate(tail);  // the free tail, listed first for now
    for (const allocation& h : holes) a.deallocate(h);  // newer: listed ahead of the tail
    const std::uint64_t peak = a.peak();
    EXPECT_EQ(must_allocate(a, request).offset, tail.offset);
    EXPECT_EQ(a.peak(), peak);
  }
}

// A class block of exactly the size asked for is taken whole: no empty remainder is made.
TEST(tlsf_edges, an_exact_fit_from_a_class_leaves_no_empty_block) {
  using namespace tlsf_edges;
  tlsf_allocator a(growing, 1);
  const std::vector<allocation> holes = free_in_order(a, {base + 5});
  const std::uint64_t blocks = a.stats().free_blocks;
  EXPECT_EQ(must_allocate(a, base + 5).offset, holes[0].offset);
  EXPECT_EQ(a.stats().free_blocks, blocks - 1);
  EXPECT_EQ(a.check_invariants(), "");
}

}  // namespace
}  // namespace tensormem::core
