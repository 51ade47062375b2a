#pragma once
// O(1) online offset allocator of the TLSF / "small float bins" family, on 64-bit offsets.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tensormem/core/allocation.hpp"
#include "tensormem/core/detail/offset_map.hpp"

namespace tensormem::core {

/// Good-fit allocator with constant-time operations (Masmano et al., "TLSF: a new dynamic
/// memory allocator for real-time systems", 2004; offsets and out-of-band metadata as in
/// S. Aaltonen's OffsetAllocator). Same interface and growing/fixed modes as
/// best_fit_allocator.
///
/// Algorithm. Sizes are counted in units of `alignment`. A unit count u has a size class
/// with `mantissa_bits` bits of mantissa: counts below 2^mantissa_bits have a class each,
/// larger ones share a class per 1/16 of a power of two. Free blocks live in one doubly
/// linked list per class; a 64-bit top bitmap and one bitmap per power of two say which
/// lists are non-empty. To allocate u units:
///  1. Look in u's own class (rounded down): among its first `scan_limit` blocks, take the
///     smallest that fits (lowest offset among equals). Any fit there beats every block of
///     a higher class.
///  2. Otherwise round the class up, find the first non-empty list at or above it with two
///     find-first-set operations (every block there fits), and take the smallest of its
///     first `scan_limit` blocks.
///  3. Otherwise grow the arena at its end, extending a free block that ends at the
///     high-water mark, exactly as best_fit_allocator does.
/// The remainder of a split block goes back to its list. Block metadata lives in a node pool
/// outside the managed range; nodes link to their address neighbours, so freeing merges with
/// both sides in O(1). An allocation handle carries its node index, so `deallocate` never
/// searches; `free(offset, bytes)` finds the node through a hash map of live offsets, built
/// by its first call (one walk of the blocks) and kept from then on, so that callers who
/// only use handles never pay for it.
///
/// Complexity: O(1) per operation (at most 2 * scan_limit list steps, amortized O(1) for
/// metadata growth).
/// Waste bound: no internal waste beyond rounding to `alignment` (blocks are split exactly).
/// The policy differs from exact best fit in two ways, which bound the fragmentation it can
/// add: a free block whose size lies within the request's own class but beyond the first
/// `scan_limit` entries of that list is skipped, so a request of r bytes may grow the arena
/// while a hole of fewer than r * (1 + 2^-mantissa_bits) bytes is free; and inside a class
/// the chosen block may be up to 2^-mantissa_bits (6.25 %) larger than the best fit.
/// Exception safety: `allocate` either succeeds or changes nothing (node and map capacity is
/// reserved before any list changes); deallocation never allocates. A handle made by another
/// allocator is refused (`free_status::foreign_handle`), changing nothing.
/// Not thread-safe: synchronize externally.
class tlsf_allocator {
 public:
  static constexpr unsigned mantissa_bits = 4;
  static constexpr unsigned scan_limit = 8;

  explicit tlsf_allocator(std::uint64_t capacity = growing, std::uint64_t alignment = 256);

  std::optional<allocation> allocate(std::uint64_t bytes);
  void deallocate(const allocation& a);
  free_status try_deallocate(const allocation& a) noexcept;
  void free(std::uint64_t offset, std::uint64_t bytes);
  free_status try_free(std::uint64_t offset, std::uint64_t bytes) noexcept;

  std::uint64_t capacity() const noexcept { return capacity_; }
  std::uint64_t alignment() const noexcept { return alignment_; }
  std::uint64_t peak() const noexcept { return peak_; }
  std::uint64_t used() const noexcept { return used_; }
  allocator_stats stats() const;
  std::string check_invariants() const;

  /// Calls `f(offset, bytes, is_free)` for every block below the high-water mark, in
  /// address order (TLSF's walk_pool). For tests and pictures; O(n).
  template <class F>
  void for_each_block(F&& f) const {
    for (std::uint32_t n = head_; n != none; n = nodes_[n].next_phys) {
      f(nodes_[n].offset, nodes_[n].bytes, nodes_[n].st == state::free);
    }
  }

  /// The size class of an aligned byte count, rounded down (where a free block of that size
  /// is listed) and up (the first class whose every block holds that many bytes).
  unsigned size_class_floor(std::uint64_t bytes) const noexcept { return floor_class(bytes); }
  unsigned size_class_ceil(std::uint64_t bytes) const noexcept { return ceil_class(bytes); }

 private:
  static constexpr std::uint32_t none = 0xffffffffU;
  static constexpr unsigned leaf_bins = 1U << mantissa_bits;
  static constexpr unsigned bin_count = (65U - mantissa_bits) * leaf_bins;

  enum class state : std::uint8_t { unused, free, used };
  struct node {
    std::uint64_t offset = 0;
    std::uint64_t bytes = 0;
    std::uint32_t prev_phys = none;
    std::uint32_t next_phys = none;
    std::uint32_t prev_bin = none;
    std::uint32_t next_bin = none;
    std::uint32_t generation = 0;
    state st = state::unused;
  };

  std::uint32_t new_node();
  void release_node(std::uint32_t n) noexcept;
  void bin_insert(std::uint32_t n) noexcept;
  void bin_remove(std::uint32_t n) noexcept;
  std::uint32_t first_bin_at_or_above(unsigned cls) const noexcept;
  std::uint32_t best_in_bin(unsigned cls, std::uint64_t need) noexcept;
  void release(std::uint32_t n) noexcept;
  free_status check_handle(std::uint32_t n, std::uint64_t offset,
                           std::uint64_t bytes) const noexcept;
  unsigned floor_class(std::uint64_t bytes) const noexcept;
  unsigned ceil_class(std::uint64_t bytes) const noexcept;

  std::uint64_t capacity_;
  std::uint64_t alignment_;
  unsigned unit_shift_;
  std::uint64_t owner_;
  std::uint64_t peak_ = 0;
  std::uint64_t used_ = 0;
  std::uint64_t free_block_count_ = 0;
  std::uint32_t head_ = none;  // node at offset 0
  std::uint32_t tail_ = none;  // node that ends at peak_
  std::uint64_t top_bitmap_ = 0;
  std::array<std::uint64_t, 64> leaf_bitmaps_{};
  std::array<std::uint32_t, bin_count> bin_heads_{};
  // Per class: list length, and an upper bound on the largest of its first scan_limit
  // blocks (exact after each scan), so that a class that holds no fit is not scanned.
  std::array<std::uint32_t, bin_count> bin_length_{};
  std::array<std::uint64_t, bin_count> window_max_{};
  std::vector<node> nodes_;
  std::vector<std::uint32_t> unused_nodes_;
  void build_index();
  std::uint32_t find_live(std::uint64_t offset) const noexcept;

  detail::offset_map live_;  // offset -> node of each live allocation, once indexed_
  bool indexed_ = false;     // set by the first free(offset, bytes)
  std::uint64_t live_count_ = 0;
};

}  // namespace tensormem::core
