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
/// Algorithm. Sizes are counted in units of `alignment`. Unit counts below `exact_units`
/// (2^16: 16 MiB at the default alignment of 256, 64 KiB at 1) have a free list each, and a
/// three-level bitmap (64-bit words, 1,024 + 16 + 1) says which are non-empty. Larger unit
/// counts have size classes with `mantissa_bits` bits of mantissa (a class per 1/16 of a
/// power of two), one list each, and a 64-bit top bitmap and one bitmap per power of two.
/// Lists are doubly linked. A class list is newest first; a block joining an exact list goes
/// first if its offset is below the first block's, else second. To allocate u units:
///  1. Below exact_units: find the smallest non-empty exact list of at least u units (at
///     most three find-first-set operations) and take its first block: the size exact best
///     fit would take. If none, take from the first non-empty class (every block there fits)
///     as in step 3.
///  2. Otherwise look in u's own class (rounded down): among its first `scan_limit` blocks,
///     take the smallest that fits (lowest offset among equals). Any fit there beats every
///     block of a higher class.
///  3. Otherwise round the class up, find the first non-empty list at or above it with two
///     find-first-set operations (every block there fits), and take the smallest of its
///     first `scan_limit` blocks.
///  4. Otherwise take a free block that ends at the high-water mark if it is large enough,
///     or grow the arena at its end, extending such a block, exactly as best_fit_allocator
///     does.
/// The remainder of a split block goes back to its list. Block metadata lives in a node pool
/// outside the managed range; nodes link to their address neighbours, so freeing merges with
/// both sides in O(1). An allocation handle carries its node index, so `deallocate` never
/// searches; `free(offset, bytes)` finds the node through a hash map of live offsets, built
/// by its first call (one walk of the blocks) and kept from then on, so that callers who
/// only use handles never pay for it.
///
/// Complexity: O(1) per operation (at most 2 * scan_limit list steps, amortized O(1) for
/// metadata growth). Memory: the exact lists' heads and bitmap, 4 bytes and 1 bit per unit
/// count below exact_units, capped by the capacity in units (264 KiB in growing mode), plus
/// the node pool: 32 bytes a block, one cache line holding two nodes. A handle's generation
/// is unique to its allocation (a counter of allocations, 32 bits).
/// Waste bound: no internal waste beyond rounding to `alignment` (blocks are split exactly).
/// Below exact_units the size taken is exact best fit's (among equal sizes, the first listed,
/// where best fit takes the lowest offset of all). Above it, the
/// policy differs from exact best fit in two ways, which bound the fragmentation it can
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
  static constexpr unsigned mantissa_bits = 4;
  static constexpr unsigned scan_limit = 8;
  /// Unit counts below this have a list each (exact sizes).
  static constexpr std::uint32_t exact_units = 1U << 16;

  explicit tlsf_allocator(std::uint64_t capacity = growing, std::uint64_t alignment = 256);

  std::optional<allocation> allocate(std::uint64_t bytes);

  /// Makes room for `blocks` blocks, live and free together (as OffsetAllocator's
  /// `maxAllocs`, but a hint: the pool still grows past it), and makes their nodes, so that
  /// the pool's pages are touched here. While no more blocks than that exist, `allocate`,
  /// `deallocate` and `try_deallocate` allocate no memory and touch no new page, so none of
  /// them pays for growing the pool, which otherwise doubles (a copy of every node) inside
  /// some `allocate`, nor for a page fault on a new node. A stream with at most L
  /// allocations live at once has at most 2L + 1 blocks; an arena of fixed capacity C at
  /// most ceil(C / alignment), and no more are made (blocks_to_reserve). `free(offset,
  /// bytes)` keeps an index of its own that this does not cover. Never shrinks. Throws
  /// std::length_error for 2^32 - 18 blocks or more and std::bad_alloc where the allocation
  /// is refused, changing nothing observable either way. The nodes' memory
  /// (reserve_bytes_per_block each) is touched here, so under Linux's overcommit a count past
  /// the process's memory ends the process through the out-of-memory killer rather than
  /// throwing: check a count that comes from outside first, as the Python module does
  /// (memory::memory_shortfall_for).
  void reserve(std::size_t blocks) { reserve_blocks(blocks); }
  /// Memory a reserved block takes: its node and its place in the stack of unused nodes.
  static constexpr std::size_t reserve_bytes_per_block = sizeof(detail::tlsf_node) + sizeof(std::uint32_t);
  // deallocate, try_deallocate, free, try_free, capacity, alignment, peak, used and
  // for_each_block (TLSF's walk_pool) come from detail::block_chain_allocator.
  allocator_stats stats() const;
  std::string check_invariants() const;

  /// The size class of an aligned byte count, rounded down (where a free block of that size
  /// is listed, if it holds exact_units units or more) and up (the first class whose every
  /// block holds that many bytes).
  unsigned size_class_floor(std::uint64_t bytes) const noexcept { return floor_class(bytes); }
  unsigned size_class_ceil(std::uint64_t bytes) const noexcept { return ceil_class(bytes); }

 private:
  friend class detail::block_chain_allocator<tlsf_allocator, detail::tlsf_node>;
  static constexpr unsigned leaf_bins = 1U << mantissa_bits;
  static constexpr unsigned bin_count = (65U - mantissa_bits) * leaf_bins;
  using node = detail::tlsf_node;

  static constexpr std::uint32_t exact_words = exact_units / 64;
  std::uint32_t exact_at_or_above(std::uint64_t units) const noexcept;
  void drop_empty_word(std::uint32_t units) noexcept;
  std::uint32_t pop_exact(std::uint32_t units) noexcept;
  void push_front(std::uint32_t& head, std::uint32_t n) noexcept;
  bool unlink(std::uint32_t& head, std::uint32_t n) noexcept;
  void bin_insert(std::uint32_t n, std::uint64_t bytes) noexcept;  // n holds `bytes`
  void bin_remove(std::uint32_t n) noexcept;
  std::uint32_t first_bin_at_or_above(unsigned cls) const noexcept;
  std::uint32_t best_in_bin(unsigned cls, std::uint64_t need) noexcept;
  void split(std::uint32_t n, std::uint64_t need, std::uint64_t rest) noexcept;
  void release(std::uint32_t n) noexcept;
  static unsigned class_of_units(std::uint64_t units) noexcept;
  unsigned floor_class(std::uint64_t bytes) const noexcept;
  unsigned ceil_class(std::uint64_t bytes) const noexcept;

  unsigned unit_shift_ = 0;
  std::uint64_t top_bitmap_ = 0;
  std::array<std::uint64_t, 64> leaf_bitmaps_{};
  std::array<std::uint32_t, bin_count> bin_heads_{};
  // Per class: list length, and an upper bound on the largest of its first scan_limit
  // blocks (exact after each scan), so that a class that holds no fit is not scanned.
  std::array<std::uint32_t, bin_count> bin_length_{};
  std::array<std::uint64_t, bin_count> window_max_{};
  // Exact lists (unit counts below exact_limit_): heads by unit count, and a bitmap of the
  // non-empty ones in three levels (a bit per list, per non-zero word, per non-zero mid word).
  std::uint32_t exact_limit_ = 0;  // exact_units, or fewer where the capacity holds fewer units
  std::vector<std::uint32_t> exact_heads_;
  std::vector<std::uint64_t> exact_bits_;
  std::array<std::uint64_t, exact_words / 64> exact_mid_{};
  std::uint64_t exact_top_ = 0;
};

}  // namespace tensormem::core
