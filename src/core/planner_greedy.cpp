// Greedy placement strategies of the planner.

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <exception>
#include <limits>
#include <numbers>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "event_sort.hpp"
#include "planner_detail.hpp"
#include "tensormem/core/planner.hpp"
#include "tensormem/core/align.hpp"
#include "tensormem/core/detail/thread_start.hpp"

namespace tensormem::core::detail {

plan_problem make_problem(std::span<const buffer> buffers, std::uint64_t alignment) {
  static_assert(max_plan_buffers < plan_problem::start_event);
  if (buffers.size() > max_plan_buffers) {
    throw std::length_error("plan: " + std::to_string(buffers.size()) + " buffers; at most 2^31 - 1 are planned");
  }
  plan_problem p;
  const std::size_t n = buffers.size();
  p.bytes.resize(n);
  p.length.resize(n);
  p.lo.resize(n);
  p.hi.resize(n);
  // One sort of the lifetime events serves the sections, the lower bound and the first
  // plan's replay: by time, then ends before starts, then by buffer index (the order in
  // which they are laid out here, which the stable sort keeps).
  std::vector<std::pair<std::uint64_t, std::uint32_t>> events(2 * n);
  for (std::uint32_t i = 0; i < n; ++i) {
    const buffer& b = buffers[i];
    p.bytes[i] = align_up(b.bytes, alignment).value_or(b.bytes);
    p.length[i] = b.upper - b.lower;
    events[i] = {b.upper, i};
    events[n + i] = {b.lower, i | plan_problem::start_event};
  }
  stable_sort_by_time(events);
  p.events.resize(2 * n);
  std::uint32_t section = 0;
  std::uint64_t live = 0;
  for (std::size_t e = 0; e < events.size(); ++e) {
    const auto [time, code] = events[e];
    if (e != 0 && time != events[e - 1].first) ++section;
    p.events[e] = code;
    const std::uint32_t i = code & ~plan_problem::start_event;
    if ((code & plan_problem::start_event) != 0) {
      p.lo[i] = section;
      live += p.bytes[i];  // make_problem's callers checked that the sizes add up in 64 bits
      p.lower_bound = std::max(p.lower_bound, live);
    } else {
      p.hi[i] = section;
      p.longest = std::max(p.longest, section - p.lo[i]);
      live -= p.bytes[i];
    }
  }
  p.sections = section;
  return p;
}

std::vector<std::uint64_t> peak_live_over_span(const plan_problem& p) {
  const std::size_t sections = std::max<std::size_t>(p.sections, 1);
  // Leaves at [sections, 2 * sections): the bytes alive in each section (a difference array
  // summed in place; unsigned wrap-around is exact, the true sums fit in 64 bits).
  std::vector<std::uint64_t> tree(2 * sections, 0);
  for (std::size_t i = 0; i < p.size(); ++i) {
    tree[sections + p.lo[i]] += p.bytes[i];
    if (p.hi[i] < sections) tree[sections + p.hi[i]] -= p.bytes[i];
  }
  for (std::size_t s = 1; s < sections; ++s) tree[sections + s] += tree[sections + s - 1];
  for (std::size_t k = sections - 1; k >= 1; --k) tree[k] = std::max(tree[2 * k], tree[2 * k + 1]);
  std::vector<std::uint64_t> peak(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    std::uint64_t most = 0;
    for (std::size_t l = sections + p.lo[i], r = sections + p.hi[i]; l < r; l >>= 1, r >>= 1) {
      if ((l & 1) != 0) most = std::max(most, tree[l++]);
      if ((r & 1) != 0) most = std::max(most, tree[--r]);
    }
    peak[i] = most;
  }
  return peak;
}

std::vector<double> contention_keys(const plan_problem& p) {
  if (p.lower_bound == 0) throw std::logic_error("contention_keys: a lower bound of zero");
  const std::vector<std::uint64_t> peak = peak_live_over_span(p);
  const double bound = static_cast<double>(p.lower_bound);
  std::vector<double> key(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double share = static_cast<double>(peak[i]) / bound;
    key[i] = p.bytes[i] == 0 ? -std::numeric_limits<double>::infinity()
                             : std::log(static_cast<double>(p.bytes[i])) + contention_exponent * std::log(share);
  }
  return key;
}

void raise_buffers_above(const plan_problem& p, std::span<const std::uint64_t> offsets,
                         std::vector<double>& key) {
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (offsets[i] + p.bytes[i] > p.lower_bound) key[i] += std::numbers::ln2;
  }
}

