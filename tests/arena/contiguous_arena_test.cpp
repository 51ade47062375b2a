// The contiguous arena, checked by content: patterns survive every defragmentation and every
// observer knows where its tensor is.

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <map>
#include <optional>
#include <stdexcept>
#include <random>
#include <string>

#include "move_down.hpp"
#include "tensormem/arena/contiguous_arena.hpp"
#include "tensormem/core/align.hpp"
#include "tensormem/core/compaction.hpp"
#include "tensormem/memory/host_resource.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"

namespace tensormem::arena {
namespace {

void fill(const tensor_block& b) {
  for (std::uint64_t i = 0; i < b.bytes; ++i) {
    b.data()[i] = static_cast<std::byte>((b.id * 37 + i * 11) & 0xff);
  }
}
bool intact(const tensor_block& b) {
  for (std::uint64_t i = 0; i < b.bytes; ++i) {
    if (b.data()[i] != static_cast<std::byte>((b.id * 37 + i * 11) & 0xff)) return false;
  }
  return true;
}

TEST(contiguous_arena, defragments_when_free_bytes_suffice_but_no_hole_does) {
  memory::host_resource host;
  for (const defrag_policy policy : {defrag_policy::minimal_move, defrag_policy::full_compaction}) {
    contiguous_arena arena(host, 1024, {.alignment = 1, .policy = policy});
    std::vector<tensor_block> t;
    for (int i = 0; i < 8; ++i) {
      t.push_back(arena.allocate(128));
      fill(t.back());
    }
    arena.release(t[1]);
    arena.release(t[4]);
    std::map<std::uint64_t, std::byte*> seen;
    for (const std::size_t i : {0U, 2U, 3U, 5U, 6U, 7U}) {
      arena.bind(t[i].id, [&seen](const tensor_block& b) { seen[b.id] = b.data(); });
    }
    EXPECT_EQ(arena.print_allocation(8), "|.||.|||");
    EXPECT_EQ(arena.print_allocation(contiguous_arena::max_resolution).size(), contiguous_arena::max_resolution);
    EXPECT_THROW((void)arena.print_allocation(contiguous_arena::max_resolution + 1), std::invalid_argument);
    EXPECT_THROW((void)arena.print_allocation(std::size_t{1} << 63), std::invalid_argument);
    const tensor_block big = arena.allocate(256);  // 256 free, holes of 128
    fill(big);
    const arena_stats s = arena.stats();
    EXPECT_EQ(s.defragmentations, 1U);
    EXPECT_EQ(s.free_bytes, 0U);
    EXPECT_EQ(arena.print_allocation(8), "||||||||");
    for (const std::size_t i : {0U, 2U, 3U, 5U, 6U, 7U}) {
      const tensor_block now = arena.block(t[i].id);
      EXPECT_TRUE(intact(now)) << "tensor " << i;
      if (now.offset != t[i].offset) {
        EXPECT_EQ(seen.at(t[i].id), now.data()) << "observer of tensor " << i;
      } else {
        EXPECT_FALSE(seen.contains(t[i].id));
      }
    }
    if (policy == defrag_policy::minimal_move) {
      EXPECT_EQ(s.bytes_moved, 256U);  // t2, t3 slide into t1's hole
    } else {
      EXPECT_EQ(s.bytes_moved, 6U * 128 - 128);  // everything above the first hole
    }
  }
}

TEST(contiguous_arena, out_of_memory_leaves_everything_untouched) {
  memory::host_resource host;
  contiguous_arena arena(host, 4096, {.alignment = 256});
  const tensor_block a = arena.allocate(1000);
  const tensor_block b = arena.allocate(1000);
  fill(a);
  fill(b);
  const arena_stats before = arena.stats();
  try {
    arena.allocate(3000);
    FAIL() << "expected arena_out_of_memory";
  } catch (const arena_out_of_memory& e) {
    EXPECT_EQ(e.requested_bytes(), 3000U);
    EXPECT_EQ(e.free_bytes(), 2048U);
    EXPECT_EQ(e.largest_free_bytes(), 2048U);
    EXPECT_NE(std::string(e.what()).find("2048 bytes free"), std::string::npos);
  }
  const arena_stats after = arena.stats();
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.defragmentations, 0U);
  EXPECT_TRUE(intact(arena.block(a.id)));
  EXPECT_TRUE(intact(arena.block(b.id)));
}

TEST(contiguous_arena, misuse_is_reported_and_changes_nothing) {
  memory::host_resource host;
  contiguous_arena arena(host, 4096);
  const tensor_block a = arena.allocate(100);
  arena.release(a);
  try {
    arena.release(a.id);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("already released"), std::string::npos);
  }
  EXPECT_THROW(arena.release(999), std::invalid_argument);
  try {  // the id this arena would hand out next: never handed out, not released
    arena.release(a.id + 1);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("never allocated"), std::string::npos) << e.what();
  }
  EXPECT_THROW(arena.bind(a.id, [](const tensor_block&) {}), std::invalid_argument);
  EXPECT_THROW(arena.block(a.id), std::invalid_argument);
  EXPECT_EQ(arena.stats().used_bytes, 0U);
}

