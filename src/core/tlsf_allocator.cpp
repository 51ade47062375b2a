#include "tensormem/core/tlsf_allocator.hpp"

#include <algorithm>
#include <bit>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

namespace tensormem::core {

// The helpers of allocate and deallocate are inlined into them: the GCC heuristics keep
// several of them out of line, which costs a call per helper on every operation.
#define TENSORMEM_HOT_INLINE [[gnu::always_inline]] inline

namespace {
// a if c else b, and all ones if c else zero, computed without a branch (GCC turns `c ? a : b`
// into a branch here).
[[gnu::always_inline]] inline std::uint32_t select(bool c, std::uint32_t a, std::uint32_t b) noexcept {
  return b ^ ((a ^ b) & (0U - static_cast<std::uint32_t>(c)));
}
[[gnu::always_inline]] inline std::uint64_t mask64(bool c) noexcept { return 0ULL - static_cast<std::uint64_t>(c); }
}  // namespace

tlsf_allocator::tlsf_allocator(std::uint64_t capacity, std::uint64_t alignment)
    : block_chain_allocator(capacity, alignment, "tlsf_allocator") {
  unit_shift_ = static_cast<unsigned>(std::countr_zero(alignment));
  bin_heads_.fill(none);
  // No block holds more units than the capacity: a small arena needs fewer exact lists.
  const std::uint64_t most_units = capacity == growing ? exact_units : capacity >> unit_shift_;
  exact_limit_ = static_cast<std::uint32_t>(std::min<std::uint64_t>(exact_units, most_units + 1));
  exact_heads_.assign(exact_limit_, none);
  exact_bits_.assign((exact_limit_ + 63U) / 64U, 0);
}

// Class of a unit count, rounded down: exact below 2^M, then M mantissa bits per octave.
unsigned tlsf_allocator::floor_class(std::uint64_t bytes) const noexcept {
  return class_of_units(bytes >> unit_shift_);
}

unsigned tlsf_allocator::class_of_units(std::uint64_t units) noexcept {
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

// The smallest unit count at or above `units` whose exact list is non-empty, or none.
TENSORMEM_HOT_INLINE std::uint32_t tlsf_allocator::exact_at_or_above(std::uint64_t units) const noexcept {
  if (units >= exact_limit_) return none;
  const auto u = static_cast<std::uint32_t>(units);
  const std::uint32_t word = u >> 6U;
  if (const std::uint64_t here = exact_bits_[word] & (~std::uint64_t{0} << (u & 63U)); here != 0) {
    return (word << 6U) | static_cast<std::uint32_t>(std::countr_zero(here));
  }
  std::uint32_t mid = word >> 6U;
  const std::uint32_t next_word = (word & 63U) + 1U;
  std::uint64_t words = next_word < 64U ? exact_mid_[mid] & (~std::uint64_t{0} << next_word) : 0;
  if (words == 0) {
    const std::uint64_t mids = mid + 1U < 64U ? exact_top_ & (~std::uint64_t{0} << (mid + 1U)) : 0;
    if (mids == 0) return none;
    mid = static_cast<std::uint32_t>(std::countr_zero(mids));
    words = exact_mid_[mid];
  }
  const std::uint32_t w = (mid << 6U) | static_cast<std::uint32_t>(std::countr_zero(words));
  return (w << 6U) | static_cast<std::uint32_t>(std::countr_zero(exact_bits_[w]));
}

// Exact list u's bitmap word has become zero: clears its bit in the middle level, and the
// middle word's bit in the top level if that empties too.
TENSORMEM_HOT_INLINE void tlsf_allocator::drop_empty_word(std::uint32_t u) noexcept {
  std::uint64_t& mid = exact_mid_[u >> 12U];
  mid &= ~(std::uint64_t{1} << ((u >> 6U) & 63U));
  if (mid == 0) exact_top_ &= ~(std::uint64_t{1} << (u >> 12U));
}

// Takes the head of a non-empty exact list. Whether the list empties is a coin toss on
// mixed sizes, so it selects by masks instead of branching: a missing next node's link is
// written to n itself, and the list's bit is cleared by a mask that is zero unless the list
// became empty. A bitmap word empties far less often: the levels above it are cleared
// behind a branch, which costs fewer instructions than masks and mispredicts rarely.
TENSORMEM_HOT_INLINE std::uint32_t tlsf_allocator::pop_exact(std::uint32_t u) noexcept {
  const std::uint32_t n = exact_heads_[u];
  const std::uint32_t next = nodes_[n].next_bin;
  exact_heads_[u] = next;
  nodes_[n].next_bin = none;
  nodes_[select(next == none, n, next)].prev_bin = none;
  const std::uint64_t emptied = mask64(next == none);
  std::uint64_t& word = exact_bits_[u >> 6U];
  word &= ~((std::uint64_t{1} << (u & 63U)) & emptied);
  if (word == 0) drop_empty_word(u);
  return n;
}

// Links node n at the front of the list that starts at `head`.
TENSORMEM_HOT_INLINE void tlsf_allocator::push_front(std::uint32_t& head, std::uint32_t n) noexcept {
  node& x = nodes_[n];
  x.prev_bin = none;
  x.next_bin = head;
  head = n;
  if (x.next_bin != none) nodes_[x.next_bin].prev_bin = n;
}

// Unlinks node n from the list that starts at `head`; true if the list is now empty. The
// node stays free, in no list.
TENSORMEM_HOT_INLINE bool tlsf_allocator::unlink(std::uint32_t& head, std::uint32_t n) noexcept {
  node& x = nodes_[n];
  const std::uint32_t prev = x.prev_bin;
  const std::uint32_t next = x.next_bin;
  x.prev_bin = x.next_bin = none;
  if (next != none) nodes_[next].prev_bin = prev;
  if (prev != none) {
    nodes_[prev].next_bin = next;
    return false;
  }
  head = next;
  return next == none;
}

TENSORMEM_HOT_INLINE void tlsf_allocator::bin_insert(std::uint32_t n, std::uint64_t bytes) noexcept {
  if (const std::uint64_t units = bytes >> unit_shift_; units < exact_limit_) {
    const auto u = static_cast<std::uint32_t>(units);
    std::uint64_t& word = exact_bits_[u >> 6U];
    const std::uint64_t bit = std::uint64_t{1} << (u & 63U);
    if ((word & bit) != 0) {
      // Of the new block and the head, the lower offset goes first and the other second
      // (selected by masks: which is lower is a coin toss).
      const std::uint32_t h = exact_heads_[u];
      const std::uint32_t second = nodes_[h].next_bin;
      const bool lower = nodes_[n].offset < nodes_[h].offset;
      const std::uint32_t a = select(lower, n, h);
      const std::uint32_t b = select(lower, h, n);
      exact_heads_[u] = a;
      nodes_[a].prev_bin = none;
      nodes_[a].next_bin = b;
      nodes_[b].next_bin = second;
      nodes_[select(second == none, b, second)].prev_bin = b;  // (b's own, if none follows)
      nodes_[b].prev_bin = a;
      return;
    }
    // An empty list: its head is written, never read (most heads are empty and out of cache,
    // and the bitmap word, read anyway, already says so), and its bit and those above set.
    nodes_[n].prev_bin = nodes_[n].next_bin = none;
    exact_heads_[u] = n;
    word |= bit;
    exact_mid_[u >> 12U] |= std::uint64_t{1} << ((u >> 6U) & 63U);
    exact_top_ |= std::uint64_t{1} << (u >> 12U);
    return;
  }
  const unsigned cls = floor_class(bytes);
  push_front(bin_heads_[cls], n);
  ++bin_length_[cls];
  window_max_[cls] = std::max(window_max_[cls], bytes);
  top_bitmap_ |= std::uint64_t{1} << (cls >> mantissa_bits);
  leaf_bitmaps_[cls >> mantissa_bits] |= std::uint64_t{1} << (cls & (leaf_bins - 1U));
}

TENSORMEM_HOT_INLINE void tlsf_allocator::bin_remove(std::uint32_t n) noexcept {
  const std::uint64_t bytes = nodes_[n].bytes;
  if (const std::uint64_t units = bytes >> unit_shift_; units < exact_limit_) {
    const auto u = static_cast<std::uint32_t>(units);
    if (unlink(exact_heads_[u], n) && (exact_bits_[u >> 6U] &= ~(std::uint64_t{1} << (u & 63U))) == 0) {
      drop_empty_word(u);
    }
    return;
  }
  const unsigned cls = floor_class(bytes);
  // A block from beyond the window may move into it: its largest size is no longer known.
  if (--bin_length_[cls] >= scan_limit) window_max_[cls] = ~std::uint64_t{0};
  else if (bin_length_[cls] == 0) window_max_[cls] = 0;
  if (unlink(bin_heads_[cls], n)) {
    const unsigned top = cls >> mantissa_bits;
    leaf_bitmaps_[top] &= ~(std::uint64_t{1} << (cls & (leaf_bins - 1U)));
    if (leaf_bitmaps_[top] == 0) top_bitmap_ &= ~(std::uint64_t{1} << top);
  }
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

// Cuts free node n (in no list) to `need` bytes; a new node after it takes the `rest`
// bytes and joins its list.
TENSORMEM_HOT_INLINE void tlsf_allocator::split(std::uint32_t n, std::uint64_t need, std::uint64_t rest) noexcept {
  const std::uint32_t r = new_node();
  nodes_[r].offset = nodes_[n].offset + need;
  nodes_[r].bytes = rest;
  nodes_[n].bytes = need;
  link_after(n, r);
  bin_insert(r, rest);
}

std::optional<allocation> tlsf_allocator::allocate(std::uint64_t bytes) {
  const std::uint64_t need = round_request(bytes);
  if (need == 0) return turned_down(bytes);
  // Everything that may allocate or fail happens before any state changes (strong
  // guarantee): room for two new nodes, for their recycling, and for the live map entry.
  reserve_nodes(2);

  std::uint32_t n = none;
  if (const std::uint64_t units = need >> unit_shift_; units < exact_units) {
    if (const std::uint32_t u = exact_at_or_above(units); u != none) {
      // Whether to split, and the remainder's list, follow from the bitmaps alone: those
      // branches resolve without waiting for the block's node to load.
      n = pop_exact(u);
      if (u != units) split(n, need, (std::uint64_t{u} << unit_shift_) - need);
      return make_used(n, need);
    }
    if (const std::uint32_t cls = first_bin_at_or_above(class_of_units(exact_units)); cls != none) {
      n = best_in_bin(cls, need);  // every listed block holds exact_units or more
    }
  } else {
    const unsigned down = floor_class(need);
    const unsigned up = ceil_class(need);
    if (down != up && window_max_[down] >= need) n = best_in_bin(down, need);
    if (n == none) {
      const std::uint32_t cls = first_bin_at_or_above(up);
      if (cls != none) n = best_in_bin(cls, need);
    }
  }
  // A free tail that fits but sits beyond the scan limit of its list is still taken before
  // the arena grows.
  if (n == none && tail_ != none && nodes_[tail_].state() == detail::block_state::free &&
      nodes_[tail_].bytes >= need) {
    n = tail_;
  }

  if (n != none) {
    bin_remove(n);
    if (nodes_[n].bytes > need) split(n, need, nodes_[n].bytes - need);
  } else {
    // Grow at the end, extending a free block that ends at the high-water mark.
    // (A free tail of need bytes or more was taken above: extending it never goes negative.)
    const bool extend = tail_ != none && nodes_[tail_].state() == detail::block_state::free && nodes_[tail_].bytes < need;
    const std::uint64_t extra = extend ? need - nodes_[tail_].bytes : need;
    if (extra > capacity_ || peak_ > capacity_ - extra) return std::nullopt;
    if (extend) {
      n = tail_;
      bin_remove(n);
      nodes_[n].bytes = need;
    } else {
      n = new_node();
      nodes_[n].offset = peak_;
      nodes_[n].bytes = need;
      if (tail_ != none) link_after(tail_, n);
      else head_ = tail_ = n;
    }
    peak_ += extra;
  }
  return make_used(n, need);
}

// Frees node n (a used node) and merges it with free neighbours.
void tlsf_allocator::release(std::uint32_t n) noexcept {
  unmake_used(n);
  absorb_free_neighbours(n, [this](std::uint32_t m) { bin_remove(m); });
  bin_insert(n, nodes_[n].bytes);
}

allocator_stats tlsf_allocator::stats() const {
  std::uint64_t largest = 0;
  auto highest = [](std::uint64_t bits) { return 63U - static_cast<unsigned>(std::countl_zero(bits)); };
  if (top_bitmap_ != 0) {
    const auto top = highest(top_bitmap_);
    const auto leaf = highest(leaf_bitmaps_[top]);
    for (std::uint32_t n = bin_heads_[(top << mantissa_bits) | leaf]; n != none;
         n = nodes_[n].next_bin) {
      largest = std::max(largest, nodes_[n].bytes);
    }
  } else if (exact_top_ != 0) {  // every exact list holds less than any class list
    const auto mid = highest(exact_top_);
    const auto word = (mid << 6U) | highest(exact_mid_[mid]);
    largest = std::uint64_t{(word << 6U) | highest(exact_bits_[word])} << unit_shift_;
  }
  return chain_stats(free_blocks(), largest);
}

namespace {
// Bit k set when heads[k] is a node (not `none`), for k < count <= 64.
std::uint64_t non_empty_heads(const std::uint32_t* heads, std::uint32_t count) noexcept {
  constexpr std::uint32_t none = detail::chain_links::none;
  std::uint64_t listed = 0;
  std::uint32_t k = 0;
#ifdef __SSE2__
  const __m128i empty = _mm_set1_epi32(static_cast<int>(none));
  for (; k + 4 <= count; k += 4) {
    const __m128i four = _mm_loadu_si128(reinterpret_cast<const __m128i*>(heads + k));
    const int is_empty = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(four, empty)));
    listed |= std::uint64_t{static_cast<unsigned>(~is_empty) & 0xFU} << k;
  }
#endif
  for (; k < count; ++k) listed |= std::uint64_t{heads[k] != none} << k;
  return listed;
}
}  // namespace

std::string tlsf_allocator::check_invariants() const {
  std::size_t free_count = 0;
  if (std::string error = check_chain([](std::uint32_t) { return std::string(); }, free_count); !error.empty())
    return error;
  if (free_count != free_blocks()) return "free block count is wrong";
  std::size_t binned = 0;
  // The exact lists a word at a time: which heads are set, without a branch per list (this
  // runs after every step of the random tests), then a walk of the non-empty lists only.
  for (std::uint32_t w = 0; w * 64 < exact_limit_; ++w) {
    const std::uint32_t first = w * 64;
    const std::uint32_t count = std::min<std::uint32_t>(64, exact_limit_ - first);
    const std::uint64_t listed = non_empty_heads(exact_heads_.data() + first, count);
    if (listed != exact_bits_[w]) {
      const auto u = first + static_cast<std::uint32_t>(std::countr_zero(listed ^ exact_bits_[w]));
      return "bitmap disagrees with exact list " + std::to_string(u);
    }
    for (std::uint64_t bits = listed; bits != 0; bits &= bits - 1) {
      const auto u = first + static_cast<std::uint32_t>(std::countr_zero(bits));
      std::uint32_t prev = none;
      for (std::uint32_t n = exact_heads_[u]; n != none; n = nodes_[n].next_bin) {
        const node& x = nodes_[n];
        if (x.state() != detail::block_state::free || x.bytes != std::uint64_t{u} << unit_shift_ || x.prev_bin != prev)
          return "exact list " + std::to_string(u) + " holds a wrong node";
        prev = n;
        if (++binned > free_count) return "lists hold more nodes than free blocks";
      }
    }
  }
  for (std::uint32_t w = 0; w < exact_bits_.size(); ++w) {
    if ((((exact_mid_[w >> 6U] >> (w & 63U)) & 1U) != 0) != (exact_bits_[w] != 0)) return "exact mid bitmap wrong";
  }
  for (std::uint32_t m = 0; m < exact_mid_.size(); ++m) {
    if ((((exact_top_ >> m) & 1U) != 0) != (exact_mid_[m] != 0)) return "exact top bitmap wrong";
  }
  for (unsigned cls = 0; cls < bin_count; ++cls) {
    const bool bit = ((leaf_bitmaps_[cls >> mantissa_bits] >> (cls & (leaf_bins - 1U))) & 1U) != 0;
    if (bit != (bin_heads_[cls] != none)) return "bitmap disagrees with list " + std::to_string(cls);
    std::uint32_t prev = none;
    for (std::uint32_t n = bin_heads_[cls]; n != none; n = nodes_[n].next_bin) {
      const node& x = nodes_[n];
      if (x.state() != detail::block_state::free || floor_class(x.bytes) != cls || x.prev_bin != prev ||
          (x.bytes >> unit_shift_) < exact_limit_)
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
