#pragma once
// A baseline for the online allocator benchmarks: the algorithm of Sebastian Aaltonen's
// OffsetAllocator, written here from its published description (not its code).
//
// Sizes and offsets are 32-bit counts of `alignment` units. A size maps to one of 256 bins
// by a "small float" with a 3-bit mantissa and a 5-bit exponent (sizes below 8 are exact).
// Free blocks sit in one doubly linked list per bin; a 32-bit top bitmap (one bit per 8 bins)
// and 32 8-bit leaf bitmaps say which lists are non-empty. Allocation rounds the size's bin
// up, finds the first non-empty bin at or above it with two find-first-set operations and
// takes that list's head: no search inside a bin. The remainder of the block goes back to
// the bin of its size rounded down. Blocks link to their address neighbours, so a free
// merges with both sides in O(1). The arena is fixed (2^32 - 1 units); the high-water mark
// is the largest end handed out, so it compares with the growing allocators.
//
// Compiled as a library would compile it: `allocate` and `deallocate` are calls (never
// inlined into the benchmark loop, as the library's are not), the list helpers are always
// inlined into them (as the library's helpers are). Left to GCC's heuristics, the helpers
// stayed out of line and cost the baseline a few calls per operation. Bytes become units by
// a shift (the alignment is a power of two), not a division, which alone cost the baseline
// 2-4 % on W1 (docs/BENCHMARKS.md, "The baseline without a division").
//
// Its handle is OffsetAllocator's: 8 bytes, the offset in units and the node index, returned
// in registers (an optional of it is 12 bytes). It used to return `core::allocation` (32
// bytes, returned through memory), which made it 3-7 % slower on the small traces, the same
// on W1 (docs/BENCHMARKS.md, "The baseline's own handle"). Like OffsetAllocator, it takes
// its nodes from a pool made once (128 Ki nodes unless told otherwise; an allocation that
// would need a node more fails), and the timed form keeps no high-water mark (OffsetAllocator
// keeps none); `offset_allocator_baseline_with_peak` is the same allocator with one, run
// untimed for the benchmarks' high-water marks and in the tests. Together these made the
// baseline 6-7 % faster on W1 and about 8 % on the traces, as fast as OffsetAllocator's own
// code (docs/BENCHMARKS.md, "A pool made once and no high-water mark").

#include <algorithm>
#include <bit>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>

namespace tensormem::bench {

/// The OffsetAllocator algorithm; with KeepPeak, it also keeps the highest end handed out.
template <bool KeepPeak>
class offset_allocator_algorithm {
 public:
  /// OffsetAllocator's allocation: where (in units of the alignment) and which node.
  struct handle {
    std::uint32_t offset;
    std::uint32_t node;
  };

  /// `max_nodes` bounds the blocks, free and live, at once (OffsetAllocator's maxAllocs; at
  /// least 1, for the free arena).
  offset_allocator_algorithm(std::uint64_t /*capacity*/, std::uint64_t alignment, std::uint32_t max_nodes = 128 * 1024)
      : shift_(static_cast<unsigned>(std::countr_zero(alignment))),
        nodes_(std::make_unique<node[]>(std::max(max_nodes, 1U))),
        spare_(std::make_unique<std::uint32_t[]>(std::max(max_nodes, 1U))),
        spare_count_(std::max(max_nodes, 1U)) {
    std::fill(std::begin(head_), std::end(head_), none);
    for (std::uint32_t i = 0; i < spare_count_; ++i) spare_[i] = spare_count_ - 1 - i;  // node 0 first
    insert(total_units, 0, none, none);
  }

  [[gnu::noinline]] std::optional<handle> allocate(std::uint64_t bytes) {
    const std::uint64_t units64 = (bytes + (std::uint64_t{1} << shift_) - 1) >> shift_;
    // (No node left for a remainder: fail, as OffsetAllocator does.)
    if (units64 == 0 || units64 > total_units || spare_count_ == 0) return std::nullopt;
    const auto units = static_cast<std::uint32_t>(units64);
    const std::uint32_t min_bin = round_up(units);
    std::uint32_t top = min_bin >> 3;
    std::uint32_t leaf = none;
    if (used_top_ & (1U << top)) leaf = lowest_at_or_after(used_leaf_[top], min_bin & 7);
    if (leaf == none) {
      top = lowest_at_or_after(used_top_, top + 1);
      if (top == none) return std::nullopt;
      leaf = static_cast<std::uint32_t>(std::countr_zero(static_cast<unsigned>(used_leaf_[top])));
    }
    const std::uint32_t n = head_[(top << 3) | leaf];
    remove_from_bin(n);
    node& b = nodes_[n];
    const std::uint32_t rest = b.size - units;
    b.size = units;
    b.used = true;
    if (rest != 0) {
      const std::uint32_t r = insert(rest, b.offset + units, n, b.next_addr);
      if (nodes_[n].next_addr != none) nodes_[nodes_[n].next_addr].prev_addr = r;
      nodes_[n].next_addr = r;
    }
    if constexpr (KeepPeak) {
      const std::uint64_t end = (static_cast<std::uint64_t>(nodes_[n].offset) + units) << shift_;
      if (end > peak_) peak_ = end;
    }
    return handle{nodes_[n].offset, n};
  }