std::uint64_t arena_of(const plan_problem& p, std::span<const std::uint64_t> offsets) {
  std::uint64_t arena = 0;
  for (std::size_t i = 0; i < p.size(); ++i) arena = std::max(arena, offsets[i] + p.bytes[i]);
  return arena;
}

namespace {

/// Restores a heap (std::make_heap order under `later`) after the key of heap[0] grew: one
/// sift-down, half the work of a pop and a push.
template <typename T, typename Later>
void sift_down_top(std::span<T> heap, Later later) {
  if (heap.empty()) return;
  std::size_t i = 0;
  const T moving = heap[0];
  const std::size_t n = heap.size();
  while (true) {
    std::size_t child = 2 * i + 1;
    if (child >= n) break;
    if (child + 1 < n && later(heap[child], heap[child + 1])) ++child;
    if (!later(moving, heap[child])) break;
    heap[i] = heap[child];
    i = child;
  }
  heap[i] = moving;
}

}  // namespace

occupancy_index::occupancy_index(std::uint32_t sections, std::uint32_t longest)
    : leaves_(1), levels_(static_cast<std::size_t>(std::bit_width(longest))) {
  while (leaves_ < sections + std::size_t{1}) leaves_ <<= 1;
  alive_.resize(2 * leaves_);
  started_.resize(2 * leaves_);
}

void occupancy_index::clear() {
  // The sets keep their blocks for the next use.
  for (auto& v : alive_) v.count = 0;
  for (auto& v : started_) v.count = 0;
}

range_blocks& range_blocks::operator=(range_blocks&& other) noexcept {
  chunks_ = std::move(other.chunks_);
  other.chunks_.clear();
  next_ = std::exchange(other.next_, nullptr);
  end_ = std::exchange(other.end_, nullptr);
  carved_ = std::exchange(other.carved_, 0);
  free_ = std::exchange(other.free_, {});
  return *this;
}

range_blocks::range* range_blocks::take(unsigned log_capacity) {
  if (range* block = free_[log_capacity]; block != nullptr) {
    free_[log_capacity] = reinterpret_cast<range*>(static_cast<std::uintptr_t>(block->first));
    return block;
  }
  const std::size_t size = std::size_t{1} << log_capacity;
  if (static_cast<std::size_t>(end_ - next_) < size) {
    // Chunks double from 4 KiB to 1 MiB, so that a small plan stays cheap.
    const auto last = static_cast<std::size_t>(chunks_.empty() ? 0 : end_ - chunks_.back().get());
    const std::size_t grown = last == 0 ? 256 : std::min<std::size_t>(2 * last, std::size_t{1} << 16);
    const std::size_t chunk = std::max(grown, size);
    chunks_.push_back(std::make_unique<range[]>(chunk));
    next_ = chunks_.back().get();
    end_ = next_ + chunk;
  }
  range* block = next_;
  next_ += size;
  carved_ += size;
  return block;
}

static_assert(sizeof(std::uintptr_t) <= sizeof(std::uint64_t), "a free block keeps its successor in a range");

void range_blocks::give(range* block, unsigned log_capacity) noexcept {
  block->first = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(free_[log_capacity]));
  free_[log_capacity] = block;
}

void occupancy_index::add(range_set& set, std::uint64_t offset, std::uint64_t end) {
  range* const items = set.items;
  range* const stop = items + set.count;
  // First range that ends at or after `offset` (touching ranges merge too).
  range* first = std::lower_bound(items, stop, offset,
                                  [](const range& r, std::uint64_t v) { return r.second < v; });
  range* last = first;
  while (last != stop && last->first <= end) {
    offset = std::min(offset, last->first);
    end = std::max(end, last->second);
    ++last;
  }
  if (first != last) {  // merged: the ranges it absorbed go
    *first = {offset, end};
    std::copy(last, stop, first + 1);
    set.count -= static_cast<std::uint32_t>(last - first - 1);
    return;
  }
  if (set.count < set.capacity()) {
    std::copy_backward(first, stop, stop + 1);
    *first = {offset, end};
    ++set.count;
    return;
  }
  // Full: a block twice the size (one range at first), the old block to its free list.
  const unsigned log_capacity = items == nullptr ? 0U : set.log_capacity + 1U;
  range* grown = blocks_.take(log_capacity);
  range* at = std::copy(items, first, grown);
  *at = {offset, end};
  std::copy(first, stop, at + 1);
  if (items != nullptr) blocks_.give(items, set.log_capacity);
  set.items = grown;
  set.log_capacity = static_cast<std::uint8_t>(log_capacity);
  ++set.count;
}

