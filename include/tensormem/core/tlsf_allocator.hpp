#pragma once
// O(1) online offset allocator of the TLSF / "small float bins" family, on 64-bit offsets.

#include <array>
#include <bit>
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
/// Algorithm. Sizes are counted in units of `alignment`. Free blocks sit in segregated lists,
/// one per size class: every unit count below 2^(mantissa_bits + 1) = 512 is a class of its
/// own (exact sizes), and above that each power of two is cut into 2^mantissa_bits = 256
/// classes (a class spans 1/256 of its power of two, 0.39 %). 14,592 classes cover every
/// 64-bit size; a three-level bitmap (64-bit words, 228 + 4 + 1) says which lists are
/// non-empty. Lists are doubly linked, and a block joining a list goes first if its offset is
/// below the first block's, else second. To allocate u units:
///  1. If u is not the smallest size of its class (rounded down), and that class's first
///     block holds u units, take it.
///  2. Otherwise find the first non-empty list at or above u's class rounded up (at most three
///     find-first-set operations), and take its first block: every block there fits.
///  3. Otherwise take a free block that ends at the high-water mark if it is large enough,
///     or grow the arena at its end, extending such a block, exactly as best_fit_allocator
///     does.
/// No list is searched. The remainder of a split block goes back to its list. Block metadata
/// lives in a node pool outside the managed range; nodes link to their address neighbours, so
/// freeing merges with both sides in O(1). An allocation handle carries its node index, so
/// `deallocate` never searches; `free(offset, bytes)` finds the node through a hash map of
/// live offsets, built by its first call (one walk of the blocks) and kept from then on, so
/// that callers who only use handles never pay for it.
///
/// Complexity: O(1) per operation (amortized O(1) for metadata growth). Memory: 57 KiB of list
/// heads and 1.8 KiB of bitmap (fewer heads where the capacity holds fewer units), plus the node
/// pool: 32 bytes a block, one cache line holding two nodes. A handle's generation is unique to
/// its allocation (a counter of allocations, 32 bits).
/// Waste bound: no internal waste beyond rounding to `alignment` (blocks are split exactly).
/// When the smallest free block that fits holds fewer than 512 units, a block of that size is
/// taken, as in exact best fit. Above, the policy differs from exact best fit in two ways, which bound the
/// fragmentation it can add: a free block of the request's own class that is not the first of
/// its list is skipped, so a request of r bytes may grow the arena while a hole of fewer than
/// r * (1 + 2^-mantissa_bits) bytes is free; and the block taken may be up to 2^-mantissa_bits
/// (0.39 %) larger than the best fit of its class. On the nine public traces this policy
/// reaches exact best fit's high-water marks (docs/BENCHMARKS.md).
/// Exception safety: `allocate` either succeeds or changes nothing (node and map capacity is
/// reserved before any list changes); deallocation never allocates. A handle made by another
/// allocator is refused (`free_status::foreign_handle`), changing nothing.
/// Not thread-safe: synchronize externally.
class tlsf_allocator;

namespace detail {
/// 32 bytes, aligned to 32, so that no node spans two cache lines. The state lives in the
/// list links: a free node holds the links of its free list (`none` at either end); a used
/// node holds `used_mark` and its generation; an unused node, `unused_mark`.
struct alignas(32) tlsf_node : chain_links {
  static constexpr std::uint32_t used_mark = 0xfffffffdU;
  static constexpr std::uint32_t unused_mark = 0xfffffffcU;
  std::uint32_t prev_bin = unused_mark;
  std::uint32_t next_bin = none;

  block_state state() const noexcept {
    return prev_bin == used_mark ? block_state::used
                                 : prev_bin == unused_mark ? block_state::unused : block_state::free;
  }
  std::uint32_t generation() const noexcept { return next_bin; }
  void mark_used(std::uint32_t generation) noexcept {
    prev_bin = used_mark;
    next_bin = generation;
  }
  void mark_unused() noexcept { prev_bin = unused_mark; }
};
static_assert(sizeof(tlsf_node) == 32);
}  // namespace detail