// A bad alignment is named as the arena's, before any memory is taken.
TEST(contiguous_arena, alignment_must_be_a_power_of_two_up_to_4096) {
  memory::host_resource host;
  for (const std::uint64_t bad : {0ULL, 3ULL, 8192ULL}) {
    try {
      contiguous_arena arena(host, 4096, {.alignment = bad});
      FAIL() << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_TRUE(std::string(e.what()).starts_with("contiguous_arena: alignment")) << e.what();
    }
  }
  contiguous_arena pages(host, 8192, {.alignment = 4096});  // the largest alignment taken
  EXPECT_EQ(pages.allocate(1).offset, 0U);
  EXPECT_EQ(pages.allocate(1).offset, 4096U);
  EXPECT_EQ(pages.print_allocation(2), "||");
  EXPECT_STREQ(pages.print_allocation(0).c_str(), "");  // no cell, nothing written past the end
}

// defragment(bytes) keeps its contract at the edges: a hole of the free bytes exactly (after
// rounding to the alignment) is made; one byte more, or a size whose rounding overflows, is
// refused with nothing moved.
TEST(contiguous_arena, defragment_makes_a_hole_of_at_most_the_free_bytes_and_refuses_more) {
  memory::host_resource host;
  for (const defrag_policy policy : {defrag_policy::minimal_move, defrag_policy::full_compaction}) {
    SCOPED_TRACE(static_cast<int>(policy));
    contiguous_arena arena(host, 4096, {.alignment = 256, .policy = policy});
    std::vector<tensor_block> t;
    for (int i = 0; i < 8; ++i) {
      t.push_back(arena.allocate(500));  // 512 each
      fill(t.back());
    }
    arena.release(t[1]);
    arena.release(t[4]);
    arena.release(t[6]);  // 1536 free, in holes of 512
    const std::vector<tensor_block> before = arena.blocks();
    for (const std::uint64_t too_many : {std::uint64_t{1537}, std::uint64_t{2048}, ~std::uint64_t{0}}) {
      EXPECT_FALSE(arena.defragment(too_many)) << too_many;
      EXPECT_EQ(arena.stats().defragmentations, 0U);
      EXPECT_EQ(arena.stats().moves, 0U);
      EXPECT_EQ(arena.stats().largest_free_bytes, 512U);
      ASSERT_EQ(arena.blocks().size(), before.size());
      for (std::size_t i = 0; i < before.size(); ++i) EXPECT_EQ(arena.blocks()[i].offset, before[i].offset);
    }
    ASSERT_TRUE(arena.defragment(1281));  // rounds up to 1536, every free byte
    EXPECT_EQ(arena.stats().defragmentations, 1U);
    EXPECT_EQ(arena.stats().largest_free_bytes, 1536U);
    for (const std::size_t i : {0U, 2U, 3U, 5U, 7U}) EXPECT_TRUE(intact(arena.block(t[i].id))) << i;
    const tensor_block big = arena.allocate(1536);  // no further defragmentation needed
    EXPECT_EQ(arena.stats().defragmentations, 1U);
    fill(big);
    EXPECT_FALSE(arena.defragment(1));  // nothing free
  }
}

