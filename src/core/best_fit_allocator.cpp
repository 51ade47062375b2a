#include "tensormem/core/best_fit_allocator.hpp"

#include <algorithm>
#include <limits>
#include <vector>

#include "tensormem/core/align.hpp"

namespace tensormem::core {

namespace {
constexpr std::uint32_t zero_node = 0xffffffffU;
constexpr const char* name = "best_fit_allocator";
}  // namespace

best_fit_allocator::best_fit_allocator(std::uint64_t capacity, std::uint64_t alignment)
    : capacity_(capacity), alignment_(alignment), owner_(next_owner_id()) {
  check_alignment_argument(name, alignment);
}

// Keeps free blocks + spare nodes >= live allocations + `count`, and at least one spare.
// Free blocks never outnumber live allocations + 1 (free neighbours merge), so a free that
// follows always finds a node when it needs one.
void best_fit_allocator::reserve_nodes(std::size_t count) {
  while (spare_by_size_.empty() ||
         spare_by_size_.size() + free_by_size_.size() < live_.size() + count) {
    // Room for every node grows geometrically: growing it by one node per call copied the
    // whole vector on every allocation (quadratic in the live allocations).
    const std::size_t total = spare_by_size_.size() + free_by_size_.size() + 1;
    if (spare_by_size_.capacity() < total) spare_by_size_.reserve(std::max(total, 2 * spare_by_size_.capacity()));
    if (spare_by_offset_.capacity() < total) spare_by_offset_.reserve(std::max(total, 2 * spare_by_offset_.capacity()));
    // Nodes are made by inserting a key no real block has, then extracting it.
    constexpr auto max = std::numeric_limits<std::uint64_t>::max();
    auto size_node = free_by_size_.extract(free_by_size_.emplace(max, max).first);
    auto offset_node = free_by_offset_.extract(free_by_offset_.emplace(max, max).first);
    spare_by_size_.push_back(std::move(size_node));
    spare_by_offset_.push_back(std::move(offset_node));
  }
}

// A node for one more live allocation, with room in the table for it: inserting it later
// neither allocates nor rehashes. No live allocation starts at 2^64 - 1, so the placeholder
// key is never a real one.
best_fit_allocator::live_index::node_type best_fit_allocator::make_live_node() {
  live_.reserve(live_.size() + 1);
  return live_.extract(live_.emplace(std::numeric_limits<std::uint64_t>::max(), 0).first);
}

void best_fit_allocator::insert_free(std::uint64_t offset, std::uint64_t bytes) noexcept {
  auto size_node = std::move(spare_by_size_.back());
  spare_by_size_.pop_back();
  auto offset_node = std::move(spare_by_offset_.back());
  spare_by_offset_.pop_back();
  size_node.value() = {bytes, offset};
  offset_node.key() = offset;
  offset_node.mapped() = bytes;
  free_by_size_.insert(std::move(size_node));
  free_by_offset_.insert(std::move(offset_node));
}

void best_fit_allocator::erase_free(std::uint64_t offset, std::uint64_t bytes) noexcept {
  // Capacity was reserved when the node was made: these push_backs do not allocate.
  spare_by_size_.push_back(free_by_size_.extract({bytes, offset}));
  spare_by_offset_.push_back(free_by_offset_.extract(offset));
}

std::optional<allocation> best_fit_allocator::allocate(std::uint64_t bytes) {
  if (bytes == 0) return allocation{0, 0, zero_node, 0};
  const auto aligned = align_up(bytes, alignment_);
  if (!aligned) return std::nullopt;
  const std::uint64_t need = *aligned;
  // Everything that may allocate happens before any state changes (strong guarantee).
  reserve_nodes(2);
  auto live_node = make_live_node();

  std::uint64_t offset = 0;
  if (auto it = free_by_size_.lower_bound({need, 0}); it != free_by_size_.end()) {
    const auto [block_bytes, block_offset] = *it;
    erase_free(block_offset, block_bytes);
    if (block_bytes > need) insert_free(block_offset + need, block_bytes - need);
    offset = block_offset;
  } else {
    // Grow at the end, extending a free block that ends at the high-water mark.
    offset = peak_;
    std::uint64_t tail_bytes = 0;
    if (!free_by_offset_.empty()) {
      const auto last = std::prev(free_by_offset_.end());
      if (last->first + last->second == peak_) {
        offset = last->first;
        tail_bytes = last->second;
      }
    }
    const std::uint64_t extra = need - tail_bytes;
    if (extra > capacity_ || peak_ > capacity_ - extra) return std::nullopt;
    if (tail_bytes != 0) erase_free(offset, tail_bytes);
    peak_ += extra;
  }
  live_node.key() = offset;
  live_node.mapped() = need;
  live_.insert(std::move(live_node));  // cannot rehash: room reserved
  used_ += need;
  return allocation{offset, need, 0, 0, owner_};
}

std::optional<allocation> best_fit_allocator::allocate_at(std::uint64_t offset,
                                                          std::uint64_t bytes) {
  if (bytes == 0) return allocation{0, 0, zero_node, 0};
  const auto aligned = align_up(bytes, alignment_);
  if (!aligned || !is_aligned(offset, alignment_) || offset > capacity_ ||
      *aligned > capacity_ - offset) {
    return std::nullopt;
  }
  const std::uint64_t need = *aligned;
  const std::uint64_t end = offset + need;
  if (live_.contains(offset)) return std::nullopt;
  reserve_nodes(2);
  auto live_node = make_live_node();
  if (offset >= peak_) {
    // Past the high-water mark: the gap [peak, offset) becomes free, merged with a free
    // block that ends at the mark.
    if (offset > peak_) {
      std::uint64_t start = peak_;
      std::uint64_t length = offset - peak_;
      if (!free_by_offset_.empty()) {
        const auto last = std::prev(free_by_offset_.end());
        if (last->first + last->second == peak_) {
          start = last->first;
          length += last->second;
          erase_free(last->first, last->second);
        }
      }
      insert_free(start, length);
    }
    peak_ = end;
  } else {
    auto it = free_by_offset_.upper_bound(offset);
    if (it == free_by_offset_.begin()) return std::nullopt;
    --it;
    const auto [block, block_bytes] = *it;
    const std::uint64_t block_end = block + block_bytes;
    if (end > block_end && block_end != peak_) return std::nullopt;
    if (offset >= block_end) return std::nullopt;
    erase_free(block, block_bytes);
    if (offset > block) insert_free(block, offset - block);
    if (end < block_end) insert_free(end, block_end - end);
    if (end > block_end) peak_ = end;  // the free tail block is extended past the mark
  }
  live_node.key() = offset;
  live_node.mapped() = need;
  live_.insert(std::move(live_node));
  used_ += need;
  return allocation{offset, need, 0, 0, owner_};
}

free_status best_fit_allocator::try_free(std::uint64_t offset, std::uint64_t bytes) noexcept {
  if (bytes == 0 && offset == 0) return free_status::ok;  // the zero-byte allocation
  const auto it = live_.find(offset);
  if (it == live_.end()) return free_status::not_allocated;
  const auto aligned = align_up(bytes, alignment_);
  if (!aligned || *aligned != it->second) return free_status::size_mismatch;
  live_.erase(it);
  used_ -= *aligned;

  std::uint64_t start = offset;
  std::uint64_t length = *aligned;
  if (auto next = free_by_offset_.find(offset + length); next != free_by_offset_.end()) {
    const std::uint64_t next_bytes = next->second;
    erase_free(offset + length, next_bytes);
    length += next_bytes;
  }
  if (auto after = free_by_offset_.lower_bound(offset); after != free_by_offset_.begin()) {
    const auto prev = std::prev(after);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      const std::uint64_t prev_bytes = prev->second;
      erase_free(start, prev_bytes);
      length += prev_bytes;
    }
  }
  insert_free(start, length);
  return free_status::ok;
}

