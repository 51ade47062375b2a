#pragma once
// Open-addressing hash map from a 64-bit offset to a 32-bit index (linear probing,
// backward-shift deletion, no tombstones). Private to the allocators. The largest 64-bit
// value marks empty slots; it is never a key (no allocation of one byte or more starts
// there). A probe tests for an empty slot before it compares keys, so that looking that
// value up finds nothing, and erasing it does nothing.

#include <bit>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

namespace tensormem::core::detail {

class offset_map {
 public:
  static constexpr std::uint64_t empty_key = std::numeric_limits<std::uint64_t>::max();
  static constexpr std::uint32_t not_found = std::numeric_limits<std::uint32_t>::max();
  /// The most keys `reserve` takes (a table of 2^63 slots at most: the doubling stays
  /// within 64 bits).
  static constexpr std::size_t most_keys = std::size_t{1} << 62;

  offset_map() { rehash(16); }

  std::uint32_t find(std::uint64_t key) const noexcept {
    for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == empty_key) return not_found;
      if (keys_[i] == key) return values_[i];
    }
  }

  /// Makes room for `count` keys, so that inserting up to that many does not allocate.
  /// Throws std::length_error for a count no table of 2^63 slots holds, std::bad_alloc
  /// without the memory; changes nothing either way.
  void reserve(std::size_t count) {
    if (count > most_keys) throw std::length_error("offset_map: too many keys");
    std::size_t capacity = keys_.size();
    while (count * 2 > capacity) capacity *= 2;
    if (capacity != keys_.size()) rehash(capacity);
  }

  /// Precondition: `key` is absent and is not `empty_key`.
  void insert(std::uint64_t key, std::uint32_t value) {
    if ((size_ + 1) * 2 > keys_.size()) rehash(keys_.size() * 2);
    std::size_t i = slot(key);
    while (keys_[i] != empty_key) i = (i + 1) & mask_;
    keys_[i] = key;
    values_[i] = value;
    ++size_;
  }

  /// Removes `key` if present.
  void erase(std::uint64_t key) noexcept {
    std::size_t i = slot(key);
    for (;; i = (i + 1) & mask_) {
      if (keys_[i] == empty_key) return;
      if (keys_[i] == key) break;
    }
    // Backward-shift: move later members of the probe run into the hole.
    std::size_t hole = i;
    for (std::size_t j = (hole + 1) & mask_; keys_[j] != empty_key; j = (j + 1) & mask_) {
      const std::size_t home = slot(keys_[j]);
      if (((j - home) & mask_) >= ((j - hole) & mask_)) {
        keys_[hole] = keys_[j];
        values_[hole] = values_[j];
        hole = j;
      }
    }
    keys_[hole] = empty_key;
    --size_;
  }

  std::size_t size() const noexcept { return size_; }
  /// The table's length: a power of two, at least twice size() (the load stays at most
  /// one half, so that a probe run ends soon and an empty slot is always there).
  std::size_t slots() const noexcept { return keys_.size(); }
  void clear() { *this = offset_map(); }

 private:
  std::size_t slot(std::uint64_t key) const noexcept {
    return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ULL) >> shift_);
  }

  // Strong guarantee: both new arrays are allocated before anything changes.
  void rehash(std::size_t capacity) {
    std::vector<std::uint64_t> new_keys(capacity, empty_key);
    std::vector<std::uint32_t> new_values(capacity, 0);
    std::vector<std::uint64_t> old_keys = std::exchange(keys_, std::move(new_keys));
    std::vector<std::uint32_t> old_values = std::exchange(values_, std::move(new_values));
    mask_ = capacity - 1;
    shift_ = 64U - static_cast<unsigned>(std::countr_zero(capacity));
    size_ = 0;
    for (std::size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] != empty_key) insert(old_keys[i], old_values[i]);
    }
  }

  std::vector<std::uint64_t> keys_;
  std::vector<std::uint32_t> values_;
  std::size_t mask_ = 0;
  unsigned shift_ = 60;
  std::size_t size_ = 0;
};

}  // namespace tensormem::core::detail