TEST(contiguous_arena, zero_byte_tensors_and_capacity_exactly_used) {
  memory::host_resource host;
  contiguous_arena arena(host, 1024, {.alignment = 256});
  const tensor_block z1 = arena.allocate(0);
  const tensor_block z2 = arena.allocate(0);
  EXPECT_NE(z1.id, z2.id);
  std::vector<tensor_block> t;
  for (int i = 0; i < 4; ++i) t.push_back(arena.allocate(256));
  EXPECT_EQ(arena.stats().free_bytes, 0U);
  EXPECT_EQ(arena.stats().live_tensors, 6U);
  EXPECT_THROW(arena.allocate(1), arena_out_of_memory);
  const tensor_block z3 = arena.allocate(0);  // still fine when full
  arena.release(z1);
  arena.release(z3);
  arena.release(t[1]);
  EXPECT_EQ(arena.allocate(256).offset, t[1].offset);
  arena.release(z2);
  EXPECT_EQ(arena.max_allocated(), 1024U);
}

TEST(contiguous_arena, released_tensors_lose_their_observers) {
  memory::host_resource host;
  contiguous_arena arena(host, 768, {.alignment = 256});
  const tensor_block a = arena.allocate(256);
  const tensor_block b = arena.allocate(256);
  const tensor_block c = arena.allocate(256);
  int calls = 0;
  arena.bind(c.id, [&calls](const tensor_block&) { ++calls; });
  arena.release(c);
  arena.release(a);
  const tensor_block d = arena.allocate(256);  // fits a's hole: no move
  EXPECT_EQ(calls, 0);
  (void)b;
  (void)d;
}

