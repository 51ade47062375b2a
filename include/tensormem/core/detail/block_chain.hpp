#pragma once
// What the two online offset allocators share: the blocks below the high-water mark as a
// chain in address order, checked handles, and freeing by offset. Private to them.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensormem/core/align.hpp"
#include "tensormem/core/allocation.hpp"
#include "tensormem/core/detail/offset_map.hpp"

namespace tensormem::core::detail {

enum class block_state : std::uint8_t { unused, free, used };

/// One block of the arena below the high-water mark, linked to its address neighbours.
/// An allocator's node type derives from it and adds its state (free, used or unused), the
/// generation of a used block, and its free-list links, through these members:
///   block_state state() const; std::uint32_t generation() const (of a used block);
///   void mark_used(std::uint32_t generation); void mark_unused().
/// (A node becomes free when its allocator lists it.)
struct chain_links {
  static constexpr std::uint32_t none = 0xffffffffU;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint32_t prev = none;
  std::uint32_t next = none;
};

/// A node whose state and generation are fields of their own (best_fit_allocator's).
struct chain_block : chain_links {
  std::uint32_t gen = 0;
  block_state st = block_state::unused;

  block_state state() const noexcept { return st; }
  std::uint32_t generation() const noexcept { return gen; }
  void mark_used(std::uint32_t g) noexcept {
    st = block_state::used;
    gen = g;
  }
  void mark_unused() noexcept { st = block_state::unused; }
};

/// Base of an allocator (CRTP) whose blocks are `Node`s in a pool, chained by address.
/// It owns the pool and the counters, checks handles (owner, generation, state, offset,
/// size), and implements `deallocate`/`free` and their `try_` forms on top of
/// `Derived::release(n)`, which frees used node n and merges it. `free(offset, bytes)` finds
/// the node through a hash index of live offsets built by its first call (one walk of the
/// blocks) and kept from then on, so that callers who free by handle never pay for it; if
/// the index cannot be built for lack of memory, that call walks the blocks instead.
template <class Derived, class Node>
class block_chain_allocator {
 public:
  std::uint64_t capacity() const noexcept { return capacity_; }
  std::uint64_t alignment() const noexcept { return alignment_; }
  std::uint64_t peak() const noexcept { return peak_; }
  std::uint64_t used() const noexcept { return used_; }

  /// Frees an allocation made by this allocator. Misuse throws allocator_misuse and changes
  /// nothing.
  void deallocate(const allocation& a) {
    const free_status status = try_deallocate(a);
    if (status == free_status::ok) return;
    const std::uint64_t held = a.node < nodes_.size() ? nodes_[a.node].bytes : 0;
    throw_free_error(name_, status, a.offset, a.bytes, held);
  }

  free_status try_deallocate(const allocation& a) noexcept {
    if (a.owner == owner_ && a.node < nodes_.size()) [[likely]] {
      const Node& x = nodes_[a.node];
      if (x.state() != block_state::used || x.offset != a.offset || x.generation() != a.generation)
        return free_status::stale_handle;
      if (x.bytes != a.bytes) return free_status::size_mismatch;
      derived().release(a.node);
      return free_status::ok;
    }
    // The zero-byte allocation's handle names no node and no owner.
    if (a.node == zero_node && a.bytes == 0) return free_status::ok;
    return a.owner != owner_ ? free_status::foreign_handle : free_status::stale_handle;
  }

  /// InfiniTensor-style free: `bytes` is the size asked for at allocation (rounded here).
  void free(std::uint64_t offset, std::uint64_t bytes) {
    const free_status status = try_free(offset, bytes);
    if (status == free_status::ok) return;
    const std::uint32_t n = find_live(offset);
    throw_free_error(name_, status, offset, bytes, n == offset_map::not_found ? 0 : nodes_[n].bytes);
  }

  free_status try_free(std::uint64_t offset, std::uint64_t bytes) noexcept {
    if (bytes == 0 && offset == 0) return free_status::ok;  // the zero-byte allocation
    if (!indexed_) {
      try {
        build_index();
      } catch (...) {  // no memory for the index: this call walks the blocks instead
      }
    }
    const std::uint32_t n = find_live(offset);
    if (n == offset_map::not_found) return free_status::not_allocated;
    const auto aligned = align_up(bytes, alignment_);
    if (!aligned || *aligned != nodes_[n].bytes) return free_status::size_mismatch;
    derived().release(n);
    return free_status::ok;
  }