class tlsf_allocator : public detail::block_chain_allocator<tlsf_allocator, detail::tlsf_node> {
 public:
  static constexpr unsigned mantissa_bits = 8;
  /// Unit counts below this are size classes of their own (exact sizes).
  static constexpr std::uint32_t exact_units = 2U << mantissa_bits;
  /// Size classes: all of 64-bit sizes.
  static constexpr std::uint32_t class_count = (65U - mantissa_bits) << mantissa_bits;

  explicit tlsf_allocator(std::uint64_t capacity = growing, std::uint64_t alignment = 256);

  std::optional<allocation> allocate(std::uint64_t bytes);

  /// Makes room for `blocks` blocks, live and free together (as OffsetAllocator's
  /// `maxAllocs`, but a hint: the pool still grows past it), and makes their nodes, so that
  /// the pool's pages are touched here. While no more blocks than that exist, `allocate`,
  /// `deallocate` and `try_deallocate` allocate no memory and touch no new page, so none of
  /// them pays for growing the pool, which otherwise doubles (a copy of every node) inside
  /// some `allocate`, nor for a page fault on a new node. A stream with at most L
  /// allocations live at once has at most 2L + 1 blocks. `free(offset, bytes)` keeps an
  /// index of its own that this does not cover. Never shrinks. Throws std::length_error for
  /// 2^32 - 18 blocks or more and std::bad_alloc without the memory, changing nothing
  /// observable either way.
  void reserve(std::size_t blocks) { reserve_blocks(blocks); }
  // deallocate, try_deallocate, free, try_free, capacity, alignment, peak, used and
  // for_each_block (TLSF's walk_pool) come from detail::block_chain_allocator.
  allocator_stats stats() const;
  std::string check_invariants() const;

  /// The size class of an aligned byte count, rounded down (the list where a free block of
  /// that size waits) and up (the first class whose every block holds that many bytes).
  unsigned size_class_floor(std::uint64_t bytes) const noexcept { return class_of_units(bytes >> unit_shift_); }
  unsigned size_class_ceil(std::uint64_t bytes) const noexcept;

 private:
  friend class detail::block_chain_allocator<tlsf_allocator, detail::tlsf_node>;
  using node = detail::tlsf_node;

  static constexpr std::uint32_t class_words = class_count / 64;
  static constexpr std::uint32_t mid_words = (class_words + 63U) / 64U;
  // Class of a unit count, rounded down: the count itself below exact_units; above, 2^M
  // classes for each power of two past 2^M, plus the count's top M + 1 bits.
  static unsigned class_of_units(std::uint64_t units) noexcept {
    const auto width = static_cast<unsigned>(std::bit_width(units));
    const unsigned shift = width > mantissa_bits + 1U ? width - mantissa_bits - 1U : 0U;
    return (shift << mantissa_bits) + static_cast<unsigned>(units >> shift);
  }
  std::uint32_t list_at_or_above(std::uint32_t cls) const noexcept;
  void drop_empty_word(std::uint32_t cls) noexcept;
  std::uint32_t pop_head(std::uint32_t cls) noexcept;
  bool unlink(std::uint32_t& head, std::uint32_t n) noexcept;
  void list_insert(std::uint32_t n, std::uint64_t bytes) noexcept;  // n holds `bytes`
  void list_remove(std::uint32_t n) noexcept;
  void split(std::uint32_t n, std::uint64_t need, std::uint64_t rest) noexcept;
  void release(std::uint32_t n) noexcept;

  unsigned unit_shift_ = 0;
  // Lists by size class: heads (classes below class_limit_ only), and a bitmap of the
  // non-empty ones in three levels (a bit per list, per non-zero word, per non-zero mid word).
  std::uint32_t class_limit_ = 0;  // class_count, or fewer where the capacity holds fewer units
  std::vector<std::uint32_t> heads_;
  std::array<std::uint64_t, class_words> bits_{};
  std::array<std::uint64_t, mid_words> mid_{};
  std::uint64_t top_ = 0;
};

}  // namespace tensormem::core