void occupancy_index::insert(std::uint32_t lo, std::uint32_t hi, std::uint64_t offset,
                             std::uint64_t end) {
  // Nodes at levels_ and above are wider than any span: neither set is ever used there.
  for (std::size_t l = lo + leaves_, r = hi + leaves_; l < r; l >>= 1, r >>= 1) {
    if (l & 1U) add(alive_[l++], offset, end);
    if (r & 1U) add(alive_[--r], offset, end);
  }
  for (std::size_t level = 0, a = lo + leaves_; level < levels_ && a >= 1; ++level, a >>= 1) {
    add(started_[a], offset, end);
  }
}

template <class Visit>
void occupancy_index::for_each_set(std::uint32_t lo, std::uint32_t hi, Visit&& visit) const {
  // Alive in section lo: on the path from its leaf up.
  for (std::size_t level = 0, a = lo + leaves_; level < levels_ && a >= 1; ++level, a >>= 1) {
    visit(alive_[a]);
  }
  // Started in (lo, hi): the nodes that cover [lo + 1, hi).
  for (std::size_t l = lo + 1 + leaves_, r = hi + leaves_; l < r; l >>= 1, r >>= 1) {
    if (l & 1U) visit(started_[l++]);
    if (r & 1U) visit(started_[--r]);
  }
}

void occupancy_index::collect(std::uint32_t lo, std::uint32_t hi, std::vector<range>& out) {
  out.clear();
  runs_.assign(1, 0);
  auto append = [&](const range_set& set) {
    if (set.empty()) return;
    out.insert(out.end(), set.begin(), set.end());
    runs_.push_back(out.size());
  };
  for_each_set(lo, hi, append);
  // Every set is sorted and disjoint: merge the runs pairwise into their union (touching
  // ranges fuse), O(N log runs), and smaller at each round.
  std::size_t begin = 0;  // where the current merged run starts in scratch_
  auto push = [this, &begin](const range& r) {
    if (scratch_.size() > begin && scratch_.back().second >= r.first) {
      scratch_.back().second = std::max(scratch_.back().second, r.second);
    } else {
      scratch_.push_back(r);
    }
  };
  while (runs_.size() > 2) {
    scratch_.clear();
    std::size_t kept = 1;
    std::size_t i = 1;
    for (; i + 1 < runs_.size(); i += 2) {
      std::size_t x = runs_[i - 1];
      std::size_t y = runs_[i];
      const std::size_t x_end = runs_[i];
      const std::size_t y_end = runs_[i + 1];
      begin = scratch_.size();
      while (x < x_end || y < y_end) {
        if (y == y_end || (x < x_end && out[x].first <= out[y].first)) push(out[x++]);
        else push(out[y++]);
      }
      runs_[kept++] = scratch_.size();
    }
    if (i < runs_.size()) {  // an odd run out is copied as it is
      scratch_.insert(scratch_.end(), out.begin() + static_cast<std::ptrdiff_t>(runs_[i - 1]),
                      out.end());
      runs_[kept++] = scratch_.size();
    }
    runs_.resize(kept);
    out.swap(scratch_);
  }
}

std::uint64_t occupancy_index::first_fit(std::uint32_t lo, std::uint32_t hi, std::uint64_t bytes,
                                         std::uint64_t from) {
  cursors_.clear();
  auto append = [&](const range_set& set) {
    if (!set.empty()) cursors_.push_back({set.items[0].first, set.begin(), set.end()});
  };
  for_each_set(lo, hi, append);
  // A min-heap of the sets' next ranges by offset: the union is walked from the bottom, and
  // the first gap of `bytes` or more at or above `from` below the next range is the answer.
  auto later = [](const cursor& x, const cursor& y) { return x.offset > y.offset; };
  std::make_heap(cursors_.begin(), cursors_.end(), later);
  std::uint64_t top = from;  // end of the union walked so far, or `from`
  std::size_t n = cursors_.size();
  while (n != 0) {
    cursor& c = cursors_[0];
    if (c.offset > top && c.offset - top >= bytes) return top;
    top = std::max(top, c.next->second);
    // Replace the top by its set's next range that ends above `top` (or by the last entry)
    // and sift it down. Ranges wholly below `top` are skipped by a galloping search.
    ++c.next;
    if (c.next != c.end && c.next->second <= top) {
      const range* low = c.next;  // ends at or below top
      auto left = [&] { return static_cast<std::size_t>(c.end - low); };
      std::size_t step = 1;
      while (step < left() && low[step].second <= top) {
        low += step;
        step *= 2;
      }
      c.next = std::upper_bound(low + 1, low + std::min(step, left()), top,
                                [](std::uint64_t v, const range& x) { return v < x.second; });
    }
    if (c.next != c.end) {
      c.offset = c.next->first;
    } else {
      c = cursors_[--n];
    }
    sift_down_top(std::span(cursors_.data(), n), later);
  }
  return top;
}

