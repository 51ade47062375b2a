#include "tensormem/core/best_fit_allocator.hpp"

#include <algorithm>
#include <limits>
#include <vector>

#include "tensormem/core/align.hpp"

namespace tensormem::core {

best_fit_allocator::best_fit_allocator(std::uint64_t capacity, std::uint64_t alignment)
    : block_chain_allocator(capacity, alignment, "best_fit_allocator") {}

void best_fit_allocator::reserve_for_allocation(std::size_t blocks) {
  reserve_nodes(blocks);
  while (spare_nodes_.size() < 2 || spare_nodes_.size() + free_by_size_.size() < live_count_ + 2) {
    // Room for every node grows geometrically (one node per call would copy the vector on
    // every allocation).
    const std::size_t total = spare_nodes_.size() + free_by_size_.size() + 1;
    if (spare_nodes_.capacity() < total) spare_nodes_.reserve(std::max(total, 2 * spare_nodes_.capacity()));
    add_spare_index_node();
  }
}

void best_fit_allocator::add_spare_index_node() {
  // A node is made by inserting a key no real block has, then extracting it.
  constexpr auto max = std::numeric_limits<std::uint64_t>::max();
  spare_nodes_.push_back(free_by_size_.extract(free_by_size_.insert({max, max, none}).first));
}

void best_fit_allocator::reserve(std::size_t blocks) {
  blocks = blocks_to_reserve(blocks);
  reserve_blocks(blocks);
  // With blocks + 2 index nodes made (spare or holding a free block), reserve_for_allocation
  // finds enough while no more than `blocks` blocks, so no more live ones, exist.
  const std::size_t want = blocks + 2U;
  spare_nodes_.reserve(want);  // a no-op where the room is there
  while (spare_nodes_.size() + free_by_size_.size() < want) add_spare_index_node();
}

void best_fit_allocator::index_free(std::uint32_t n) noexcept {
  detail::chain_block& x = nodes_[n];
  x.st = detail::block_state::free;
  auto node = std::move(spare_nodes_.back());
  spare_nodes_.pop_back();
  node.value() = {x.bytes, x.offset, n};
  free_by_size_.insert(std::move(node));
}

void best_fit_allocator::unindex_free(std::uint32_t n) noexcept {
  const detail::chain_block& x = nodes_[n];
  spare_nodes_.push_back(free_by_size_.extract({x.bytes, x.offset, n}));  // capacity reserved
}

std::optional<allocation> best_fit_allocator::allocate(std::uint64_t bytes) {
  const std::uint64_t need = round_request(bytes);
  if (need == 0) return turned_down(bytes);
  // Everything that may allocate happens before any state changes (strong guarantee).
  reserve_for_allocation(2);

  std::uint32_t n = none;
  if (auto it = free_by_size_.lower_bound({need, 0, 0}); it != free_by_size_.end()) {
    n = it->node;
    spare_nodes_.push_back(free_by_size_.extract(it));
    if (nodes_[n].bytes > need) {
      const std::uint32_t r = new_node();
      nodes_[r].offset = nodes_[n].offset + need;
      nodes_[r].bytes = nodes_[n].bytes - need;
      link_after(n, r);
      index_free(r);
      nodes_[n].bytes = need;
    }
  } else {
    // Grow at the end, extending a free block that ends at the high-water mark.
    const bool extend = tail_ != none && nodes_[tail_].st == detail::block_state::free;
    const std::uint64_t extra = extend ? need - nodes_[tail_].bytes : need;
    if (extra > capacity_ || peak_ > capacity_ - extra) return std::nullopt;
    if (extend) {
      n = tail_;
      unindex_free(n);
    } else {
      n = new_node();
      nodes_[n].offset = peak_;
      if (tail_ != none) link_after(tail_, n);
      else head_ = tail_ = n;
    }
    nodes_[n].bytes = need;
    peak_ += extra;
  }
  return make_used(n, need);
}

std::optional<allocation> best_fit_allocator::allocate_at(std::uint64_t offset,
                                                          std::uint64_t bytes) {
  const std::uint64_t need = round_request(bytes);
  if (need == 0) return turned_down(bytes);
  if (!is_aligned(offset, alignment_) || offset > capacity_ || need > capacity_ - offset) return std::nullopt;
  const std::uint64_t end = offset + need;
  std::uint32_t b = block_containing(offset);
  if (b != none) {
    const detail::chain_block& x = nodes_[b];
    const std::uint64_t x_end = x.offset + x.bytes;
    // Inside a used block, or past a free block that does not reach the high-water mark.
    if (x.st != detail::block_state::free || (end > x_end && x_end != peak_)) return std::nullopt;
  }
  reserve_for_allocation(2);
  if (b == none) {
    // At or past the high-water mark: the gap [peak, offset) becomes free, merged with a
    // free block that ends at the mark.
    if (offset > peak_) {
      if (tail_ != none && nodes_[tail_].st == detail::block_state::free) {
        unindex_free(tail_);
        nodes_[tail_].bytes += offset - peak_;
        index_free(tail_);
      } else {
        const std::uint32_t g = new_node();
        nodes_[g].offset = peak_;
        nodes_[g].bytes = offset - peak_;
        if (tail_ != none) link_after(tail_, g);
        else head_ = tail_ = g;
        index_free(g);
      }
    }
    const std::uint32_t n = new_node();
    nodes_[n].offset = offset;
    nodes_[n].bytes = need;
    if (tail_ != none) link_after(tail_, n);
    else head_ = tail_ = n;
    peak_ = end;
    return make_used(n, need);
  }
  // Inside free block b: it becomes [offset, end), its pieces before and after stay free.
  unindex_free(b);
  const std::uint64_t b_end = nodes_[b].offset + nodes_[b].bytes;
  if (offset > nodes_[b].offset) {
    const std::uint32_t l = new_node();
    nodes_[l].offset = nodes_[b].offset;
    nodes_[l].bytes = offset - nodes_[b].offset;
    link_before(b, l);
    index_free(l);
  }
  if (end < b_end) {
    const std::uint32_t r = new_node();
    nodes_[r].offset = end;
    nodes_[r].bytes = b_end - end;
    link_after(b, r);
    index_free(r);
  }
  if (end > b_end) peak_ = end;  // the free tail block is extended past the mark
  nodes_[b].offset = offset;
  nodes_[b].bytes = need;
  return make_used(b, need);
}

// Frees used block n and merges it with free neighbours.
void best_fit_allocator::release(std::uint32_t n) noexcept {
  unmake_used(n);
  absorb_free_neighbours(n, [this](std::uint32_t m) { unindex_free(m); });
  index_free(n);
}

allocator_stats best_fit_allocator::stats() const {
  return chain_stats(free_by_size_.size(), free_by_size_.empty() ? 0 : free_by_size_.rbegin()->bytes);
}

std::string best_fit_allocator::check_invariants() const {
  std::size_t free_count = 0;
  std::string error = check_chain(
      [this](std::uint32_t n) -> std::string {
        const detail::chain_block& x = nodes_[n];
        const auto it = free_by_size_.find({x.bytes, x.offset, n});
        if (it == free_by_size_.end() || it->node != n) return "free block missing from size index";
        return {};
      },
      free_count);
  if (!error.empty()) return error;
  if (free_count != free_by_size_.size()) return "size index holds blocks that are not free";
  if (live_count_ != 0 && spare_nodes_.size() + free_by_size_.size() < live_count_ + 1)
    return "too few index nodes for a free";
  return {};
}

}  // namespace tensormem::core
