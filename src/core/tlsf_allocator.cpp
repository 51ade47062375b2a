#include "tensormem/core/tlsf_allocator.hpp"

#include <algorithm>
#include <bit>

#include "tensormem/core/align.hpp"

namespace tensormem::core {

// The helpers of allocate and deallocate are inlined into them: the GCC heuristics keep
// several of them out of line, which costs a call per helper on every operation.
#define TENSORMEM_HOT_INLINE [[gnu::always_inline]] inline

namespace {
constexpr const char* name = "tlsf_allocator";
constexpr std::uint32_t zero_node = 0xfffffffeU;
}  // namespace

tlsf_allocator::tlsf_allocator(std::uint64_t capacity, std::uint64_t alignment)
    : capacity_(capacity), alignment_(alignment), unit_shift_(0), owner_(next_owner_id()) {
  check_alignment_argument(name, alignment);
  unit_shift_ = static_cast<unsigned>(std::countr_zero(alignment));
  bin_heads_.fill(none);
}

// Class of a unit count, rounded down: exact below 2^M, then M mantissa bits per octave.
unsigned tlsf_allocator::floor_class(std::uint64_t bytes) const noexcept {
  const std::uint64_t units = bytes >> unit_shift_;
  if (units < leaf_bins) return static_cast<unsigned>(units);
  const unsigned exponent = static_cast<unsigned>(std::bit_width(units)) - 1U - mantissa_bits;
  const auto mantissa = static_cast<unsigned>((units >> exponent) - leaf_bins);
  return (exponent + 1U) * leaf_bins + mantissa;
}

unsigned tlsf_allocator::ceil_class(std::uint64_t bytes) const noexcept {
  const std::uint64_t units = bytes >> unit_shift_;
  const unsigned cls = floor_class(bytes);
  if (units < leaf_bins) return cls;
  const unsigned exponent = static_cast<unsigned>(std::bit_width(units)) - 1U - mantissa_bits;
  const std::uint64_t low_bits = units & ((std::uint64_t{1} << exponent) - 1U);
  return low_bits != 0 ? cls + 1U : cls;
}

TENSORMEM_HOT_INLINE std::uint32_t tlsf_allocator::new_node() {
  if (!unused_nodes_.empty()) {
    const std::uint32_t n = unused_nodes_.back();
    unused_nodes_.pop_back();
    return n;
  }
  nodes_.emplace_back();  // capacity reserved by allocate(): cannot throw
  return static_cast<std::uint32_t>(nodes_.size() - 1);
}

TENSORMEM_HOT_INLINE void tlsf_allocator::release_node(std::uint32_t n) noexcept {
  node& x = nodes_[n];
  x.st = state::unused;
  ++x.generation;
  unused_nodes_.push_back(n);  // capacity reserved: nodes_ never shrinks below it
}

TENSORMEM_HOT_INLINE void tlsf_allocator::bin_insert(std::uint32_t n) noexcept {
  node& x = nodes_[n];
  const unsigned cls = floor_class(x.bytes);
  x.st = state::free;
  x.prev_bin = none;
  x.next_bin = bin_heads_[cls];
  if (x.next_bin != none) nodes_[x.next_bin].prev_bin = n;
  bin_heads_[cls] = n;
  ++bin_length_[cls];
  window_max_[cls] = std::max(window_max_[cls], x.bytes);
  top_bitmap_ |= std::uint64_t{1} << (cls >> mantissa_bits);
  leaf_bitmaps_[cls >> mantissa_bits] |= std::uint64_t{1} << (cls & (leaf_bins - 1U));
  ++free_block_count_;
}

TENSORMEM_HOT_INLINE void tlsf_allocator::bin_remove(std::uint32_t n) noexcept {
  node& x = nodes_[n];
  const unsigned cls = floor_class(x.bytes);
  // A block from beyond the window may move into it: its largest size is no longer known.
  if (--bin_length_[cls] >= scan_limit) window_max_[cls] = ~std::uint64_t{0};
  else if (bin_length_[cls] == 0) window_max_[cls] = 0;
  if (x.prev_bin != none) {
    nodes_[x.prev_bin].next_bin = x.next_bin;
  } else {
    bin_heads_[cls] = x.next_bin;
    if (x.next_bin == none) {
      const unsigned top = cls >> mantissa_bits;
      leaf_bitmaps_[top] &= ~(std::uint64_t{1} << (cls & (leaf_bins - 1U)));
      if (leaf_bitmaps_[top] == 0) top_bitmap_ &= ~(std::uint64_t{1} << top);
    }
  }
  if (x.next_bin != none) nodes_[x.next_bin].prev_bin = x.prev_bin;
  x.prev_bin = x.next_bin = none;
  --free_block_count_;
}

TENSORMEM_HOT_INLINE std::uint32_t tlsf_allocator::first_bin_at_or_above(unsigned cls) const noexcept {
  if (cls >= bin_count) return none;
  const unsigned top = cls >> mantissa_bits;
  const std::uint64_t leaf = leaf_bitmaps_[top] & (~std::uint64_t{0} << (cls & (leaf_bins - 1U)));
  if (leaf != 0) return (top << mantissa_bits) | static_cast<unsigned>(std::countr_zero(leaf));
  if (top + 1U >= 64U) return none;
  const std::uint64_t tops = top_bitmap_ & (~std::uint64_t{0} << (top + 1U));
  if (tops == 0) return none;
  const auto t = static_cast<unsigned>(std::countr_zero(tops));
  return (t << mantissa_bits) | static_cast<unsigned>(std::countr_zero(leaf_bitmaps_[t]));
}

// Smallest block (lowest offset among equals) that holds `need` bytes among the first
// scan_limit blocks of the list, or none.
TENSORMEM_HOT_INLINE std::uint32_t tlsf_allocator::best_in_bin(unsigned cls, std::uint64_t need) noexcept {
  std::uint32_t best = none;
  std::uint64_t largest = 0;
  unsigned steps = 0;
  for (std::uint32_t n = bin_heads_[cls]; n != none && steps < scan_limit;
       n = nodes_[n].next_bin, ++steps) {
    const node& x = nodes_[n];
    largest = std::max(largest, x.bytes);
    if (x.bytes < need) continue;
    if (best == none || x.bytes < nodes_[best].bytes ||
        (x.bytes == nodes_[best].bytes && x.offset < nodes_[best].offset)) {
      best = n;
    }
  }
  window_max_[cls] = largest;  // the whole window was read: its largest block, exactly
  return best;
}

std::optional<allocation> tlsf_allocator::allocate(std::uint64_t bytes) {
  if (bytes == 0) return allocation{0, 0, zero_node, 0};
  const auto aligned = align_up(bytes, alignment_);
  if (!aligned) return std::nullopt;
  const std::uint64_t need = *aligned;
  // Everything that may allocate or fail happens before any state changes (strong
  // guarantee): room for two new nodes, for their recycling, and for the live map entry.
  if (nodes_.size() + 2 > nodes_.capacity()) {
    if (nodes_.size() + 2 >= zero_node) throw std::length_error("tlsf_allocator: too many blocks");
    const std::size_t want = std::max<std::size_t>(64, nodes_.capacity() * 2);
    unused_nodes_.reserve(want);
    nodes_.reserve(want);
  }
  if (indexed_) live_.reserve(live_.size() + 1);

  const unsigned down = floor_class(need);
  const unsigned up = ceil_class(need);
  std::uint32_t n = none;
  if (down != up && window_max_[down] >= need) n = best_in_bin(down, need);
  if (n == none) {
    const std::uint32_t cls = first_bin_at_or_above(up);
    if (cls != none) n = best_in_bin(cls, need);
  }
  // A free tail that fits but sits beyond the scan limit of its list is still taken before
  // the arena grows.
  if (n == none && tail_ != none && nodes_[tail_].st == state::free &&
      nodes_[tail_].bytes >= need) {
    n = tail_;
  }

  if (n != none) {
    bin_remove(n);
    if (nodes_[n].bytes > need) {
      const std::uint32_t r = new_node();
      node& rest = nodes_[r];
      node& block = nodes_[n];
      rest.offset = block.offset + need;
      rest.bytes = block.bytes - need;
      rest.prev_phys = n;
      rest.next_phys = block.next_phys;
      if (block.next_phys != none) nodes_[block.next_phys].prev_phys = r;
      block.next_phys = r;
      block.bytes = need;
      if (tail_ == n) tail_ = r;
      bin_insert(r);
    }
  } else {
    // Grow at the end, extending a free block that ends at the high-water mark.
    // (A free tail of need bytes or more was taken above: extending it never goes negative.)
    const bool extend = tail_ != none && nodes_[tail_].st == state::free && nodes_[tail_].bytes < need;
    const std::uint64_t extra = extend ? need - nodes_[tail_].bytes : need;
    if (extra > capacity_ || peak_ > capacity_ - extra) return std::nullopt;
    if (extend) {
      n = tail_;
      bin_remove(n);
      nodes_[n].bytes = need;
    } else {
      n = new_node();
      node& x = nodes_[n];
      x.offset = peak_;
      x.bytes = need;
      x.prev_phys = tail_;
      x.next_phys = none;
      if (tail_ != none) nodes_[tail_].next_phys = n;
      else head_ = n;
      tail_ = n;
    }
    peak_ += extra;
  }
  node& x = nodes_[n];
  x.st = state::used;
  used_ += need;
  ++live_count_;
  if (indexed_) live_.insert(x.offset, n);
  return allocation{x.offset, need, n, x.generation, owner_};
}

// Frees node n (a used node) and merges it with free neighbours.
TENSORMEM_HOT_INLINE void tlsf_allocator::release(std::uint32_t n) noexcept {
  node& x = nodes_[n];
  if (indexed_) live_.erase(x.offset);
  --live_count_;
  used_ -= x.bytes;
  ++x.generation;
  if (const std::uint32_t p = x.prev_phys; p != none && nodes_[p].st == state::free) {
    bin_remove(p);
    node& prev = nodes_[p];
    x.offset = prev.offset;
    x.bytes += prev.bytes;
    x.prev_phys = prev.prev_phys;
    if (prev.prev_phys != none) nodes_[prev.prev_phys].next_phys = n;
    if (head_ == p) head_ = n;
    release_node(p);
  }
  if (const std::uint32_t q = x.next_phys; q != none && nodes_[q].st == state::free) {
    bin_remove(q);
    node& next = nodes_[q];
    x.bytes += next.bytes;
    x.next_phys = next.next_phys;
    if (next.next_phys != none) nodes_[next.next_phys].prev_phys = n;
    if (tail_ == q) tail_ = n;
    release_node(q);
  }
  bin_insert(n);
}

TENSORMEM_HOT_INLINE free_status tlsf_allocator::check_handle(std::uint32_t n, std::uint64_t offset,
                                         std::uint64_t bytes) const noexcept {
  if (n >= nodes_.size()) return free_status::stale_handle;
  const node& x = nodes_[n];
  if (x.st != state::used || x.offset != offset) return free_status::stale_handle;
  if (x.bytes != bytes) return free_status::size_mismatch;
  return free_status::ok;
}

free_status tlsf_allocator::try_deallocate(const allocation& a) noexcept {
  if (a.node == zero_node && a.bytes == 0) return free_status::ok;
  if (a.owner != owner_) return free_status::foreign_handle;
  const free_status status = check_handle(a.node, a.offset, a.bytes);
  if (status != free_status::ok) return status;
  if (nodes_[a.node].generation != a.generation) return free_status::stale_handle;
  release(a.node);
  return free_status::ok;
}

void tlsf_allocator::deallocate(const allocation& a) {
  const free_status status = try_deallocate(a);
  if (status == free_status::ok) return;
  const std::uint64_t held = a.node < nodes_.size() ? nodes_[a.node].bytes : 0;
  throw_free_error(name, status, a.offset, a.bytes, held);
}

// The offset index, from one walk of the address chain; kept current from then on.
void tlsf_allocator::build_index() {
  detail::offset_map index;
  index.reserve(live_count_ + 1);
  for (std::uint32_t n = head_; n != none; n = nodes_[n].next_phys) {
    if (nodes_[n].st == state::used) index.insert(nodes_[n].offset, n);
  }
  live_ = std::move(index);
  indexed_ = true;
}

// The used node at `offset`: through the index, or (when it could not be built for lack of
// memory) by walking the blocks.
std::uint32_t tlsf_allocator::find_live(std::uint64_t offset) const noexcept {
  if (indexed_) return live_.find(offset);
  for (std::uint32_t n = head_; n != none; n = nodes_[n].next_phys) {
    if (nodes_[n].offset == offset) return nodes_[n].st == state::used ? n : detail::offset_map::not_found;
    if (nodes_[n].offset > offset) break;
  }
  return detail::offset_map::not_found;
}

free_status tlsf_allocator::try_free(std::uint64_t offset, std::uint64_t bytes) noexcept {
  if (bytes == 0 && offset == 0) return free_status::ok;
  if (!indexed_) {
    try {
      build_index();
    } catch (...) {  // no memory for the index: this call walks the blocks instead
    }
  }
  const std::uint32_t n = find_live(offset);
  if (n == detail::offset_map::not_found) return free_status::not_allocated;
  const auto aligned = align_up(bytes, alignment_);
  if (!aligned || *aligned != nodes_[n].bytes) return free_status::size_mismatch;
  release(n);
  return free_status::ok;
}

void tlsf_allocator::free(std::uint64_t offset, std::uint64_t bytes) {
  const free_status status = try_free(offset, bytes);
  if (status == free_status::ok) return;
  const std::uint32_t n = find_live(offset);
  throw_free_error(name, status, offset, bytes,
                   n == detail::offset_map::not_found ? 0 : nodes_[n].bytes);
}

allocator_stats tlsf_allocator::stats() const {
  allocator_stats s;
  s.used_bytes = used_;
  s.peak_bytes = peak_;
  s.live_allocations = live_count_;
  const std::uint64_t end = capacity_ == growing ? peak_ : capacity_;
  s.free_bytes = end - used_;
  s.free_blocks = free_block_count_;
  if (top_bitmap_ != 0) {
    const auto top = 63U - static_cast<unsigned>(std::countl_zero(top_bitmap_));
    const auto leaf = 63U - static_cast<unsigned>(std::countl_zero(leaf_bitmaps_[top]));
    for (std::uint32_t n = bin_heads_[(top << mantissa_bits) | leaf]; n != none;
         n = nodes_[n].next_bin) {
      s.largest_free_bytes = std::max(s.largest_free_bytes, nodes_[n].bytes);
    }
  }
  const bool tail_free = tail_ != none && nodes_[tail_].st == state::free;
  add_untouched_tail(s, end, peak_, tail_free ? nodes_[tail_].bytes : 0);
  return s;
}

std::string tlsf_allocator::check_invariants() const {
  if (peak_ > capacity_) return "peak above capacity";
  std::uint64_t cursor = 0;
  std::uint64_t used_sum = 0;
  std::size_t used_count = 0;
  std::size_t free_count = 0;
  std::uint32_t last = none;
  bool prev_free = false;
  for (std::uint32_t n = head_; n != none; n = nodes_[n].next_phys) {
    const node& x = nodes_[n];
    if (x.prev_phys != last) return "broken neighbour link at offset " + std::to_string(x.offset);
    if (x.offset != cursor) return "gap or overlap at offset " + std::to_string(x.offset);
    if (x.bytes == 0 || !is_aligned(x.bytes, alignment_) || !is_aligned(x.offset, alignment_))
      return "misaligned or empty block at offset " + std::to_string(x.offset);
    if (x.st == state::unused) return "unused node in the address chain";
    const bool is_free = x.st == state::free;
    if (is_free && prev_free) return "unmerged free neighbours at " + std::to_string(x.offset);
    if (is_free) {
      ++free_count;
    } else {
      ++used_count;
      used_sum += x.bytes;
      if (indexed_ && live_.find(x.offset) != n) return "live map misses offset " + std::to_string(x.offset);
    }
    prev_free = is_free;
    cursor = x.offset + x.bytes;
    last = n;
  }
  if (last != tail_) return "tail is not the last block";
  if (cursor != peak_) return "blocks end at " + std::to_string(cursor) + ", not at peak";
  if (used_sum != used_) return "used bytes differ from the sum of live blocks";
  if (used_count != live_count_) return "live count differs from live blocks";
  if (indexed_ && live_.size() != live_count_) return "live map size differs from live blocks";
  if (free_count != free_block_count_) return "free block count is wrong";
  std::size_t binned = 0;
  for (unsigned cls = 0; cls < bin_count; ++cls) {
    const bool bit = ((leaf_bitmaps_[cls >> mantissa_bits] >> (cls & (leaf_bins - 1U))) & 1U) != 0;
    if (bit != (bin_heads_[cls] != none)) return "bitmap disagrees with list " + std::to_string(cls);
    std::uint32_t prev = none;
    for (std::uint32_t n = bin_heads_[cls]; n != none; n = nodes_[n].next_bin) {
      const node& x = nodes_[n];
      if (x.st != state::free || floor_class(x.bytes) != cls || x.prev_bin != prev)
        return "list " + std::to_string(cls) + " holds a wrong node";
      prev = n;
      if (++binned > free_count) return "lists hold more nodes than free blocks";
    }
  }
  for (unsigned top = 0; top < 64; ++top) {
    if ((((top_bitmap_ >> top) & 1U) != 0) != (leaf_bitmaps_[top] != 0)) return "top bitmap wrong";
  }
  if (binned != free_count) return "a free block is in no list";
  return {};
}

}  // namespace tensormem::core