  [[gnu::noinline]] void deallocate(handle a) {
    const std::uint32_t n = a.node;
    std::uint32_t offset = nodes_[n].offset;
    std::uint32_t size = nodes_[n].size;
    std::uint32_t prev = nodes_[n].prev_addr;
    std::uint32_t next = nodes_[n].next_addr;
    if (prev != none && !nodes_[prev].used) {  // merge with the block below
      remove_from_bin(prev);
      offset = nodes_[prev].offset;
      size += nodes_[prev].size;
      const std::uint32_t below = nodes_[prev].prev_addr;
      spare_[spare_count_++] = prev;
      prev = below;
    }
    if (next != none && !nodes_[next].used) {  // and with the block above
      remove_from_bin(next);
      size += nodes_[next].size;
      const std::uint32_t above = nodes_[next].next_addr;
      spare_[spare_count_++] = next;
      next = above;
    }
    spare_[spare_count_++] = n;
    const std::uint32_t m = insert(size, offset, prev, next);
    if (prev != none) nodes_[prev].next_addr = m;
    if (next != none) nodes_[next].prev_addr = m;
  }

  std::uint64_t peak() const
    requires KeepPeak
  {
    return peak_;
  }
  /// A live handle's offset and size in bytes (for tests).
  std::uint64_t offset_of(handle a) const { return std::uint64_t{a.offset} << shift_; }
  std::uint64_t bytes_of(handle a) const { return std::uint64_t{nodes_[a.node].size} << shift_; }

 private:
  static constexpr std::uint32_t none = 0xffffffffU;
  static constexpr std::uint32_t total_units = 0xffffffffU;

  struct node {
    std::uint32_t offset;
    std::uint32_t size;
    std::uint32_t prev_bin, next_bin;
    std::uint32_t prev_addr, next_addr;
    bool used;
  };

  // The small-float bin of a size, rounded down (where a free block of that size is listed)
  // or up (the first bin whose every block holds the size).
  static std::uint32_t round_down(std::uint32_t size) {
    if (size < 8) return size;
    const auto high = static_cast<std::uint32_t>(31 - std::countl_zero(size));
    const std::uint32_t shift = high - 3;
    return ((shift + 1) << 3) + ((size >> shift) & 7);
  }
  static std::uint32_t round_up(std::uint32_t size) {
    if (size < 8) return size;
    const auto high = static_cast<std::uint32_t>(31 - std::countl_zero(size));
    const std::uint32_t shift = high - 3;
    std::uint32_t bin = ((shift + 1) << 3) + ((size >> shift) & 7);
    if ((size & ((1U << shift) - 1)) != 0) ++bin;  // a carry moves to the next exponent
    return bin;
  }
  static std::uint32_t lowest_at_or_after(std::uint32_t bits, std::uint32_t from) {
    if (from >= 32) return none;
    const std::uint32_t masked = bits & ~((1U << from) - 1);
    return masked == 0 ? none : static_cast<std::uint32_t>(std::countr_zero(masked));
  }

  [[gnu::always_inline]] std::uint32_t insert(std::uint32_t size, std::uint32_t offset, std::uint32_t prev_addr, std::uint32_t next_addr) {
    const std::uint32_t n = spare_[--spare_count_];  // allocate checked that one is left
    const std::uint32_t bin = round_down(size);
    const std::uint32_t old_head = head_[bin];
    nodes_[n] = {offset, size, none, old_head, prev_addr, next_addr, false};
    if (old_head != none) nodes_[old_head].prev_bin = n;
    head_[bin] = n;
    used_leaf_[bin >> 3] = static_cast<std::uint8_t>(used_leaf_[bin >> 3] | (1U << (bin & 7)));
    used_top_ |= 1U << (bin >> 3);
    return n;
  }

  [[gnu::always_inline]] void remove_from_bin(std::uint32_t n) {
    node& b = nodes_[n];
    if (b.prev_bin != none) {
      nodes_[b.prev_bin].next_bin = b.next_bin;
    } else {
      const std::uint32_t bin = round_down(b.size);
      head_[bin] = b.next_bin;
      if (b.next_bin == none) {
        used_leaf_[bin >> 3] = static_cast<std::uint8_t>(used_leaf_[bin >> 3] & ~(1U << (bin & 7)));
        if (used_leaf_[bin >> 3] == 0) used_top_ &= ~(1U << (bin >> 3));
      }
    }
    if (b.next_bin != none) nodes_[b.next_bin].prev_bin = b.prev_bin;
  }

  unsigned shift_;  // log2 of the alignment
  std::uint64_t peak_ = 0;
  std::uint32_t used_top_ = 0;
  std::uint8_t used_leaf_[32] = {};
  std::uint32_t head_[256];
  std::unique_ptr<node[]> nodes_;
  std::unique_ptr<std::uint32_t[]> spare_;  // unused nodes, a stack of spare_count_
  std::uint32_t spare_count_;
};

/// The timed baseline, and the same allocator keeping its high-water mark.
using offset_allocator_baseline = offset_allocator_algorithm<false>;
using offset_allocator_baseline_with_peak = offset_allocator_algorithm<true>;

}  // namespace tensormem::bench
