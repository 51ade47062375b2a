#include "tensormem/core/best_fit_allocator.hpp"

#include <algorithm>
#include <limits>
#include <vector>

#include "tensormem/core/align.hpp"

namespace tensormem::core {

namespace {
constexpr std::uint32_t zero_node = 0xfffffffeU;
constexpr const char* name = "best_fit_allocator";
}  // namespace

best_fit_allocator::best_fit_allocator(std::uint64_t capacity, std::uint64_t alignment)
    : capacity_(capacity), alignment_(alignment), owner_(next_owner_id()) {
  check_alignment_argument(name, alignment);
}

void best_fit_allocator::reserve_for_allocation(std::size_t blocks) {
  if (blocks_.size() + blocks > blocks_.capacity()) {
    if (blocks_.size() + blocks >= zero_node) throw std::length_error("best_fit_allocator: too many blocks");
    const std::size_t want = std::max<std::size_t>(64, blocks_.capacity() * 2);
    unused_blocks_.reserve(want);
    blocks_.reserve(want);
  }
  while (spare_nodes_.size() < 2 || spare_nodes_.size() + free_by_size_.size() < live_count_ + 2) {
    // Room for every node grows geometrically (one node per call would copy the vector on
    // every allocation).
    const std::size_t total = spare_nodes_.size() + free_by_size_.size() + 1;
    if (spare_nodes_.capacity() < total) spare_nodes_.reserve(std::max(total, 2 * spare_nodes_.capacity()));
    // A node is made by inserting a key no real block has, then extracting it.
    constexpr auto max = std::numeric_limits<std::uint64_t>::max();
    spare_nodes_.push_back(free_by_size_.extract(free_by_size_.insert({max, max, none}).first));
  }
  if (indexed_) live_.reserve(live_.size() + 1);
}

std::uint32_t best_fit_allocator::new_block() noexcept {
  if (!unused_blocks_.empty()) {
    const std::uint32_t n = unused_blocks_.back();
    unused_blocks_.pop_back();
    return n;
  }
  blocks_.emplace_back();  // capacity reserved by reserve_for_allocation
  return static_cast<std::uint32_t>(blocks_.size() - 1);
}

void best_fit_allocator::release_block(std::uint32_t n) noexcept {
  blocks_[n].st = state::unused;
  ++blocks_[n].generation;
  unused_blocks_.push_back(n);  // capacity >= blocks_.size()
}

void best_fit_allocator::index_free(std::uint32_t n) noexcept {
  block& x = blocks_[n];
  x.st = state::free;
  auto node = std::move(spare_nodes_.back());
  spare_nodes_.pop_back();
  node.value() = {x.bytes, x.offset, n};
  free_by_size_.insert(std::move(node));
}

void best_fit_allocator::unindex_free(std::uint32_t n) noexcept {
  const block& x = blocks_[n];
  spare_nodes_.push_back(free_by_size_.extract({x.bytes, x.offset, n}));  // capacity reserved
}

// Links new block r right after block n (r's offset and size are set by the caller).
void best_fit_allocator::link_after(std::uint32_t n, std::uint32_t r) noexcept {
  blocks_[r].prev = n;
  blocks_[r].next = blocks_[n].next;
  if (blocks_[n].next != none) blocks_[blocks_[n].next].prev = r;
  else tail_ = r;
  blocks_[n].next = r;
}

void best_fit_allocator::link_before(std::uint32_t n, std::uint32_t l) noexcept {
  blocks_[l].next = n;
  blocks_[l].prev = blocks_[n].prev;
  if (blocks_[n].prev != none) blocks_[blocks_[n].prev].next = l;
  else head_ = l;
  blocks_[n].prev = l;
}

allocation best_fit_allocator::make_used(std::uint32_t n, std::uint64_t need) noexcept {
  block& x = blocks_[n];
  x.st = state::used;
  used_ += need;
  ++live_count_;
  if (indexed_) live_.insert(x.offset, n);  // room reserved
  return allocation{x.offset, need, n, x.generation, owner_};
}

std::optional<allocation> best_fit_allocator::allocate(std::uint64_t bytes) {
  if (bytes == 0) return allocation{0, 0, zero_node, 0};
  const auto aligned = align_up(bytes, alignment_);
  if (!aligned) return std::nullopt;
  const std::uint64_t need = *aligned;
  // Everything that may allocate happens before any state changes (strong guarantee).
  reserve_for_allocation(2);

  std::uint32_t n = none;
  if (auto it = free_by_size_.lower_bound({need, 0, 0}); it != free_by_size_.end()) {
    n = it->node;
    spare_nodes_.push_back(free_by_size_.extract(it));
    if (blocks_[n].bytes > need) {
      const std::uint32_t r = new_block();
      blocks_[r].offset = blocks_[n].offset + need;
      blocks_[r].bytes = blocks_[n].bytes - need;
      link_after(n, r);
      index_free(r);
      blocks_[n].bytes = need;
    }
  } else {
    // Grow at the end, extending a free block that ends at the high-water mark.
    const bool extend = tail_ != none && blocks_[tail_].st == state::free;
    const std::uint64_t extra = extend ? need - blocks_[tail_].bytes : need;
    if (extra > capacity_ || peak_ > capacity_ - extra) return std::nullopt;
    if (extend) {
      n = tail_;
      unindex_free(n);
    } else {
      n = new_block();
      blocks_[n].offset = peak_;
      if (tail_ != none) link_after(tail_, n);
      else head_ = tail_ = n;
    }
    blocks_[n].bytes = need;
    peak_ += extra;
  }
  return make_used(n, need);
}

// The last block that starts at or before `offset`, walking back from the end; none when
// there are no blocks.
std::uint32_t best_fit_allocator::block_at_or_before(std::uint64_t offset) const noexcept {
  std::uint32_t n = tail_;
  while (n != none && blocks_[n].offset > offset) n = blocks_[n].prev;
  return n;
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
  std::uint32_t b = offset >= peak_ ? none : block_at_or_before(offset);
  if (b != none) {
    const block& x = blocks_[b];
    const std::uint64_t x_end = x.offset + x.bytes;
    // Inside a used block, or past a free block that does not reach the high-water mark.
    if (x.st != state::free || (end > x_end && x_end != peak_)) return std::nullopt;
  }
  reserve_for_allocation(2);
  if (b == none) {
    // At or past the high-water mark: the gap [peak, offset) becomes free, merged with a
    // free block that ends at the mark.
    if (offset > peak_) {
      if (tail_ != none && blocks_[tail_].st == state::free) {
        unindex_free(tail_);
        blocks_[tail_].bytes += offset - peak_;
        index_free(tail_);
      } else {
        const std::uint32_t g = new_block();
        blocks_[g].offset = peak_;
        blocks_[g].bytes = offset - peak_;
        if (tail_ != none) link_after(tail_, g);
        else head_ = tail_ = g;
        index_free(g);
      }
    }
    const std::uint32_t n = new_block();
    blocks_[n].offset = offset;
    blocks_[n].bytes = need;
    if (tail_ != none) link_after(tail_, n);
    else head_ = tail_ = n;
    peak_ = end;
    return make_used(n, need);
  }
  // Inside free block b: it becomes [offset, end), its pieces before and after stay free.
  unindex_free(b);
  const std::uint64_t b_end = blocks_[b].offset + blocks_[b].bytes;
  if (offset > blocks_[b].offset) {
    const std::uint32_t l = new_block();
    blocks_[l].offset = blocks_[b].offset;
    blocks_[l].bytes = offset - blocks_[b].offset;
    link_before(b, l);
    index_free(l);
  }
  if (end < b_end) {
    const std::uint32_t r = new_block();
    blocks_[r].offset = end;
    blocks_[r].bytes = b_end - end;
    link_after(b, r);
    index_free(r);
  }
  if (end > b_end) peak_ = end;  // the free tail block is extended past the mark
  blocks_[b].offset = offset;
  blocks_[b].bytes = need;
  return make_used(b, need);
}

// Frees used block n and merges it with free neighbours.
void best_fit_allocator::release(std::uint32_t n) noexcept {
  block& x = blocks_[n];
  if (indexed_) live_.erase(x.offset);
  --live_count_;
  used_ -= x.bytes;
  ++x.generation;
  if (const std::uint32_t p = x.prev; p != none && blocks_[p].st == state::free) {
    unindex_free(p);
    x.offset = blocks_[p].offset;
    x.bytes += blocks_[p].bytes;
    x.prev = blocks_[p].prev;
    if (x.prev != none) blocks_[x.prev].next = n;
    else head_ = n;
    release_block(p);
  }
  if (const std::uint32_t q = x.next; q != none && blocks_[q].st == state::free) {
    unindex_free(q);
    x.bytes += blocks_[q].bytes;
    x.next = blocks_[q].next;
    if (x.next != none) blocks_[x.next].prev = n;
    else tail_ = n;
    release_block(q);
  }
  index_free(n);
}

// The offset index, from one walk of the blocks; kept current from then on.
void best_fit_allocator::build_index() {
  detail::offset_map index;
  index.reserve(live_count_ + 1);
  for (std::uint32_t n = head_; n != none; n = blocks_[n].next) {
    if (blocks_[n].st == state::used) index.insert(blocks_[n].offset, n);
  }
  live_ = std::move(index);
  indexed_ = true;
}

// The used block at `offset`: through the index, or (when it could not be built for lack of
// memory) by walking the blocks.
std::uint32_t best_fit_allocator::find_live(std::uint64_t offset) const noexcept {
  if (indexed_) return live_.find(offset);
  const std::uint32_t n = offset >= peak_ ? none : block_at_or_before(offset);
  if (n == none || blocks_[n].offset != offset || blocks_[n].st != state::used) return detail::offset_map::not_found;
  return n;
}

free_status best_fit_allocator::try_free(std::uint64_t offset, std::uint64_t bytes) noexcept {
  if (bytes == 0 && offset == 0) return free_status::ok;  // the zero-byte allocation
  if (!indexed_) {
    try {
      build_index();
    } catch (...) {  // no memory for the index: this call walks the blocks instead
    }
  }
  const std::uint32_t n = find_live(offset);
  if (n == detail::offset_map::not_found) return free_status::not_allocated;
  const auto aligned = align_up(bytes, alignment_);
  if (!aligned || *aligned != blocks_[n].bytes) return free_status::size_mismatch;
  release(n);
  return free_status::ok;
}

void best_fit_allocator::free(std::uint64_t offset, std::uint64_t bytes) {
  const free_status status = try_free(offset, bytes);
  if (status == free_status::ok) return;
  const std::uint32_t n = find_live(offset);
  throw_free_error(name, status, offset, bytes, n == detail::offset_map::not_found ? 0 : blocks_[n].bytes);
}

free_status best_fit_allocator::check_handle(const allocation& a) const noexcept {
  if (a.owner != owner_) return free_status::foreign_handle;
  if (a.node >= blocks_.size()) return free_status::stale_handle;
  const block& x = blocks_[a.node];
  if (x.st != state::used || x.offset != a.offset || x.generation != a.generation) return free_status::stale_handle;
  if (x.bytes != a.bytes) return free_status::size_mismatch;
  return free_status::ok;
}

free_status best_fit_allocator::try_deallocate(const allocation& a) noexcept {
  if (a.node == zero_node && a.bytes == 0) return free_status::ok;
  const free_status status = check_handle(a);
  if (status == free_status::ok) release(a.node);
  return status;
}

void best_fit_allocator::deallocate(const allocation& a) {
  const free_status status = try_deallocate(a);
  if (status == free_status::ok) return;
  const std::uint64_t held = a.node < blocks_.size() ? blocks_[a.node].bytes : 0;
  throw_free_error(name, status, a.offset, a.bytes, held);
}

allocator_stats best_fit_allocator::stats() const {
  allocator_stats s;
  s.used_bytes = used_;
  s.peak_bytes = peak_;
  s.live_allocations = live_count_;
  const std::uint64_t end = capacity_ == growing ? peak_ : capacity_;
  s.free_bytes = end - used_;
  s.free_blocks = free_by_size_.size();
  if (!free_by_size_.empty()) s.largest_free_bytes = free_by_size_.rbegin()->bytes;
  const bool tail_free = tail_ != none && blocks_[tail_].st == state::free;
  add_untouched_tail(s, end, peak_, tail_free ? blocks_[tail_].bytes : 0);
  return s;
}

std::string best_fit_allocator::check_invariants() const {
  if (peak_ > capacity_) return "peak above capacity";
  std::uint64_t cursor = 0;
  std::uint64_t used_sum = 0;
  std::size_t used_count = 0;
  std::size_t free_count = 0;
  std::uint32_t last = none;
  bool prev_free = false;
  for (std::uint32_t n = head_; n != none; n = blocks_[n].next) {
    const block& x = blocks_[n];
    if (x.prev != last) return "broken neighbour link at offset " + std::to_string(x.offset);
    if (x.offset != cursor) return "gap or overlap at offset " + std::to_string(x.offset);
    if (x.bytes == 0 || !is_aligned(x.bytes, alignment_) || !is_aligned(x.offset, alignment_))
      return "misaligned or empty block at offset " + std::to_string(x.offset);
    if (x.st == state::unused) return "unused block in the address chain";
    const bool is_free = x.st == state::free;
    if (is_free && prev_free) return "unmerged free neighbours at " + std::to_string(x.offset);
    if (is_free) {
      ++free_count;
      const auto it = free_by_size_.find({x.bytes, x.offset, n});
      if (it == free_by_size_.end() || it->node != n) return "free block missing from size index";
    } else {
      ++used_count;
      used_sum += x.bytes;
      if (indexed_ && live_.find(x.offset) != n) return "live index misses offset " + std::to_string(x.offset);
    }
    prev_free = is_free;
    cursor = x.offset + x.bytes;
    last = n;
  }
  if (last != tail_) return "tail is not the last block";
  if (cursor != peak_) return "blocks end at " + std::to_string(cursor) + ", not at peak";
  if (free_count != free_by_size_.size()) return "size index holds blocks that are not free";
  if (used_sum != used_) return "used bytes differ from the sum of live allocations";
  if (used_count != live_count_) return "live count differs from live blocks";
  if (indexed_ && live_.size() != live_count_) return "live index size differs from live blocks";
  if (live_count_ != 0 && spare_nodes_.size() + free_by_size_.size() < live_count_ + 1)
    return "too few index nodes for a free";
  return {};
}

}  // namespace tensormem::core