  /// The most blocks `reserve` takes: past it, std::length_error.
  static constexpr std::size_t max_reserved_blocks = 0xfffffff0U - 3U;

  /// How many blocks `reserve(blocks)` makes room for: `blocks`, or with a fixed capacity no
  /// more than the arena can ever hold. Blocks tile the arena and none is empty (each holds
  /// at least one alignment unit, the last one at least a byte), so a capacity of C bytes
  /// holds at most ceil(C / alignment) of them.
  std::size_t blocks_to_reserve(std::size_t blocks) const noexcept {
    if (capacity_ == growing) return blocks;
    const std::uint64_t most = capacity_ / alignment_ + (capacity_ % alignment_ != 0 ? 1U : 0U);
    return static_cast<std::size_t>(std::min<std::uint64_t>(blocks, most));
  }

  /// Calls `f(offset, bytes, is_free)` for every block below the high-water mark, in
  /// address order. For tests and pictures; O(n).
  template <class F>
  void for_each_block(F&& f) const {
    for (std::uint32_t n = head_; n != none; n = nodes_[n].next) {
      f(nodes_[n].offset, nodes_[n].bytes, nodes_[n].state() == block_state::free);
    }
  }

 protected:
  static constexpr std::uint32_t none = chain_links::none;
  static constexpr std::uint32_t zero_node = 0xfffffffeU;
  /// Node indices stay below this: the values above mark states in node types that keep
  /// them in a link field.
  static constexpr std::uint32_t most_nodes = 0xfffffff0U;

  block_chain_allocator(std::uint64_t capacity, std::uint64_t alignment, const char* name)
      : capacity_(capacity), alignment_(alignment), owner_(next_owner_id()), name_(name) {
    check_alignment_argument(name, alignment);
  }

  /// A request of `bytes` rounded up to the alignment, or 0 when `bytes` is 0 or does not
  /// round up within 64 bits: a sum past 2^64 wraps to less than the alignment, which the
  /// mask clears (no test needed for either case); `allocate` then returns
  /// `turned_down(bytes)`.
  std::uint64_t round_request(std::uint64_t bytes) const noexcept {
    const std::uint64_t mask = alignment_ - 1U;
    return (bytes + mask) & ~mask;
  }

  /// The answer to a request that round_request turned down: the zero-byte allocation for
  /// 0 bytes, nothing for a size that overflows.
  static std::optional<allocation> turned_down(std::uint64_t bytes) noexcept {
    if (bytes == 0) return allocation{0, 0, zero_node, 0};
    return std::nullopt;
  }

  /// Room for `count` new nodes and their recycling, and for one more live-index entry, so
  /// that the allocation that follows and any later free change state without allocating.
  void reserve_nodes(std::size_t count) {
    if (nodes_.size() + count > nodes_.capacity()) {
      if (nodes_.size() + count >= most_nodes) throw std::length_error(std::string(name_) + ": too many blocks");
      const std::size_t want = std::max<std::size_t>(64, nodes_.capacity() * 2);
      unused_nodes_.reserve(want);
      nodes_.reserve(want);
    }
    if (indexed_) live_.reserve(live_.size() + 1);
  }

  /// Room in the node pool for `blocks` blocks (live and free together) and the two that
  /// reserve_nodes asks for beyond them, and the nodes themselves made (unused), so that
  /// their pages are touched here rather than by a later allocation: while no more blocks
  /// exist, allocating and freeing by handle never grow the pool nor touch a new page of it.
  /// The new nodes go below the recycled ones in the stack of unused nodes, lowest index on
  /// top, so that nodes are handed out in the order they would have been made. Never
  /// shrinks. A fixed capacity caps `blocks` (blocks_to_reserve). Throws std::length_error
  /// past the node limit and std::bad_alloc, changing nothing observable either way.
  void reserve_blocks(std::size_t blocks) {
    static_assert(max_reserved_blocks == most_nodes - 3U);
    blocks = blocks_to_reserve(blocks);
    if (blocks > max_reserved_blocks) throw std::length_error(std::string(name_) + ": too many blocks");
    unused_nodes_.reserve(blocks + 2U);  // (each a no-op where the room is there)
    nodes_.reserve(blocks + 2U);
    if (nodes_.size() >= blocks) return;
    const auto first = static_cast<std::uint32_t>(nodes_.size());
    const auto last = static_cast<std::uint32_t>(blocks);
    nodes_.resize(blocks);  // capacity reserved: cannot throw
    const std::size_t recycled = unused_nodes_.size();
    unused_nodes_.resize(recycled + (last - first));  // capacity reserved: cannot throw
    std::copy_backward(unused_nodes_.begin(), unused_nodes_.begin() + static_cast<std::ptrdiff_t>(recycled),
                       unused_nodes_.end());
    for (std::uint32_t i = 0; i < last - first; ++i) unused_nodes_[i] = last - 1U - i;
  }