// Long randomized sequences with many forced defragmentations, both policies, checked by
// content and by observers after every step. TENSORMEM_SEED overrides the seed.
void random_run(defrag_policy policy, memory::memory_resource& resource, std::uint64_t alignment) {
  const char* env = std::getenv("TENSORMEM_SEED");
  const std::uint64_t seed = env != nullptr ? std::strtoull(env, nullptr, 10) : 20261122;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  contiguous_arena arena(resource, 1 << 20, {.alignment = alignment, .policy = policy});
  std::map<std::uint64_t, std::byte*> told;  // what observers last reported
  std::vector<std::uint64_t> live;
  std::uint64_t refused = 0;
  for (int step = 0; step < 3000; ++step) {
    ASSERT_EQ(told.size() <= live.size(), true);
    if (live.empty() || rng() % 100 < 52) {
      const std::uint64_t bytes = rng() % 8 == 0 ? 0 : 1 + rng() % 60000;
      try {
        const tensor_block b = arena.allocate(bytes);
        fill(b);
        // Only some tensors are observed (DeepSpeed binds parameters only): the others
        // must not stop the notification of those that are.
        if (rng() % 2 == 0) {
          told[b.id] = b.data();
          arena.bind(b.id, [&told](const tensor_block& moved) { told[moved.id] = moved.data(); });
        }
        live.push_back(b.id);
      } catch (const arena_out_of_memory&) {
        ++refused;
        ASSERT_LT(arena.stats().free_bytes, core::align_up(bytes, alignment).value());
      }
    } else {
      const std::size_t i = rng() % live.size();
      arena.release(live[i]);
      told.erase(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
    for (const std::uint64_t id : live) {
      const tensor_block b = arena.block(id);
      ASSERT_TRUE(intact(b)) << "step " << step << " tensor " << id;
      if (b.bytes != 0 && told.contains(id)) {
        ASSERT_EQ(told.at(id), b.data()) << "step " << step;
      }
    }
  }
  EXPECT_GT(arena.stats().defragmentations, 20U);
  EXPECT_GT(refused, 0U);
}

TEST(contiguous_arena, random_sequences_minimal_move) {
  memory::host_resource host;
  random_run(defrag_policy::minimal_move, host, 256);
}
TEST(contiguous_arena, random_sequences_full_compaction) {
  memory::host_resource host;
  random_run(defrag_policy::full_compaction, host, 256);
}
TEST(contiguous_arena, random_sequences_byte_exact_on_pinned_memory) {
  memory::pinned_host_resource pinned;
  random_run(defrag_policy::minimal_move, pinned, 1);
}

TEST(compaction, minimal_move_never_moves_more_than_full_compaction) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<core::placed_block> blocks;
    std::uint64_t cursor = 0;
    for (std::uint64_t id = 0; id < 30; ++id) {
      cursor += rng() % 3 == 0 ? rng() % 100 : 0;
      const std::uint64_t bytes = 1 + rng() % 100;
      blocks.push_back({cursor, bytes, id});
      cursor += bytes;
    }
    const std::uint64_t capacity = cursor + rng() % 50;
    std::uint64_t free_total = capacity;
    for (const auto& b : blocks) free_total -= b.bytes;
    if (free_total == 0) continue;
    const std::uint64_t need = 1 + rng() % free_total;
    EXPECT_FALSE(core::plan_minimal_move(blocks, capacity, free_total + 1).has_value());
    const auto minimal = core::plan_minimal_move(blocks, capacity, need);
    ASSERT_TRUE(minimal.has_value());
    std::uint64_t minimal_bytes = 0;
    for (const auto& m : *minimal) minimal_bytes += m.bytes;
    std::uint64_t full_bytes = 0;
    for (const auto& m : core::plan_full_compaction(blocks)) full_bytes += m.bytes;
    EXPECT_LE(minimal_bytes, full_bytes);
    // Apply and check that a hole of `need` bytes opened and nothing overlaps.
    std::map<std::uint64_t, std::uint64_t> layout;
    for (const auto& b : blocks) layout[b.id] = b.offset;
    for (const auto& m : *minimal) layout[m.id] = m.to;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
    for (const auto& b : blocks) ranges.emplace_back(layout[b.id], layout[b.id] + b.bytes);
    std::sort(ranges.begin(), ranges.end());
    std::uint64_t largest = 0;
    std::uint64_t end = 0;
    for (const auto& [from, to] : ranges) {
      ASSERT_GE(from, end) << "overlap after the moves";
      largest = std::max(largest, from - end);
      end = to;
    }
    largest = std::max(largest, capacity - end);
    EXPECT_GE(largest, need);
  }
  EXPECT_FALSE(core::plan_minimal_move(std::vector<core::placed_block>{{0, 10, 1}}, 12, 3));
}

}  // namespace
}  // namespace tensormem::arena

