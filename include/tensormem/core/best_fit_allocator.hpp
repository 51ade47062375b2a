#pragma once
// Exact best-fit online offset allocator: the reference policy of tensormem.

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tensormem/core/allocation.hpp"
#include "tensormem/core/detail/offset_map.hpp"

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
class best_fit_allocator {
 public:
  explicit best_fit_allocator(std::uint64_t capacity = growing, std::uint64_t alignment = 256);

  /// Empty optional when the request does not fit (fixed capacity) or overflows 64 bits.
  std::optional<allocation> allocate(std::uint64_t bytes);

  /// Takes exactly [offset, offset + bytes) (rounded up to the alignment; offset must be
  /// aligned): it must lie in a free block or at or past the high-water mark (the gap up to
  /// it becomes free). Empty optional, nothing changed, when any of it is taken or past the
  /// capacity. Used to rebuild an allocator around blocks that already sit somewhere.
  std::optional<allocation> allocate_at(std::uint64_t offset, std::uint64_t bytes);

  void deallocate(const allocation& a);
  free_status try_deallocate(const allocation& a) noexcept;
  /// InfiniTensor-style free: `bytes` is the size asked for at allocation (rounded here).
  void free(std::uint64_t offset, std::uint64_t bytes);
  free_status try_free(std::uint64_t offset, std::uint64_t bytes) noexcept;

  std::uint64_t capacity() const noexcept { return capacity_; }
  std::uint64_t alignment() const noexcept { return alignment_; }
  std::uint64_t peak() const noexcept { return peak_; }
  std::uint64_t used() const noexcept { return used_; }
  allocator_stats stats() const;

  /// Empty string when every internal invariant holds, else a description of the first
  /// violation. O(n log n); meant for tests and debugging.
  std::string check_invariants() const;

 private:
  static constexpr std::uint32_t none = 0xffffffffU;
  enum class state : std::uint8_t { unused, free, used };
  // One block of the arena below the high-water mark, linked to its address neighbours.
  struct block {
    std::uint64_t offset = 0;
    std::uint64_t bytes = 0;
    std::uint32_t prev = none;
    std::uint32_t next = none;
    std::uint32_t generation = 0;
    state st = state::unused;
  };
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

  /// Room for `blocks` new blocks, two spare index nodes, spare + indexed >= live + 2, and
  /// one more live-index entry: after it, an allocation and any later free change state
  /// without allocating. May throw; changes nothing observable.
  void reserve_for_allocation(std::size_t blocks);
  std::uint32_t new_block() noexcept;
  void release_block(std::uint32_t n) noexcept;
  void index_free(std::uint32_t n) noexcept;
  void unindex_free(std::uint32_t n) noexcept;
  void link_after(std::uint32_t n, std::uint32_t r) noexcept;
  void link_before(std::uint32_t n, std::uint32_t l) noexcept;
  void release(std::uint32_t n) noexcept;
  allocation make_used(std::uint32_t n, std::uint64_t need) noexcept;
  free_status check_handle(const allocation& a) const noexcept;
  void build_index();
  std::uint32_t find_live(std::uint64_t offset) const noexcept;
  std::uint32_t block_at_or_before(std::uint64_t offset) const noexcept;

  std::uint64_t capacity_;
  std::uint64_t alignment_;
  std::uint64_t owner_;
  std::uint64_t peak_ = 0;
  std::uint64_t used_ = 0;
  std::uint64_t live_count_ = 0;
  std::uint32_t head_ = none;  // block at offset 0
  std::uint32_t tail_ = none;  // block that ends at peak_
  std::vector<block> blocks_;
  std::vector<std::uint32_t> unused_blocks_;
  size_index free_by_size_;
  // Index nodes not in use, kept so that no free-list change allocates.
  std::vector<size_index::node_type> spare_nodes_;
  detail::offset_map live_;  // offset -> block of each live allocation, once indexed_
  bool indexed_ = false;     // set by the first free(offset, bytes)
};

}  // namespace tensormem::core