candidate_plan place_in_order(const plan_problem& p, std::span<const std::uint32_t> order,
                              fit policy, occupancy_index& index, deadline_or_stop deadline) {
  constexpr std::uint64_t unplaced = std::numeric_limits<std::uint64_t>::max();
  candidate_plan out;
  out.offsets.assign(p.size(), unplaced);
  index.clear();
  std::vector<occupancy_index::range> taken;
  std::uint64_t arena = 0;
  std::size_t placed = 0;
  for (const std::uint32_t b : order) {
    if ((++placed & 255U) == 0 && deadline.passed()) return {};
    const std::uint64_t need = p.bytes[b];
    std::uint64_t chosen = unplaced;
    if (policy == fit::first) {
      chosen = index.first_fit(p.lo[b], p.hi[b], need);
    } else {
      taken.clear();
      index.collect(p.lo[b], p.hi[b], taken);
      std::uint64_t cursor = 0;
      std::uint64_t chosen_gap = unplaced;
      for (const auto& [offset, end] : taken) {
        if (offset > cursor) {
          const std::uint64_t gap = offset - cursor;
          if (gap >= need && gap < chosen_gap) {
            chosen = cursor;
            chosen_gap = gap;
          }
        }
        cursor = std::max(cursor, end);
      }
      if (chosen == unplaced) chosen = cursor;  // above the highest conflicting buffer
    }
    out.offsets[b] = chosen;
    arena = std::max(arena, chosen + need);
    if (need != 0) index.insert(p.lo[b], p.hi[b], chosen, chosen + need);
  }
  out.arena = arena;
  return out;
}

namespace {

// The median start section (p not empty).
std::uint32_t median_start(const plan_problem& p) {
  std::vector<std::uint32_t> starts(p.lo);
  auto at = starts.begin() + static_cast<std::ptrdiff_t>(p.size() / 2);
  std::nth_element(starts.begin(), at, starts.end());
  return *at;
}

}  // namespace

std::size_t buffers_across_median_start(const plan_problem& p) {
  if (p.size() == 0) return 0;
  const std::uint32_t cut = median_start(p);
  std::size_t across = 0;
  for (std::size_t b = 0; b < p.size(); ++b) if (p.lo[b] < cut && p.hi[b] > cut) ++across;
  return across;
}