void best_fit_allocator::free(std::uint64_t offset, std::uint64_t bytes) {
  const free_status status = try_free(offset, bytes);
  if (status == free_status::ok) return;
  const auto it = live_.find(offset);
  throw_free_error(name, status, offset, bytes, it == live_.end() ? 0 : it->second);
}

free_status best_fit_allocator::try_deallocate(const allocation& a) noexcept {
  if (a.node == zero_node && a.bytes == 0) return free_status::ok;
  if (a.owner != owner_) return free_status::foreign_handle;
  const auto it = live_.find(a.offset);
  if (it == live_.end()) return free_status::not_allocated;
  if (it->second != a.bytes) return free_status::size_mismatch;
  return try_free(a.offset, a.bytes);
}

void best_fit_allocator::deallocate(const allocation& a) {
  const free_status status = try_deallocate(a);
  if (status == free_status::ok) return;
  const auto it = live_.find(a.offset);
  throw_free_error(name, status, a.offset, a.bytes, it == live_.end() ? 0 : it->second);
}

allocator_stats best_fit_allocator::stats() const {
  allocator_stats s;
  s.used_bytes = used_;
  s.peak_bytes = peak_;
  s.live_allocations = live_.size();
  const std::uint64_t end = capacity_ == growing ? peak_ : capacity_;
  s.free_bytes = end - used_;
  s.free_blocks = free_by_size_.size();
  if (!free_by_size_.empty()) s.largest_free_bytes = free_by_size_.rbegin()->first;
  std::uint64_t tail_free = 0;
  if (!free_by_offset_.empty()) {
    const auto last = std::prev(free_by_offset_.end());
    if (last->first + last->second == peak_) tail_free = last->second;
  }
  add_untouched_tail(s, end, peak_, tail_free);
  return s;
}

std::string best_fit_allocator::check_invariants() const {
  if (peak_ > capacity_) return "peak above capacity";
  if (free_by_size_.size() != free_by_offset_.size()) return "free indexes differ in size";
  std::vector<std::pair<std::uint64_t, std::pair<std::uint64_t, bool>>> ranges;
  ranges.reserve(free_by_offset_.size() + live_.size());
  std::uint64_t live_sum = 0;
  for (const auto& [offset, bytes] : free_by_offset_) {
    if (!free_by_size_.contains({bytes, offset})) return "free block missing from size index";
    ranges.push_back({offset, {bytes, true}});
  }
  for (const auto& [offset, bytes] : live_) {
    ranges.push_back({offset, {bytes, false}});
    live_sum += bytes;
  }
  if (live_sum != used_) return "used bytes differ from the sum of live allocations";
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t cursor = 0;
  bool prev_free = false;
  for (const auto& [offset, info] : ranges) {
    const auto [bytes, is_free] = info;
    if (offset != cursor) return "gap or overlap at offset " + std::to_string(offset);
    if (bytes == 0 || !is_aligned(bytes, alignment_) || !is_aligned(offset, alignment_))
      return "misaligned or empty block at offset " + std::to_string(offset);
    if (is_free && prev_free) return "unmerged free neighbours at " + std::to_string(offset);
    prev_free = is_free;
    cursor = offset + bytes;
  }
  if (cursor != peak_) return "blocks end at " + std::to_string(cursor) + ", not at peak";
  return {};
}

}  // namespace tensormem::core
