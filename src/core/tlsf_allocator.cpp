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
  // No block holds more units than the capacity: a small arena needs fewer lists.
  class_limit_ = capacity == growing ? class_count : class_of_units(capacity >> unit_shift_) + 1U;
  heads_.assign(class_limit_, none);
}

unsigned tlsf_allocator::size_class_ceil(std::uint64_t bytes) const noexcept {
  const std::uint64_t units = bytes >> unit_shift_;
  const auto width = static_cast<unsigned>(std::bit_width(units));
  const unsigned shift = width > mantissa_bits + 1U ? width - mantissa_bits - 1U : 0U;
  const std::uint64_t low_bits = units & ((std::uint64_t{1} << shift) - 1U);
  return class_of_units(units) + (low_bits != 0 ? 1U : 0U);
}

// The first non-empty list at or above class `cls`, or none.
TENSORMEM_HOT_INLINE std::uint32_t tlsf_allocator::list_at_or_above(std::uint32_t cls) const noexcept {
  if (cls >= class_limit_) return none;
  const std::uint32_t word = cls >> 6U;
  if (const std::uint64_t here = bits_[word] & (~std::uint64_t{0} << (cls & 63U)); here != 0) {
    return (word << 6U) | static_cast<std::uint32_t>(std::countr_zero(here));
  }
  std::uint32_t mid = word >> 6U;
  const std::uint32_t next_word = (word & 63U) + 1U;
  std::uint64_t words = next_word < 64U ? mid_[mid] & (~std::uint64_t{0} << next_word) : 0;
  if (words == 0) {
    const std::uint64_t mids = mid + 1U < 64U ? top_ & (~std::uint64_t{0} << (mid + 1U)) : 0;
    if (mids == 0) return none;
    mid = static_cast<std::uint32_t>(std::countr_zero(mids));
    words = mid_[mid];
  }
  const std::uint32_t w = (mid << 6U) | static_cast<std::uint32_t>(std::countr_zero(words));
  return (w << 6U) | static_cast<std::uint32_t>(std::countr_zero(bits_[w]));
}

// List cls's bitmap word has become zero: clears its bit in the middle level, and the
// middle word's bit in the top level if that empties too.
TENSORMEM_HOT_INLINE void tlsf_allocator::drop_empty_word(std::uint32_t cls) noexcept {
  std::uint64_t& mid = mid_[cls >> 12U];
  mid &= ~(std::uint64_t{1} << ((cls >> 6U) & 63U));
  if (mid == 0) top_ &= ~(std::uint64_t{1} << (cls >> 12U));
}

