#pragma once
// O(1) online offset allocator of the TLSF / "small float bins" family, on 64-bit offsets.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tensormem/core/allocation.hpp"
#include "tensormem/core/detail/block_chain.hpp"

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
class tlsf_allocator;

namespace detail {
struct tlsf_node : chain_block {
  std::uint32_t prev_bin = none;  // the free list of its size class
  std::uint32_t next_bin = none;
};
}  // namespace detail

class tlsf_allocator : public detail::block_chain_allocator<tlsf_allocator, detail::tlsf_node> {
 public:
  static constexpr unsigned mantissa_bits = 4;
  static constexpr unsigned scan_limit = 8;

  explicit tlsf_allocator(std::uint64_t capacity = growing, std::uint64_t alignment = 256);

  std::optional<allocation> allocate(std::uint64_t bytes);
  // deallocate, try_deallocate, free, try_free, capacity, alignment, peak, used and
  // for_each_block (TLSF's walk_pool) come from detail::block_chain_allocator.
  allocator_stats stats() const;
  std::string check_invariants() const;

  /// The size class of an aligned byte count, rounded down (where a free block of that size
  /// is listed) and up (the first class whose every block holds that many bytes).
  unsigned size_class_floor(std::uint64_t bytes) const noexcept { return floor_class(bytes); }
  unsigned size_class_ceil(std::uint64_t bytes) const noexcept { return ceil_class(bytes); }

 private:
  friend class detail::block_chain_allocator<tlsf_allocator, detail::tlsf_node>;
  static constexpr unsigned leaf_bins = 1U << mantissa_bits;
  static constexpr unsigned bin_count = (65U - mantissa_bits) * leaf_bins;
  using node = detail::tlsf_node;

  void bin_insert(std::uint32_t n) noexcept;
  void bin_remove(std::uint32_t n) noexcept;
  std::uint32_t first_bin_at_or_above(unsigned cls) const noexcept;
  std::uint32_t best_in_bin(unsigned cls, std::uint64_t need) noexcept;
  void release(std::uint32_t n) noexcept;
  unsigned floor_class(std::uint64_t bytes) const noexcept;
  unsigned ceil_class(std::uint64_t bytes) const noexcept;

  unsigned unit_shift_ = 0;
  std::uint64_t free_block_count_ = 0;
  std::uint64_t top_bitmap_ = 0;
  std::array<std::uint64_t, 64> leaf_bitmaps_{};
  std::array<std::uint32_t, bin_count> bin_heads_{};
  // Per class: list length, and an upper bound on the largest of its first scan_limit
  // blocks (exact after each scan), so that a class that holds no fit is not scanned.
  std::array<std::uint32_t, bin_count> bin_length_{};
  std::array<std::uint64_t, bin_count> window_max_{};
};

}  // namespace tensormem::core