  std::uint32_t new_node() noexcept {
    if (!unused_nodes_.empty()) {
      const std::uint32_t n = unused_nodes_.back();
      unused_nodes_.pop_back();
      return n;
    }
    nodes_.emplace_back();  // capacity reserved by reserve_nodes: cannot throw
    return static_cast<std::uint32_t>(nodes_.size() - 1);
  }

  void release_node(std::uint32_t n) noexcept {
    nodes_[n].mark_unused();
    unused_nodes_.push_back(n);  // capacity reserved: nodes_ never shrinks below it
  }

  /// Marks node n (its offset and bytes set) a live allocation of `need` bytes.
  allocation make_used(std::uint32_t n, std::uint64_t need) noexcept {
    Node& x = nodes_[n];
    // Every allocation gets a generation of its own: a handle to a block freed and then
    // allocated again (same node, offset and size) is told apart from the new one.
    const std::uint32_t generation = next_generation_++;
    x.mark_used(generation);
    used_ += need;
    ++live_count_;
    if (indexed_) live_.insert(x.offset, n);
    return allocation{x.offset, need, n, generation, owner_};
  }

  /// The accounting of releasing used node n (before merging).
  void unmake_used(std::uint32_t n) noexcept {
    Node& x = nodes_[n];
    if (indexed_) live_.erase(x.offset);
    --live_count_;
    used_ -= x.bytes;
  }

  /// Links node r right after node n (r's offset and bytes are set by the caller).
  void link_after(std::uint32_t n, std::uint32_t r) noexcept {
    nodes_[r].prev = n;
    nodes_[r].next = nodes_[n].next;
    if (nodes_[n].next != none) nodes_[nodes_[n].next].prev = r;
    else tail_ = r;
    nodes_[n].next = r;
  }

  /// Links node l right before node n.
  void link_before(std::uint32_t n, std::uint32_t l) noexcept {
    nodes_[l].next = n;
    nodes_[l].prev = nodes_[n].prev;
    if (nodes_[n].prev != none) nodes_[nodes_[n].prev].next = l;
    else head_ = l;
    nodes_[n].prev = l;
  }

  /// Node n, just released, absorbs its free address neighbours: each is first taken out of
  /// the free lists by `unlist(m)`, then its node is recycled. n is not listed here.
  template <class Unlist>
  void absorb_free_neighbours(std::uint32_t n, Unlist&& unlist) noexcept {
    Node& x = nodes_[n];
    if (const std::uint32_t p = x.prev; p != none && nodes_[p].state() == block_state::free) {
      unlist(p);
      x.offset = nodes_[p].offset;
      x.bytes += nodes_[p].bytes;
      x.prev = nodes_[p].prev;
      if (x.prev != none) nodes_[x.prev].next = n;
      else head_ = n;
      release_node(p);
    }
    if (const std::uint32_t q = x.next; q != none && nodes_[q].state() == block_state::free) {
      unlist(q);
      x.bytes += nodes_[q].bytes;
      x.next = nodes_[q].next;
      if (x.next != none) nodes_[x.next].prev = n;
      else tail_ = n;
      release_node(q);
    }
  }

  /// The block that holds `offset` (blocks tile [0, peak)), walking back from the end of the
  /// arena; none at or past the high-water mark.
  std::uint32_t block_containing(std::uint64_t offset) const noexcept {
    if (offset >= peak_) return none;
    std::uint32_t n = tail_;
    while (nodes_[n].offset > offset) n = nodes_[n].prev;
    return n;
  }