// Takes the head of a non-empty list. Whether the list empties is a coin toss on mixed
// sizes, so it selects by masks instead of branching: a missing next node's link is written
// to n itself, and the list's bit is cleared by a mask that is zero unless the list became
// empty. A bitmap word empties far less often: the levels above it are cleared behind a
// branch, which costs fewer instructions than masks and mispredicts rarely.
TENSORMEM_HOT_INLINE std::uint32_t tlsf_allocator::pop_head(std::uint32_t cls) noexcept {
  const std::uint32_t n = heads_[cls];
  const std::uint32_t next = nodes_[n].next_bin;
  heads_[cls] = next;
  nodes_[n].next_bin = none;
  nodes_[select(next == none, n, next)].prev_bin = none;
  const std::uint64_t emptied = mask64(next == none);
  std::uint64_t& word = bits_[cls >> 6U];
  word &= ~((std::uint64_t{1} << (cls & 63U)) & emptied);
  if (word == 0) drop_empty_word(cls);
  return n;
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

TENSORMEM_HOT_INLINE void tlsf_allocator::list_insert(std::uint32_t n, std::uint64_t bytes) noexcept {
  const std::uint32_t cls = class_of_units(bytes >> unit_shift_);
  std::uint64_t& word = bits_[cls >> 6U];
  const std::uint64_t bit = std::uint64_t{1} << (cls & 63U);
  if ((word & bit) != 0) {
    // Of the new block and the head, the lower offset goes first and the other second
    // (selected by masks: which is lower is a coin toss).
    const std::uint32_t h = heads_[cls];
    const std::uint32_t second = nodes_[h].next_bin;
    const bool lower = nodes_[n].offset < nodes_[h].offset;
    const std::uint32_t a = select(lower, n, h);
    const std::uint32_t b = select(lower, h, n);
    heads_[cls] = a;
    nodes_[a].prev_bin = none;
    nodes_[a].next_bin = b;
    nodes_[b].next_bin = second;
    nodes_[select(second == none, b, second)].prev_bin = b;  // (b's own, if none follows)
    nodes_[b].prev_bin = a;
    return;
  }
  // An empty list: its head is written, never read, and its bit and those above set.
  nodes_[n].prev_bin = nodes_[n].next_bin = none;
  heads_[cls] = n;
  word |= bit;
  mid_[cls >> 12U] |= std::uint64_t{1} << ((cls >> 6U) & 63U);
  top_ |= std::uint64_t{1} << (cls >> 12U);
}

TENSORMEM_HOT_INLINE void tlsf_allocator::list_remove(std::uint32_t n) noexcept {
  const std::uint32_t cls = class_of_units(nodes_[n].bytes >> unit_shift_);
  if (unlink(heads_[cls], n) && (bits_[cls >> 6U] &= ~(std::uint64_t{1} << (cls & 63U))) == 0) {
    drop_empty_word(cls);
  }
}

// Cuts free node n (in no list) to `need` bytes; a new node after it takes the `rest`
// bytes and joins its list.
TENSORMEM_HOT_INLINE void tlsf_allocator::split(std::uint32_t n, std::uint64_t need, std::uint64_t rest) noexcept {
  const std::uint32_t r = new_node();
  nodes_[r].offset = nodes_[n].offset + need;
  nodes_[r].bytes = rest;
  nodes_[n].bytes = need;
  link_after(n, r);
  list_insert(r, rest);
}

std::optional<allocation> tlsf_allocator::allocate(std::uint64_t bytes) {
  const std::uint64_t need = round_request(bytes);
  if (need == 0) return turned_down(bytes);
  // Everything that may allocate or fail happens before any state changes (strong
  // guarantee): room for two new nodes, for their recycling, and for the live map entry.
  reserve_nodes(2);

  const std::uint64_t units = need >> unit_shift_;
  const auto width = static_cast<unsigned>(std::bit_width(units));
  const unsigned shift = width > mantissa_bits + 1U ? width - mantissa_bits - 1U : 0U;
  const std::uint32_t down = (shift << mantissa_bits) + static_cast<std::uint32_t>(units >> shift);
  const bool inexact = (units & ((std::uint64_t{1} << shift) - 1U)) != 0;
  std::uint32_t n = none;
  // The first block of the request's own class, when it may be smaller than the request.
  if (inexact && ((bits_[down >> 6U] >> (down & 63U)) & 1U) != 0 && nodes_[heads_[down]].bytes >= need) {
    n = heads_[down];
    list_remove(n);
  } else if (const std::uint32_t cls = list_at_or_above(down + (inexact ? 1U : 0U)); cls != none) {
    n = pop_head(cls);  // every block of that list holds `need`
  } else if (tail_ != none && nodes_[tail_].state() == detail::block_state::free && nodes_[tail_].bytes >= need) {
    // A free tail that fits but is not the first of its list is still taken before the
    // arena grows.
    n = tail_;
    list_remove(n);
  }

  if (n != none) {
    if (const std::uint64_t have = nodes_[n].bytes; have > need) split(n, need, have - need);
  } else {
    // Grow at the end, extending a free block that ends at the high-water mark.
    // (A free tail of need bytes or more was taken above: extending it never goes negative.)
    const bool extend = tail_ != none && nodes_[tail_].state() == detail::block_state::free;
    const std::uint64_t extra = extend ? need - nodes_[tail_].bytes : need;
    if (extra > capacity_ || peak_ > capacity_ - extra) return std::nullopt;
    if (extend) {
      n = tail_;
      list_remove(n);
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
  absorb_free_neighbours(n, [this](std::uint32_t m) { list_remove(m); });
  list_insert(n, nodes_[n].bytes);
}

allocator_stats tlsf_allocator::stats() const {
  std::uint64_t largest = 0;
  auto highest = [](std::uint64_t bits) { return 63U - static_cast<unsigned>(std::countl_zero(bits)); };
  if (top_ != 0) {  // the largest block is in the highest non-empty list
    const auto mid = highest(top_);
    const auto word = (mid << 6U) | highest(mid_[mid]);
    const auto cls = (word << 6U) | highest(bits_[word]);
    for (std::uint32_t n = heads_[cls]; n != none; n = nodes_[n].next_bin) largest = std::max(largest, nodes_[n].bytes);
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
  std::size_t listed_count = 0;
  // A word at a time: which heads are set, without a branch per list (this runs after every
  // step of the random tests), then a walk of the non-empty lists only.
  for (std::uint32_t w = 0; w < class_words; ++w) {
    const std::uint32_t first = w * 64;
    const std::uint32_t count = first < class_limit_ ? std::min<std::uint32_t>(64, class_limit_ - first) : 0;
    const std::uint64_t listed = non_empty_heads(heads_.data() + first, count);
    if (listed != bits_[w]) {
      const auto cls = first + static_cast<std::uint32_t>(std::countr_zero(listed ^ bits_[w]));
      return "bitmap disagrees with list " + std::to_string(cls);
    }
    for (std::uint64_t bits = listed; bits != 0; bits &= bits - 1) {
      const auto cls = first + static_cast<std::uint32_t>(std::countr_zero(bits));
      std::uint32_t prev = none;
      for (std::uint32_t n = heads_[cls]; n != none; n = nodes_[n].next_bin) {
        const node& x = nodes_[n];
        if (x.state() != detail::block_state::free || class_of_units(x.bytes >> unit_shift_) != cls || x.prev_bin != prev)
          return "list " + std::to_string(cls) + " holds a wrong node";
        prev = n;
        if (++listed_count > free_count) return "lists hold more nodes than free blocks";
      }
    }
  }
  for (std::uint32_t w = 0; w < class_words; ++w) {
    if ((((mid_[w >> 6U] >> (w & 63U)) & 1U) != 0) != (bits_[w] != 0)) return "mid bitmap wrong";
  }
  for (std::uint32_t m = 0; m < mid_words; ++m) {
    if ((((top_ >> m) & 1U) != 0) != (mid_[m] != 0)) return "top bitmap wrong";
  }
  if (listed_count != free_count) return "a free block is in no list";
  return {};
}

}  // namespace tensormem::core