namespace tensormem::arena {
namespace {

TEST(move_down, matches_memmove_for_overlapping_and_distant_moves) {
  std::mt19937_64 rng(3);
  std::vector<std::byte> buffer(std::size_t{3} << 20);
  for (int trial = 0; trial < 40; ++trial) {
    for (std::byte& b : buffer) b = static_cast<std::byte>(rng());
    std::vector<std::byte> expected = buffer;
    const std::size_t bytes = (std::size_t{256} << 10) + rng() % (std::size_t{1} << 20);
    const std::size_t src = 1 + rng() % (buffer.size() - bytes - 1);
    const std::size_t dst = rng() % src;  // below the source, overlapping or not
    std::memmove(expected.data() + dst, expected.data() + src, bytes);
    detail::move_down(buffer.data() + dst, buffer.data() + src, bytes);
    ASSERT_EQ(std::memcmp(buffer.data(), expected.data(), buffer.size()), 0)
        << "dst " << dst << " src " << src << " bytes " << bytes;
  }
}

TEST(contiguous_arena, large_tensors_survive_defragmentation) {
  memory::host_resource host;
  contiguous_arena arena(host, std::uint64_t{8} << 20, {.alignment = 1});
  std::vector<tensor_block> t;
  for (int i = 0; i < 8; ++i) {
    t.push_back(arena.allocate((std::uint64_t{1} << 20) - 3 - static_cast<std::uint64_t>(i)));
    fill(t.back());
  }
  arena.release(t[0]);
  arena.release(t[2]);
  arena.release(t[4]);
  const tensor_block big = arena.allocate(std::uint64_t{3} << 20);
  fill(big);
  EXPECT_GE(arena.stats().defragmentations, 1U);
  for (const std::size_t i : {1U, 3U, 5U, 6U, 7U}) EXPECT_TRUE(intact(arena.block(t[i].id))) << i;
  EXPECT_TRUE(intact(arena.block(big.id)));
}

}  // namespace
}  // namespace tensormem::arena

