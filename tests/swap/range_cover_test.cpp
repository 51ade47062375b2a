// The coverage steps behind the swapper's memory checks, against a count per byte.

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "tensormem/swap/detail/range_cover.hpp"

namespace tensormem::swap::detail {
namespace {

TEST(range_cover, touching_ranges_do_not_overlap_and_empty_ranges_never_do) {
  range_cover c;
  c.add(100, 200);
  EXPECT_FALSE(c.overlaps(200, 300));
  EXPECT_FALSE(c.overlaps(0, 100));
  EXPECT_TRUE(c.overlaps(199, 200));
  EXPECT_TRUE(c.overlaps(0, 101));
  EXPECT_TRUE(c.overlaps(0, 1000));
  EXPECT_TRUE(c.overlaps(150, 151));
  EXPECT_FALSE(c.overlaps(150, 150));
  c.add(5, 5);
  EXPECT_FALSE(c.overlaps(0, 100));
  c.remove(100, 200);
  EXPECT_TRUE(c.empty());
  EXPECT_FALSE(c.overlaps(0, ~std::uintptr_t{0}));
}

// Random adds and removes of ranges in 64 bytes; after every step each query of every
// range agrees with a count per byte, the set is empty exactly when no byte is covered, and
// it keeps a key only where the count changes.
TEST(range_cover, agrees_with_a_count_per_byte_after_every_step) {
  constexpr std::uintptr_t span = 64;
  std::mt19937_64 rng(20261127);
  for (int round = 0; round < 200; ++round) {
    range_cover c;
    std::array<int, span> count{};
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> live;
    for (int step = 0; step < 60; ++step) {
      if (live.empty() || rng() % 3 != 0) {
        const std::uintptr_t a = rng() % span;
        const std::uintptr_t b = a + 1 + rng() % (span - a);
        c.add(a, b);
        live.emplace_back(a, b);
        for (auto x = a; x < b; ++x) ++count[x];
      } else {
        const std::size_t k = rng() % live.size();
        const auto [a, b] = live[k];
        live[k] = live.back();
        live.pop_back();
        c.remove(a, b);
        for (auto x = a; x < b; ++x) --count[x];
      }
      bool any = false;
      for (std::uintptr_t a = 0; a < span; ++a) {
        bool covered = false;
        for (std::uintptr_t b = a + 1; b <= span; ++b) {
          covered = covered || count[b - 1] > 0;
          ASSERT_EQ(c.overlaps(a, b), covered) << "round " << round << " step " << step << " [" << a << ", " << b << ")";
        }
        any = any || count[a] > 0;
      }
      ASSERT_EQ(c.empty(), !any);
      std::size_t changes = count[0] != 0 ? 1U : 0U;
      for (std::uintptr_t x = 1; x < span; ++x) changes += count[x] != count[x - 1] ? 1U : 0U;
      changes += count[span - 1] != 0 ? 1U : 0U;
      ASSERT_EQ(c.keys(), changes) << "round " << round << " step " << step;
    }
  }
}

}  // namespace
}  // namespace tensormem::swap::detail
