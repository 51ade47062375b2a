// The allocators' private offset -> node hash map, against std::unordered_map: random
// inserts, erases and lookups over a small key set (so that probe runs collide, wrap
// around the table's end and are shifted back on erase), every key checked after every
// step.

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "tensormem/core/detail/offset_map.hpp"

namespace {

using tensormem::core::detail::offset_map;

void expect_same(const offset_map& m, const std::unordered_map<std::uint64_t, std::uint32_t>& ref,
                 const std::vector<std::uint64_t>& keys) {
  ASSERT_EQ(m.size(), ref.size());
  ASSERT_LE(m.size() * 2, m.slots());
  ASSERT_TRUE(std::has_single_bit(m.slots()));
  for (const std::uint64_t k : keys) {
    const auto it = ref.find(k);
    ASSERT_EQ(m.find(k), it == ref.end() ? offset_map::not_found : it->second) << "key " << k;
  }
  ASSERT_EQ(m.find(offset_map::empty_key), offset_map::not_found);
}

TEST(offset_map, equals_an_unordered_map_under_random_inserts_and_erases) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 40; ++round) {
    // Key sets from a handful (every slot of the first table) to past several rehashes;
    // offsets as the allocators make them: multiples of an alignment, from 0.
    const std::size_t distinct = std::size_t{4} << (round % 8);
    const std::uint64_t alignment = std::uint64_t{1} << (rng() % 13);
    std::vector<std::uint64_t> keys(distinct);
    for (std::size_t i = 0; i < distinct; ++i) keys[i] = (round % 3 == 0 ? i : rng() % (distinct * 4)) * alignment;
    if (round % 5 == 0) keys.back() = offset_map::empty_key - 1;  // the largest key
    offset_map m;
    std::unordered_map<std::uint64_t, std::uint32_t> ref;
    if (round % 2 == 1) m.reserve(distinct / 2);
    for (int step = 0; step < 1500; ++step) {
      const std::uint64_t k = keys[rng() % keys.size()];
      const auto value = static_cast<std::uint32_t>(rng() % offset_map::not_found);
      if (rng() % 3 != 0 && ref.find(k) == ref.end()) {
        m.insert(k, value);
        ref.emplace(k, value);
      } else {
        m.erase(k);  // present or not
        ref.erase(k);
      }
      expect_same(m, ref, keys);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(offset_map, erasing_the_empty_marker_or_an_absent_key_changes_nothing) {
  offset_map m;
  for (std::uint32_t i = 0; i < 12; ++i) m.insert(std::uint64_t{i} * 4096, i);
  m.erase(offset_map::empty_key);
  m.erase(12 * 4096);
  ASSERT_EQ(m.size(), 12U);
  for (std::uint32_t i = 0; i < 12; ++i) EXPECT_EQ(m.find(std::uint64_t{i} * 4096), i);
  EXPECT_EQ(m.find(offset_map::empty_key), offset_map::not_found);
}

TEST(offset_map, clear_empties_the_map) {
  offset_map m;
  for (std::uint32_t i = 0; i < 100; ++i) m.insert(i, i);
  m.clear();
  EXPECT_EQ(m.size(), 0U);
  for (std::uint32_t i = 0; i < 100; ++i) EXPECT_EQ(m.find(i), offset_map::not_found);
  m.insert(5, 50);
  EXPECT_EQ(m.find(5), 50U);
  EXPECT_EQ(m.size(), 1U);
}

TEST(offset_map, inserting_what_was_reserved_keeps_the_table) {
  for (std::size_t count = 0; count <= 300; ++count) {
    offset_map m;
    m.reserve(count);
    const std::size_t slots = m.slots();
    EXPECT_GE(slots, count * 2);
    for (std::size_t i = 0; i < count; ++i) m.insert(std::uint64_t{i} * 64, static_cast<std::uint32_t>(i));
    ASSERT_EQ(m.slots(), slots) << count << " keys reserved";
    m.reserve(count);  // within what is there: no change
    ASSERT_EQ(m.slots(), slots);
  }
}

TEST(offset_map, a_reservation_no_table_can_hold_is_refused) {
  offset_map m;
  m.insert(1, 1);
  // Doubling the table for these counts would pass 2^64 slots (and wrap to 0).
  for (const std::size_t count : {std::size_t{1} << 62, (std::size_t{1} << 63) + 1, ~std::size_t{0}}) {
    EXPECT_THROW(m.reserve(count), std::length_error) << count;
  }
  EXPECT_EQ(m.size(), 1U);
  EXPECT_EQ(m.find(1), 1U);
}

}  // namespace
