#pragma once
// A baseline for the online allocator benchmarks: the data structures of InfiniTensor's
// LazyAllocator, written here from its published description (not its code), with the
// policy best_fit_allocator reproduces.
//
// Free blocks sit in one balanced tree ordered by (size, offset) — a request takes the first
// block of at least its size, the rest of the block stays free — and in two hash maps, from
// the start and from the end offset of each free block to its size, through which a freed
// range merges with the free blocks right before and right after it. When no block fits, a
// free block that ends at the high-water mark is extended, else the arena grows. The caller
// gives the size back at free time (no table of live allocations, no misuse checks).

#include <cstdint>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>

#include "tensormem/core/allocation.hpp"

namespace tensormem::bench {

class lazy_allocator_baseline {
 public:
  lazy_allocator_baseline(std::uint64_t /*capacity*/, std::uint64_t alignment) : alignment_(alignment) {}

  std::optional<core::allocation> allocate(std::uint64_t bytes) {
    const std::uint64_t need = (bytes + alignment_ - 1) / alignment_ * alignment_;
    std::uint64_t offset = peak_;
    if (auto it = by_size_.lower_bound({need, 0}); it != by_size_.end()) {
      const auto [block_bytes, block_offset] = *it;
      by_size_.erase(it);
      by_start_.erase(block_offset);
      by_end_.erase(block_offset + block_bytes);
      if (block_bytes > need) add_free(block_offset + need, block_bytes - need);
      offset = block_offset;
    } else if (auto tail = by_end_.find(peak_); tail != by_end_.end()) {
      const std::uint64_t tail_bytes = tail->second;
      offset = peak_ - tail_bytes;
      by_end_.erase(tail);
      by_start_.erase(offset);
      by_size_.erase({tail_bytes, offset});
      peak_ += need - tail_bytes;
    } else {
      peak_ += need;
    }
    return core::allocation{offset, need, 0, 0, 0};
  }

  void deallocate(const core::allocation& a) {
    std::uint64_t start = a.offset;
    std::uint64_t length = a.bytes;
    if (auto before = by_end_.find(start); before != by_end_.end()) {
      const std::uint64_t before_bytes = before->second;
      by_end_.erase(before);
      start -= before_bytes;
      by_start_.erase(start);
      by_size_.erase({before_bytes, start});
      length += before_bytes;
    }
    if (auto after = by_start_.find(a.offset + a.bytes); after != by_start_.end()) {
      const std::uint64_t after_bytes = after->second;
      by_start_.erase(after);
      by_end_.erase(a.offset + a.bytes + after_bytes);
      by_size_.erase({after_bytes, a.offset + a.bytes});
      length += after_bytes;
    }
    add_free(start, length);
  }

  std::uint64_t peak() const { return peak_; }

 private:
  void add_free(std::uint64_t offset, std::uint64_t bytes) {
    by_size_.insert({bytes, offset});
    by_start_.emplace(offset, bytes);
    by_end_.emplace(offset + bytes, bytes);
  }

  std::uint64_t alignment_;
  std::uint64_t peak_ = 0;
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_size_;  // (bytes, offset)
  std::unordered_map<std::uint64_t, std::uint64_t> by_start_;   // start offset -> bytes
  std::unordered_map<std::uint64_t, std::uint64_t> by_end_;     // end offset -> bytes
};

}  // namespace tensormem::bench