namespace tensormem::arena {
namespace {

TEST(contiguous_arena, another_arenas_id_is_refused_and_changes_nothing) {
  memory::host_resource host;
  contiguous_arena a(host, 1 << 16);
  contiguous_arena b(host, 1 << 16);
  const tensor_block mine = a.allocate(1000);
  const tensor_block theirs = b.allocate(1000);
  ASSERT_NE(mine.id, theirs.id);
  try {
    a.release(theirs.id);
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to another arena"), std::string::npos) << e.what();
  }
  EXPECT_THROW(a.bind(theirs.id, [](const tensor_block&) {}), std::invalid_argument);
  EXPECT_THROW((void)a.block(theirs.id), std::invalid_argument);
  EXPECT_TRUE(a.contains(mine.id));
  EXPECT_EQ(a.stats().used_bytes, 1024U);
  EXPECT_TRUE(b.contains(theirs.id));
  a.release(mine);
  b.release(theirs);
}

TEST(contiguous_arena, a_number_no_arena_handed_out_is_refused_as_such) {
  memory::host_resource host;
  contiguous_arena a(host, 1 << 16);
  const tensor_block mine = a.allocate(1000);
  for (const std::uint64_t id : {std::uint64_t{0}, std::uint64_t{99}, (std::uint64_t{1} << 40) - 1U}) {
    try {
      a.release(id);
      FAIL() << "no exception for " << id;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("which no arena handed out"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(a.contains(mine.id));
  EXPECT_EQ(a.stats().used_bytes, 1024U);
  a.release(mine);
  EXPECT_EQ(a.stats().used_bytes, 0U);
}

// Among windows that move equally few bytes, the lowest is taken (the documented tie rule),
// so the same arena always moves the same tensors.
TEST(compaction, minimal_move_takes_the_lowest_of_equally_cheap_windows) {
  // Gaps of 50 at 0, 100 and 200; two blocks of 50. A hole of 100 opens by moving either.
  const std::vector<core::placed_block> blocks = {{50, 50, 1}, {150, 50, 2}};
  const auto moves = core::plan_minimal_move(blocks, 250, 100);
  ASSERT_TRUE(moves.has_value());
  ASSERT_EQ(moves->size(), 1U);
  EXPECT_EQ((*moves)[0].id, 1U);
  EXPECT_EQ((*moves)[0].from, 50U);
  EXPECT_EQ((*moves)[0].to, 0U);
}

// Brute force over every window [L, R) whose ends are gap edges: the blocks inside slide
// down to L; the window opens (R - L) - their bytes, and costs the bytes of those that move.
std::optional<std::uint64_t> cheapest_window(const std::vector<core::placed_block>& blocks,
                                             std::uint64_t capacity, std::uint64_t need) {
  std::vector<std::uint64_t> lefts = {0};
  std::vector<std::uint64_t> rights = {capacity};
  for (const auto& b : blocks) {
    lefts.push_back(b.offset + b.bytes);
    rights.push_back(b.offset);
  }
  std::optional<std::uint64_t> best;
  for (const std::uint64_t left : lefts) {
    for (const std::uint64_t right : rights) {
      if (right <= left) continue;
      std::uint64_t inside = 0;
      std::uint64_t moved = 0;
      std::uint64_t cursor = left;
      bool straddles = false;
      for (const auto& b : blocks) {
        const bool in = b.offset >= left && b.offset + b.bytes <= right;
        if (!in && b.offset < right && b.offset + b.bytes > left) straddles = true;
        if (!in) continue;
        inside += b.bytes;
        if (b.offset != cursor) moved += b.bytes;
        cursor += b.bytes;
      }
      if (straddles || right - left - inside < need) continue;
      if (!best || moved < *best) best = moved;
    }
  }
  return best;
}

TEST(compaction, minimal_move_picks_the_cheapest_window) {
  std::mt19937_64 rng(6);
  int checked = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<core::placed_block> blocks;
    std::uint64_t cursor = 0;
    const std::uint64_t n = 1 + rng() % 12;
    for (std::uint64_t id = 0; id < n; ++id) {
      cursor += rng() % 2 == 0 ? rng() % 40 : 0;
      const std::uint64_t bytes = 1 + rng() % 60;
      blocks.push_back({cursor, bytes, id});
      cursor += bytes;
    }
    const std::uint64_t capacity = cursor + rng() % 30;
    std::uint64_t free_total = capacity;
    for (const auto& b : blocks) free_total -= b.bytes;
    const std::uint64_t need = 1 + rng() % (free_total + 2);
    const auto plan = core::plan_minimal_move(blocks, capacity, need);
    const auto oracle = cheapest_window(blocks, capacity, need);
    ASSERT_EQ(plan.has_value(), oracle.has_value()) << "trial " << trial;
    if (!plan) continue;
    std::uint64_t moved = 0;
    for (const auto& m : *plan) moved += m.bytes;
    ASSERT_EQ(moved, *oracle) << "trial " << trial << ": a feasible window, not the cheapest";
    ++checked;
  }
  EXPECT_GT(checked, 1500);
}

}  // namespace
}  // namespace tensormem::arena

#include "tensormem/memory/detail/poison.hpp"

namespace tensormem::arena {
namespace {

#ifdef TENSORMEM_ASAN
TEST(contiguous_arena, free_and_moved_ranges_are_poisoned_for_address_sanitizer) {
  memory::host_resource host;
  contiguous_arena arena(host, 4096, {.alignment = 256});
  const tensor_block a = arena.allocate(1000);
  const tensor_block b = arena.allocate(1000);
  EXPECT_EQ(__asan_address_is_poisoned(a.data()), 0);
  EXPECT_EQ(__asan_address_is_poisoned(a.data() + 999), 0);
  EXPECT_NE(__asan_address_is_poisoned(a.data() + 1000), 0);  // alignment padding
  EXPECT_NE(__asan_address_is_poisoned(arena.base() + 3000), 0);  // never handed out
  arena.release(a);
  EXPECT_NE(__asan_address_is_poisoned(a.data()), 0);
  std::byte* stale = b.data();
  ASSERT_TRUE(arena.defragment(3072));  // b moves down to offset 0
  EXPECT_EQ(arena.block(b.id).offset, 0U);
  EXPECT_EQ(__asan_address_is_poisoned(arena.base()), 0);
  EXPECT_NE(__asan_address_is_poisoned(stale), 0);
  EXPECT_DEATH({ stale[10] = std::byte{1}; }, "use-after-poison");
}
#endif

}  // namespace
}  // namespace tensormem::arena
