#pragma once
// Exact best-fit online offset allocator: the reference policy of tensormem.

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tensormem/core/allocation.hpp"
#include "tensormem/core/detail/block_chain.hpp"

namespace tensormem::core {

/// Online allocator of byte ranges inside `[0, capacity)`, with the policy of InfiniTensor's
/// LazyAllocator, exactly:
///  1. A request of `bytes` is rounded up to `alignment` (a power of two, default 256).
///  2. Among the free blocks below the high-water mark, take the smallest that fits; among
///     blocks of equal size, the one at the lowest offset. The rest of the block stays free.
///  3. If none fits, the arena grows at its end: a free block that ends at the high-water
///     mark is extended (its start is returned), otherwise the request starts at the mark.
///     With a fixed capacity, growing past it fails (empty optional); in growing mode
///     (`capacity == growing`) the high-water mark `peak()` is the arena size.
///  4. A freed block merges at once with free neighbours on both sides.
/// Complexity: O(log n) per operation in the number n of free blocks (one ordered index of
/// free blocks by size, then offset); merging follows address-neighbour links in O(1), and
/// a handle names its block, so `deallocate` searches nothing. `free(offset, bytes)` finds
/// the block through a hash index of live offsets built by its first call (one walk of the
/// blocks) and kept from then on: callers who only use handles never pay for it.
/// `allocate_at` walks the blocks back from the end of the arena: O(1) when blocks are
/// rebuilt in increasing offset order, O(blocks past the offset) in general.
/// It never touches the managed bytes. Not thread-safe: synchronize externally.
///
/// A zero-byte request succeeds with `{offset 0, bytes 0}` and changes nothing; freeing that
/// handle is a no-op. Misuse (unknown offset, double free, wrong size, a handle of another
/// allocator) is reported by the `try_*` functions as a `free_status` and by the others as
/// `allocator_misuse`; either way the allocator is left unchanged.
///
/// Exception safety: `allocate` and `allocate_at` either succeed or change nothing (they
/// reserve every node they may need before touching the free lists; std::bad_alloc is the
/// only exception). Freeing never allocates: the free lists keep at least one node per live
/// allocation plus one in reserve, and merging reuses the nodes of the merged blocks.
class best_fit_allocator : public detail::block_chain_allocator<best_fit_allocator, detail::chain_block> {
 public:
  explicit best_fit_allocator(std::uint64_t capacity = growing, std::uint64_t alignment = 256);

  /// Empty optional when the request does not fit (fixed capacity) or overflows 64 bits.
  std::optional<allocation> allocate(std::uint64_t bytes);

  /// Takes exactly [offset, offset + bytes) (rounded up to the alignment; offset must be
  /// aligned): it must lie in a free block or at or past the high-water mark (the gap up to
  /// it becomes free). Empty optional, nothing changed, when any of it is taken or past the
  /// capacity. Used to rebuild an allocator around blocks that already sit somewhere.
  std::optional<allocation> allocate_at(std::uint64_t offset, std::uint64_t bytes);

  /// Makes room for `blocks` blocks, live and free together: nodes and index nodes, made
  /// here. While no more blocks than that exist, `allocate`, `deallocate` and
  /// `try_deallocate` allocate no memory. A stream with at most L allocations live at once
  /// has at most 2L + 1 blocks; an arena of fixed capacity C at most ceil(C / alignment),
  /// and no more are made (blocks_to_reserve). `free(offset, bytes)` keeps an index of its
  /// own that this does not cover. Never shrinks. Throws std::length_error for 2^32 - 18
  /// blocks or more and std::bad_alloc where the allocation is refused, changing nothing
  /// observable either way. The blocks' memory (reserve_bytes_per_block each) is touched
  /// here, so under Linux's overcommit a count past the process's memory ends the process
  /// through the out-of-memory killer rather than throwing: check a count that comes from
  /// outside first, as the Python module does (memory::memory_shortfall_for).
  void reserve(std::size_t blocks);

  // deallocate, try_deallocate, free (InfiniTensor style: `bytes` as asked at allocation,
  // rounded here), try_free, capacity, alignment, peak, used and for_each_block come from
  // detail::block_chain_allocator.
  allocator_stats stats() const;

  /// Empty string when every internal invariant holds, else a description of the first
  /// violation. O(n log n); meant for tests and debugging.
  std::string check_invariants() const;

 private:
  friend class detail::block_chain_allocator<best_fit_allocator, detail::chain_block>;

  struct free_key {
    std::uint64_t bytes;
    std::uint64_t offset;
    std::uint32_t node;
  };
  struct by_size_then_offset {
    bool operator()(const free_key& a, const free_key& b) const noexcept {
      return a.bytes != b.bytes ? a.bytes < b.bytes : a.offset < b.offset;
    }
  };
  using size_index = std::set<free_key, by_size_then_offset>;

 public:
  /// Memory a reserved block takes, about: its node, its place in the stack of unused
  /// nodes, and an index node (a tree node of the set, as malloc hands it out, 64 bytes,
  /// and its handle while spare). 108 measured with glibc's malloc. `reserve` makes them all,
  /// touching their pages.
  static constexpr std::size_t reserve_bytes_per_block =
      sizeof(detail::chain_block) + sizeof(std::uint32_t) + sizeof(size_index::node_type) + 64;

 private:

  /// Room for `blocks` new blocks, two spare index nodes, spare + indexed >= live + 2, and
  /// one more live-index entry: after it, an allocation and any later free change state
  /// without allocating. May throw; changes nothing observable.
  void reserve_for_allocation(std::size_t blocks);
  void add_spare_index_node();  // one more spare index node (may throw)
  void index_free(std::uint32_t n) noexcept;
  void unindex_free(std::uint32_t n) noexcept;
  void release(std::uint32_t n) noexcept;

  size_index free_by_size_;
  // Index nodes not in use, kept so that no free-list change allocates.
  std::vector<size_index::node_type> spare_nodes_;
};

}  // namespace tensormem::core