candidate_plan place_first_fit_split(const plan_problem& p, std::span<const std::uint32_t> order,
                                     deadline_or_stop deadline) {
  const std::size_t n = p.size();
  if (n == 0) return {};
  // The cut: the median start section. side 0: before it, 1: after it, 2: alive across it.
  const std::uint32_t cut = median_start(p);
  std::vector<std::uint8_t> side(n);
  for (std::size_t b = 0; b < n; ++b) {
    side[b] = p.hi[b] <= cut ? 0 : p.lo[b] >= cut ? 1 : 2;
  }
  // Section spans in each side's index: [0, cut) and [cut, sections) renumbered from 0.
  occupancy_index index[2] = {occupancy_index(cut, p.longest), occupancy_index(p.sections - cut, p.longest)};
  auto span_in = [&](std::uint32_t b, int s) {
    return s == 0 ? std::pair{p.lo[b], std::min(p.hi[b], cut)}
                  : std::pair{std::max(p.lo[b], cut) - cut, p.hi[b] - cut};
  };
  candidate_plan out;
  out.offsets.assign(n, 0);
  auto place = [&](std::uint32_t b, int s, std::uint64_t at) {
    out.offsets[b] = at;
    if (p.bytes[b] == 0) return;
    const auto [lo, hi] = span_in(b, s);
    index[s].insert(lo, hi, at, at + p.bytes[b]);
  };
  std::atomic<bool> stopped{false};
  std::barrier sync(2);
  // Each thread places its side's buffers between two crossing buffers; then both wait, side 0
  // places the crossing buffer in both indexes, and both wait again.
  auto place_side = [&](int s) {
    std::size_t count = 0;
    for (std::size_t i = 0; i <= order.size(); ++i) {
      const std::uint32_t b = i < order.size() ? order[i] : 0;
      if (i < order.size() && side[b] == s) {
        if ((++count & 255U) == 0 && deadline.passed()) {
          stopped.store(true, std::memory_order_relaxed);
          // Skip to the next crossing buffer, where both sides meet.
          while (i + 1 < order.size() && side[order[i + 1]] != 2) ++i;
          continue;
        }
        const auto [lo, hi] = span_in(b, s);
        place(b, s, index[s].first_fit(lo, hi, p.bytes[b]));
        continue;
      }
      if (i < order.size() && side[b] != 2) continue;
      sync.arrive_and_wait();  // both sides are placed up to here
      if (stopped.load(std::memory_order_relaxed) || i == order.size()) {
        index[s] = occupancy_index(0, 0);  // each side releases its index, both at once
        return;
      }
      if (s == 0) {
        // The lowest offset free on both sides: raise it until both agree.
        const auto [lo0, hi0] = span_in(b, 0);
        const auto [lo1, hi1] = span_in(b, 1);
        std::uint64_t at = index[0].first_fit(lo0, hi0, p.bytes[b]);
        for (;;) {
          const std::uint64_t right = index[1].first_fit(lo1, hi1, p.bytes[b], at);
          if (right == at) break;
          at = index[0].first_fit(lo0, hi0, p.bytes[b], right);
          if (at == right) break;
        }
        place(b, 0, at);
        place(b, 1, at);
      }
      sync.arrive_and_wait();  // the crossing buffer is in both indexes
    }
  };
  // A side that throws (std::bad_alloc in its index) drops out of the barrier, so that the
  // other goes on alone to the next crossing buffer and stops there; the first exception is
  // rethrown once both have ended.
  std::exception_ptr error[2];
  auto work = [&](int s) {
    prepare_thread_for_exceptions();
    try {
      place_side(s);
    } catch (...) {
      error[s] = std::current_exception();
      stopped.store(true);
      sync.arrive_and_drop();
    }
  };
  {
    const std::jthread right = start_thread(work, 1);
    work(0);
  }
  for (const std::exception_ptr& e : error) {
    if (e) std::rethrow_exception(e);
  }
  if (stopped.load()) return {};
  out.arena = arena_of(p, out.offsets);
  return out;
}

namespace {

/// Floors of the skyline: a segment tree over sections with range "raise to at least v" and
/// range maximum, both iterative and O(log S). `tag` holds raises that cover a node's whole
/// range, `agg` the maximum anywhere below a node.
class skyline {
 public:
  explicit skyline(std::uint32_t sections) : leaves_(1) {
    while (leaves_ < sections + std::size_t{1}) leaves_ <<= 1;
    tag_.assign(2 * leaves_, 0);
    agg_.assign(2 * leaves_, 0);
  }

  std::uint64_t max(std::uint32_t lo, std::uint32_t hi) const {
    std::uint64_t m = 0;
    for (std::size_t l = lo + leaves_, r = hi + leaves_; l < r; l >>= 1, r >>= 1) {
      if (l & 1U) m = std::max(m, agg_[l++]);
      if (r & 1U) m = std::max(m, agg_[--r]);
    }
    for (std::size_t a = (lo + leaves_) >> 1, b = (hi - 1 + leaves_) >> 1; a >= 1;
         a >>= 1, b >>= 1) {
      m = std::max({m, tag_[a], tag_[b]});
    }
    return m;
  }

  void raise(std::uint32_t lo, std::uint32_t hi, std::uint64_t v) {
    for (std::size_t l = lo + leaves_, r = hi + leaves_; l < r; l >>= 1, r >>= 1) {
      if (l & 1U) {
        tag_[l] = std::max(tag_[l], v);
        agg_[l] = std::max(agg_[l], v);
        ++l;
      }
      if (r & 1U) {
        --r;
        tag_[r] = std::max(tag_[r], v);
        agg_[r] = std::max(agg_[r], v);
      }
    }
    for (std::size_t a = (lo + leaves_) >> 1, b = (hi - 1 + leaves_) >> 1; a >= 1;
         a >>= 1, b >>= 1) {
      agg_[a] = std::max({tag_[a], agg_[2 * a], agg_[2 * a + 1]});
      agg_[b] = std::max({tag_[b], agg_[2 * b], agg_[2 * b + 1]});
    }
  }

