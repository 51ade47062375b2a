#pragma once
// Exact best-fit online offset allocator: the reference policy of tensormem.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensormem/core/allocation.hpp"

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
/// Complexity: O(log n) per operation in the number n of free blocks and live allocations.
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
  using size_index = std::set<std::pair<std::uint64_t, std::uint64_t>>;  // (bytes, offset)
  using offset_index = std::map<std::uint64_t, std::uint64_t>;           // offset -> bytes
  using live_index = std::unordered_map<std::uint64_t, std::uint64_t>;   // offset -> bytes

  /// Makes sure `count` free-list nodes exist beyond those in use; may throw, changes no
  /// observable state.
  void reserve_nodes(std::size_t count);
  live_index::node_type make_live_node();
  void insert_free(std::uint64_t offset, std::uint64_t bytes) noexcept;
  void erase_free(std::uint64_t offset, std::uint64_t bytes) noexcept;

  std::uint64_t capacity_;
  std::uint64_t alignment_;
  std::uint64_t owner_;
  std::uint64_t peak_ = 0;
  std::uint64_t used_ = 0;
  size_index free_by_size_;
  offset_index free_by_offset_;
  live_index live_;
  // Nodes not in the free lists, kept so that no free-list change allocates.
  std::vector<size_index::node_type> spare_by_size_;
  std::vector<offset_index::node_type> spare_by_offset_;
};

}  // namespace tensormem::core
