// Greedy placement strategies of the planner.

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "parallel_sort.hpp"
#include "planner_detail.hpp"
#include "tensormem/core/align.hpp"

namespace tensormem::core::detail {

plan_problem make_problem(std::span<const buffer> buffers, std::uint64_t alignment) {
  if (buffers.size() >= plan_problem::start_event) {
    throw std::length_error("plan: " + std::to_string(buffers.size()) + " buffers; at most 2^31 - 1 are planned");
  }
  plan_problem p;
  const std::size_t n = buffers.size();
  p.bytes.resize(n);
  p.length.resize(n);
  p.lo.resize(n);
  p.hi.resize(n);
  // One sort of the lifetime events serves the sections, the lower bound and the first
  // plan's replay: (time, ends before starts, buffer index).
  std::vector<std::pair<std::uint64_t, std::uint32_t>> events(2 * n);
  for (std::uint32_t i = 0; i < n; ++i) {
    const buffer& b = buffers[i];
    p.bytes[i] = align_up(b.bytes, alignment).value_or(b.bytes);
    p.length[i] = b.upper - b.lower;
    events[2 * i] = {b.lower, i | plan_problem::start_event};
    events[2 * i + 1] = {b.upper, i};
  }
  sort_on_two_threads(events);
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
      live -= p.bytes[i];
    }
  }
  p.sections = section;
  return p;
}

std::uint64_t arena_of(const plan_problem& p, std::span<const std::uint64_t> offsets) {
  std::uint64_t arena = 0;
  for (std::size_t i = 0; i < p.size(); ++i) arena = std::max(arena, offsets[i] + p.bytes[i]);
  return arena;
}

occupancy_index::occupancy_index(std::uint32_t sections) : leaves_(1) {
  while (leaves_ < sections + std::size_t{1}) leaves_ <<= 1;
  own_.resize(2 * leaves_);
  sub_.resize(2 * leaves_);
}

void occupancy_index::clear() {
  for (auto& v : own_) v.clear();
  for (auto& v : sub_) v.clear();
}

void occupancy_index::add(range_set& set, std::uint64_t offset, std::uint64_t end) {
  // First range that ends at or after `offset` (touching ranges merge too).
  auto first = std::lower_bound(set.begin(), set.end(), offset,
                                [](const range& r, std::uint64_t v) { return r.second < v; });
  auto last = first;
  while (last != set.end() && last->first <= end) {
    offset = std::min(offset, last->first);
    end = std::max(end, last->second);
    ++last;
  }
  if (first == last) {
    set.insert(first, {offset, end});
  } else {
    *first = {offset, end};
    set.erase(first + 1, last);
  }
}

void occupancy_index::insert(std::uint32_t lo, std::uint32_t hi, std::uint64_t offset,
                             std::uint64_t end) {
  for (std::size_t l = lo + leaves_, r = hi + leaves_; l < r; l >>= 1, r >>= 1) {
    if (l & 1U) {
      add(own_[l], offset, end);
      add(sub_[l++], offset, end);
    }
    if (r & 1U) {
      add(own_[--r], offset, end);
      add(sub_[r], offset, end);
    }
  }
  std::size_t a = lo + leaves_;
  std::size_t b = hi - 1 + leaves_;
  for (; a >= 1; a >>= 1, b >>= 1) {
    add(sub_[a], offset, end);
    if (b != a) add(sub_[b], offset, end);
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
  for (std::size_t l = lo + leaves_, r = hi + leaves_; l < r; l >>= 1, r >>= 1) {
    if (l & 1U) append(sub_[l++]);
    if (r & 1U) append(sub_[--r]);
  }
  std::size_t a = lo + leaves_;
  std::size_t b = hi - 1 + leaves_;
  for (; a >= 1; a >>= 1, b >>= 1) {
    append(own_[a]);
    if (b != a) append(own_[b]);
  }
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

candidate_plan place_in_order(const plan_problem& p, std::span<const std::uint32_t> order,
                              fit policy, occupancy_index& index, clock::time_point deadline) {
  constexpr std::uint64_t unplaced = std::numeric_limits<std::uint64_t>::max();
  candidate_plan out;
  out.offsets.assign(p.size(), unplaced);
  index.clear();
  std::vector<occupancy_index::range> taken;
  std::uint64_t arena = 0;
  std::size_t placed = 0;
  for (const std::uint32_t b : order) {
    if ((++placed & 255U) == 0 && deadline != clock::time_point::max() && clock::now() >= deadline) return {};
    taken.clear();
    index.collect(p.lo[b], p.hi[b], taken);
    const std::uint64_t need = p.bytes[b];
    std::uint64_t cursor = 0;
    std::uint64_t chosen = unplaced;
    std::uint64_t chosen_gap = unplaced;
    for (const auto& [offset, end] : taken) {
      if (offset > cursor) {
        const std::uint64_t gap = offset - cursor;
        if (gap >= need && gap < chosen_gap) {
          chosen = cursor;
          chosen_gap = gap;
          if (policy == fit::first) break;
        }
      }
      cursor = std::max(cursor, end);
    }
    if (chosen == unplaced) chosen = cursor;  // above the highest conflicting buffer
    out.offsets[b] = chosen;
    arena = std::max(arena, chosen + need);
    if (need != 0) index.insert(p.lo[b], p.hi[b], chosen, chosen + need);
  }
  out.arena = arena;
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
                             clock::time_point deadline) {
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
  std::vector<entry> heap;
  heap.reserve(p.size());
  for (std::uint32_t r = 0; r < p.size(); ++r) heap.push_back({0, r, by_priority[r]});
  std::make_heap(heap.begin(), heap.end(), later);
  // Restores the heap after the key of heap[0] grew: one sift-down.
  auto sift_down_top = [&] {
    std::size_t i = 0;
    const entry moving = heap[0];
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
  };
  std::uint64_t arena = 0;
  std::size_t steps = 0;
  while (!heap.empty()) {
    if ((++steps & 255U) == 0 && deadline != clock::time_point::max() && clock::now() >= deadline) return {};
    const std::uint32_t b = heap.front().buffer;
    const std::uint64_t lowest = floors.max(p.lo[b], p.hi[b]);
    if (lowest > heap.front().lowest) {
      heap.front().lowest = lowest;
      sift_down_top();
      continue;
    }
    std::pop_heap(heap.begin(), heap.end(), later);
    heap.pop_back();
    out.offsets[b] = lowest;
    if (p.bytes[b] != 0) floors.raise(p.lo[b], p.hi[b], lowest + p.bytes[b]);
    arena = std::max(arena, lowest + p.bytes[b]);
  }
  out.arena = arena;
  return out;
}

}  // namespace tensormem::core::detail