  /// Blocks in the chain that are not live allocations: every node is in the chain or
  /// waiting in unused_nodes_.
  std::uint64_t free_blocks() const noexcept { return nodes_.size() - unused_nodes_.size() - live_count_; }

  /// The statistics, from the allocator's count of free blocks and its largest free block
  /// (the untouched part of a fixed arena past the high-water mark is added here).
  allocator_stats chain_stats(std::uint64_t free_blocks, std::uint64_t largest_free) const {
    allocator_stats s;
    s.used_bytes = used_;
    s.peak_bytes = peak_;
    s.live_allocations = live_count_;
    const std::uint64_t end = capacity_ == growing ? peak_ : capacity_;
    s.free_bytes = end - used_;
    s.free_blocks = free_blocks;
    s.largest_free_bytes = largest_free;
    const bool tail_free = tail_ != none && nodes_[tail_].state() == block_state::free;
    add_untouched_tail(s, end, peak_, tail_free ? nodes_[tail_].bytes : 0);
    return s;
  }

  /// The invariants of the chain and the counters: blocks tile [0, peak) in order, aligned
  /// and non-empty, no two free neighbours, used bytes, live count and live index agree.
  /// Calls `check_free(n)` for each free block (a non-empty string is an error); counts
  /// the free blocks into `free_count`. Empty string when everything holds.
  template <class CheckFree>
  std::string check_chain(CheckFree&& check_free, std::size_t& free_count) const {
    if (peak_ > capacity_) return "peak above capacity";
    std::uint64_t cursor = 0;
    std::uint64_t used_sum = 0;
    std::size_t used_count = 0;
    free_count = 0;
    std::uint32_t last = none;
    bool prev_free = false;
    for (std::uint32_t n = head_; n != none; n = nodes_[n].next) {
      const Node& x = nodes_[n];
      if (x.prev != last) return "broken neighbour link at offset " + std::to_string(x.offset);
      if (x.offset != cursor) return "gap or overlap at offset " + std::to_string(x.offset);
      if (x.bytes == 0 || !is_aligned(x.bytes, alignment_) || !is_aligned(x.offset, alignment_))
        return "misaligned or empty block at offset " + std::to_string(x.offset);
      if (x.state() == block_state::unused) return "unused node in the address chain";
      const bool is_free = x.state() == block_state::free;
      if (is_free && prev_free) return "unmerged free neighbours at " + std::to_string(x.offset);
      if (is_free) {
        ++free_count;
        if (std::string e = check_free(n); !e.empty()) return e;
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
    if (used_sum != used_) return "used bytes differ from the sum of live allocations";
    if (used_count != live_count_) return "live count differs from live blocks";
    if (indexed_ && live_.size() != live_count_) return "live index size differs from live blocks";
    return {};
  }

  std::uint64_t capacity_;
  std::uint64_t alignment_;
  std::uint64_t owner_;
  const char* name_;
  std::uint64_t peak_ = 0;
  std::uint64_t used_ = 0;
  std::uint64_t live_count_ = 0;
  std::uint32_t next_generation_ = 0;  // of the next allocation (wraps after 2^32)
  std::uint32_t head_ = none;  // node at offset 0
  std::uint32_t tail_ = none;  // node that ends at peak_
  std::vector<Node> nodes_;
  std::vector<std::uint32_t> unused_nodes_;

 private:
  Derived& derived() noexcept { return static_cast<Derived&>(*this); }

  // The offset index, from one walk of the blocks; kept current from then on.
  void build_index() {
    offset_map index;
    index.reserve(live_count_ + 1);
    for (std::uint32_t n = head_; n != none; n = nodes_[n].next) {
      if (nodes_[n].state() == block_state::used) index.insert(nodes_[n].offset, n);
    }
    live_ = std::move(index);
    indexed_ = true;
  }

  // The used node at `offset`: through the index, or (when it could not be built for lack
  // of memory) by walking the blocks.
  std::uint32_t find_live(std::uint64_t offset) const noexcept {
    if (indexed_) return live_.find(offset);
    const std::uint32_t n = block_containing(offset);
    if (n == none || nodes_[n].offset != offset || nodes_[n].state() != block_state::used) return offset_map::not_found;
    return n;
  }

  offset_map live_;       // offset -> node of each live allocation, once indexed_
  bool indexed_ = false;  // set by the first free(offset, bytes)
};

}  // namespace tensormem::core::detail