 private:
  std::size_t leaves_;
  std::vector<std::uint64_t> tag_;
  std::vector<std::uint64_t> agg_;
};

}  // namespace

candidate_plan place_skyline(const plan_problem& p, std::span<const double> priority,
                             deadline_or_stop deadline, const std::atomic<bool>* stop) {
  candidate_plan out;
  out.offsets.assign(p.size(), 0);
  skyline floors(std::max<std::uint32_t>(p.sections, 1));
  // rank[b]: position of b in decreasing priority (ties by index).
  std::vector<std::uint32_t> by_priority(p.size());
  std::iota(by_priority.begin(), by_priority.end(), 0U);
  std::stable_sort(by_priority.begin(), by_priority.end(),
                   [&](std::uint32_t a, std::uint32_t b) { return priority[a] > priority[b]; });
  // Min-heap on (lowest offset known so far, rank). Floors only rise, so a cached offset is
  // a lower bound; the top entry is re-checked and, when stale, sifted down with its new key.
  struct entry {
    std::uint64_t lowest;
    std::uint32_t rank;
    std::uint32_t buffer;
  };
  auto later = [](const entry& a, const entry& b) {
    return a.lowest != b.lowest ? a.lowest > b.lowest : a.rank > b.rank;
  };
  // Buffers with the same span always have the same lowest offset, so of each such group
  // only the unplaced member of best rank is in the heap, and the next one enters when it is
  // placed (traces often hold thousands of buffers alive in one section only, which would
  // otherwise each be re-checked after every placement there).
  std::vector<std::uint32_t> rank(p.size());
  for (std::uint32_t r = 0; r < p.size(); ++r) rank[by_priority[r]] = r;
  std::vector<std::uint32_t> by_span = std::move(by_priority);  // stable: by rank in a span
  std::stable_sort(by_span.begin(), by_span.end(), [&](std::uint32_t a, std::uint32_t b) {
    return p.lo[a] != p.lo[b] ? p.lo[a] < p.lo[b] : p.hi[a] < p.hi[b];
  });
  constexpr std::uint32_t none = std::numeric_limits<std::uint32_t>::max();
  std::vector<std::uint32_t> next_in_span(p.size(), none);
  std::vector<entry> heap;
  for (std::size_t k = 0; k < by_span.size(); ++k) {
    const std::uint32_t b = by_span[k];
    auto same_span = [&](std::uint32_t o) { return p.lo[o] == p.lo[b] && p.hi[o] == p.hi[b]; };
    if (k + 1 < by_span.size() && same_span(by_span[k + 1])) next_in_span[b] = by_span[k + 1];
    if (k == 0 || !same_span(by_span[k - 1])) heap.push_back({0, rank[b], b});
  }
  std::make_heap(heap.begin(), heap.end(), later);
  std::uint64_t arena = 0;
  std::size_t steps = 0;
  while (!heap.empty()) {
    if ((++steps & 255U) == 0 &&
        ((stop != nullptr && stop->load(std::memory_order_relaxed)) || deadline.passed())) {
      return {};
    }
    const std::uint32_t b = heap.front().buffer;
    const std::uint64_t lowest = floors.max(p.lo[b], p.hi[b]);
    if (lowest > heap.front().lowest) {
      heap.front().lowest = lowest;
      sift_down_top(std::span(heap), later);
      continue;
    }
    std::pop_heap(heap.begin(), heap.end(), later);
    heap.pop_back();
    out.offsets[b] = lowest;
    if (p.bytes[b] != 0) floors.raise(p.lo[b], p.hi[b], lowest + p.bytes[b]);
    arena = std::max(arena, lowest + p.bytes[b]);
    if (const std::uint32_t n = next_in_span[b]; n != none) {
      // Exact: the span's highest floor was `lowest` and is now its top.
      heap.push_back({lowest + p.bytes[b], rank[n], n});
      std::push_heap(heap.begin(), heap.end(), later);
    }
  }
  out.arena = arena;
  return out;
}

}  // namespace tensormem::core::detail
