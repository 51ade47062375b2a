// Depth-first search over canonical solutions at a fixed capacity.
//
// Ideas from MiniMalloc (Moffitt, "MiniMalloc: A Lightweight Memory Allocator for
// Hardware-Accelerated Machine Learning", ASPLOS 2023): buffers are placed at their lowest
// feasible offset; the sequence of placements is non-decreasing in (offset, preorder rank),
// which enumerates each canonical solution once; a buffer is not placed at or above the
// height that another unplaced buffer could reach, since that buffer would fit in the gap
// below; and every time section must keep room for the buffers still to come.

#include <algorithm>
#include <tuple>

#include "planner_detail.hpp"

namespace tensormem::core::detail {

namespace {

constexpr std::uint64_t unplaced = std::numeric_limits<std::uint64_t>::max();

class canonical_dfs {
 public:
  canonical_dfs(const plan_problem& p, const search_graph& g, std::uint64_t capacity,
                preorder heuristic, deadline_or_stop deadline, std::uint64_t node_limit)
      : p_(p), g_(g), capacity_(capacity), heuristic_(heuristic), deadline_(deadline),
        node_limit_(node_limit), offsets_(p.size(), unplaced), solution_(p.size(), 0),
        min_offset_(p.size(), 0), floor_(p.sections, 0), total_(g.section_total),
        cuts_(p.sections, 0), mark_(p.sections + 1, 0),
        floor_witness_(p.sections, 0) {
    for (std::uint32_t s = 0; s < p.sections; ++s) {  // a member of each section that has one
      if (g.section_begin[s] < g.section_begin[s + 1]) floor_witness_[s] = g.section_members[g.section_begin[s]];
    }
  }

  /// true: a plan within capacity is in offsets(). false: none found (see stopped()).
  bool run() {
    std::vector<candidate> all;
    for (std::uint32_t b = 0; b < p_.size(); ++b) {
      if (p_.bytes[b] == 0) continue;  // zero-byte buffers stay at offset 0
      all.push_back({0, 0, b});
      for (std::uint32_t s = p_.lo[b]; s + 1 < p_.hi[b]; ++s) ++cuts_[s];
    }
    if (all.empty()) return true;
    return solve_split(0, p_.sections, all);
  }
  bool stopped() const noexcept { return stopped_; }
  const std::vector<std::uint64_t>& offsets() const noexcept { return solution_; }

 private:
  struct candidate {
    std::uint64_t offset;
    std::uint32_t rank;
    std::uint32_t buffer;
  };
  static bool before(const candidate& a, const candidate& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.rank < b.rank;
  }

  // Every section of [lo, hi) keeps room for its unplaced buffers above max(floor, offset):
  // nothing will be placed below `offset` in this part any more. Most checks fail, and most
  // often at the section where the previous one failed: that section is tried first.
  bool check(std::uint32_t lo, std::uint32_t hi, std::uint64_t offset) {
    return no_section_short(lo, hi, [&](std::uint32_t s) { return short_of_room(s, offset); });
  }

  // Section s, as it is now, has no room for its unplaced buffers above max(floor, offset).
  bool short_of_room(std::uint32_t s, std::uint64_t offset) const {
    return total_[s] != 0 && std::max(floor_[s], offset) + total_[s] > capacity_;
  }

  // No section of [lo, hi) is short of room, trying first where the last one was.
  template <class ShortOfRoom>
  bool no_section_short(std::uint32_t lo, std::uint32_t hi, ShortOfRoom&& short_of_room) {
    if (witness_ >= lo && witness_ < hi && short_of_room(witness_)) return false;
    for (std::uint32_t s = lo; s < hi; ++s) {
      if (short_of_room(s)) {
        witness_ = s;
        return false;
      }
    }
    return true;
  }

  // Ranks the buffers of a part by the preorder heuristic, with section totals as they are
  // now (so the ranks follow what is left to place).
  void rank_part(std::vector<candidate>& part) const {
    struct keyed {
      double k1, k2, k3;
      std::uint32_t index;
    };
    std::vector<keyed> keys;
    keys.reserve(part.size());
    for (std::uint32_t i = 0; i < part.size(); ++i) {
      const std::uint32_t b = part[i].buffer;
      std::uint64_t total = 0;
      for (std::uint32_t s = p_.lo[b]; s < p_.hi[b]; ++s) total = std::max(total, total_[s]);
      const auto t = static_cast<double>(total);
      const auto w = static_cast<double>(p_.length[b]);
      const double a = static_cast<double>(p_.bytes[b]) * w;
      switch (heuristic_) {
        case preorder::length_area_total: keys.push_back({w, a, t, i}); break;
        case preorder::total_area_length: keys.push_back({t, a, w, i}); break;
        case preorder::total_length_area: keys.push_back({t, w, a, i}); break;
      }
    }
    std::sort(keys.begin(), keys.end(), [&](const keyed& x, const keyed& y) {
      if (x.k1 != y.k1) return x.k1 > y.k1;
      if (x.k2 != y.k2) return x.k2 > y.k2;
      if (x.k3 != y.k3) return x.k3 > y.k3;
      return part[x.index].buffer < part[y.index].buffer;
    });
    for (std::uint32_t r = 0; r < keys.size(); ++r) part[keys[r].index].rank = r;
  }

  // Splits the sections [lo, hi) where no unplaced buffer crosses a boundary and solves the
  // parts independently, each from a fresh canonical order. `pool` holds the unplaced
  // buffers of [lo, hi).
  bool solve_split(std::uint32_t lo, std::uint32_t hi, const std::vector<candidate>& pool) {
    std::uint32_t start = lo;
    for (std::uint32_t s = lo; s < hi; ++s) {
      if (s + 1 < hi && cuts_[s] != 0) continue;
      std::vector<candidate> part;
      for (const candidate& c : pool) {
        if (offsets_[c.buffer] == unplaced && p_.lo[c.buffer] <= s && p_.hi[c.buffer] > start) {
          part.push_back({min_offset_[c.buffer], 0, c.buffer});
        }
      }
      rank_part(part);
      if (!part.empty()) {
        std::sort(part.begin(), part.end(), before);
        if (!check(start, s + 1, 0) || !dfs(start, s + 1, 0, 0, part)) return false;
      }
      start = s + 1;
    }
    return true;
  }

  // `parent` holds the unplaced buffers of the part [lo, hi) in (offset, rank) order, with
  // the offsets they had in the caller; offsets only grow, so re-sorting is nearly linear.
  bool dfs(std::uint32_t lo, std::uint32_t hi, std::uint64_t last_offset,
           std::uint32_t last_rank, const std::vector<candidate>& parent) {
    if (++nodes_ > node_limit_ || ((nodes_ & 63U) == 0 && deadline_.passed())) {
      stopped_ = true;
      return false;
    }
    std::vector<candidate> order;
    order.reserve(parent.size());
    std::uint64_t min_height = unplaced;
    for (const candidate& c : parent) {
      if (offsets_[c.buffer] != unplaced) continue;
      order.push_back({min_offset_[c.buffer], c.rank, c.buffer});
      min_height = std::min(min_height, min_offset_[c.buffer] + p_.bytes[c.buffer]);
    }
    if (order.empty()) return true;  // this part is solved
    for (std::size_t i = 1; i < order.size(); ++i) {  // insertion sort: few keys moved
      const candidate moving = order[i];
      std::size_t j = i;
      for (; j > 0 && before(moving, order[j - 1]); --j) order[j] = order[j - 1];
      order[j] = moving;
    }
    for (const candidate& c : order) {
      if (c.offset >= min_height) break;  // the rest would leave a gap someone fits in
      if (c.offset < last_offset || (c.offset == last_offset && c.rank < last_rank)) continue;
      if (c.offset + p_.bytes[c.buffer] > capacity_) continue;
      // The check after placing c would fail, and so would every candidate's after it.
      if (!may_keep_room(lo, hi, c.buffer, c.offset)) break;
      const std::size_t offset_mark = offset_log_.size();
      const std::size_t floor_mark = floor_log_.size();
      bool hatless = true;
      const bool split = place(c.buffer, c.offset, hatless);
      bool found = false;
      if (check(lo, hi, c.offset)) {
        found = split ? solve_split(lo, hi, order) : dfs(lo, hi, c.offset, c.rank, order);
      }
      if (found) keep_placed();  // the parts below kept theirs
      unplace(c.buffer, offset_mark, floor_mark);
      if (found) return true;
      if (stopped_) return false;
      // Nothing unplaced overlaps c: where c sits cannot matter to the others, so if this
      // subtree failed, so do its siblings.
      if (hatless) break;
    }
    return false;
  }

  // false when check(lo, hi, offset) is sure to fail once b is placed at offset, judged
  // before placing it: most candidates fail that check, and placing and unplacing them
  // costs far more than the check. In b's own sections the check will see a floor of at
  // least offset + bytes and bytes fewer unplaced, so they are judged as they will be;
  // elsewhere placing b only raises floors, so a section short of room now stays short.
  // A section short of room for b is short for every later candidate c of the node too
  // (offset' >= offset, and a section's floor is at most the offset of each of its
  // unplaced buffers): outside c's span by the same sum or more; inside it, by offset' plus
  // the same unplaced bytes, unless c is the section's last unplaced buffer, and then c does
  // not fit under the capacity at all. So the node's loop stops at the first such candidate.
  bool may_keep_room(std::uint32_t lo, std::uint32_t hi, std::uint32_t b, std::uint64_t offset) {
    const std::uint64_t bytes = p_.bytes[b];
    const std::uint32_t own_lo = p_.lo[b];
    const std::uint32_t own_hi = p_.hi[b];
    return no_section_short(lo, hi, [&](std::uint32_t s) {
      if (s >= own_lo && s < own_hi) return total_[s] != bytes && offset + total_[s] > capacity_;
      return short_of_room(s, offset);
    });
  }

  void keep_placed() {
    for (std::uint32_t b = 0; b < p_.size(); ++b) {
      if (offsets_[b] != unplaced) solution_[b] = offsets_[b];
    }
  }

  // Places b at offset; returns true when a boundary inside b's span lost its last
  // crossing unplaced buffer (the part can be split). `hatless` is cleared when some
  // unplaced buffer overlaps b in time.
  bool place(std::uint32_t b, std::uint64_t offset, bool& hatless) {
    offsets_[b] = offset;
    const std::uint64_t height = offset + p_.bytes[b];
    // Overlapping unplaced buffers cannot start below this one's top any more; the sections
    // they live in are marked with a difference array over [first, last).
    std::uint32_t first = p_.sections;
    std::uint32_t last = 0;
    for (std::uint32_t k = g_.overlap_begin[b]; k < g_.overlap_begin[b + 1]; ++k) {
      const std::uint32_t o = g_.overlaps[k];
      if (offsets_[o] != unplaced) continue;
      hatless = false;
      if (min_offset_[o] >= height) continue;
      offset_log_.emplace_back(o, min_offset_[o]);
      min_offset_[o] = height;
      ++mark_[p_.lo[o]];
      --mark_[p_.hi[o]];
      first = std::min(first, p_.lo[o]);
      last = std::max(last, p_.hi[o]);
    }
    touched_.clear();
    for (std::int32_t depth = 0; first < last; ++first) {
      depth += mark_[first];
      mark_[first] = 0;
      if (depth > 0) touched_.push_back(first);
    }
    mark_[last] = 0;
    for (std::uint32_t s = p_.lo[b]; s < p_.hi[b]; ++s) {
      floor_log_.emplace_back(s, floor_[s]);
      floor_[s] = height;
      total_[s] -= p_.bytes[b];
    }
    // A section's floor is at least the lowest offset any of its unplaced buffers can take.
    // Floors only serve pruning, and nothing in this part goes below `offset` any more, so
    // the scan stops as soon as the raise could not exceed max(floor, offset).
    for (const std::uint32_t s : touched_) {
      if (total_[s] == 0) continue;
      const std::uint64_t useless = floor_[s];
      // The member that ended the last scan of this section ends this one too, most often.
      if (const std::uint32_t w = floor_witness_[s]; offsets_[w] == unplaced && min_offset_[w] <= useless) continue;
      std::uint64_t lowest = unplaced;
      for (std::uint32_t k = g_.section_begin[s]; k < g_.section_begin[s + 1]; ++k) {
        const std::uint32_t o = g_.section_members[k];
        if (offsets_[o] != unplaced) continue;
        lowest = std::min(lowest, min_offset_[o]);
        if (lowest <= useless) {
          floor_witness_[s] = o;
          break;
        }
      }
      if (lowest != unplaced && floor_[s] < lowest) {
        floor_log_.emplace_back(s, floor_[s]);
        floor_[s] = lowest;
      }
    }
    bool split = false;
    for (std::uint32_t s = p_.lo[b]; s + 1 < p_.hi[b]; ++s) split = (--cuts_[s] == 0) || split;
    return split;
  }

  void unplace(std::uint32_t b, std::size_t offset_mark, std::size_t floor_mark) {
    while (floor_log_.size() > floor_mark) {
      floor_[floor_log_.back().first] = floor_log_.back().second;
      floor_log_.pop_back();
    }
    while (offset_log_.size() > offset_mark) {
      min_offset_[offset_log_.back().first] = offset_log_.back().second;
      offset_log_.pop_back();
    }
    for (std::uint32_t s = p_.lo[b]; s < p_.hi[b]; ++s) total_[s] += p_.bytes[b];
    for (std::uint32_t s = p_.lo[b]; s + 1 < p_.hi[b]; ++s) ++cuts_[s];
    offsets_[b] = unplaced;
  }

  const plan_problem& p_;
  const search_graph& g_;
  std::uint64_t capacity_;
  preorder heuristic_;
  deadline_or_stop deadline_;
  std::uint64_t node_limit_;
  std::uint64_t nodes_ = 0;
  std::uint32_t witness_ = 0;  // the section where the last failed check failed
  bool stopped_ = false;
  std::vector<std::uint64_t> offsets_;   // current assignment
  std::vector<std::uint64_t> solution_;  // offsets of solved parts
  std::vector<std::uint64_t> min_offset_;
  std::vector<std::uint64_t> floor_;
  std::vector<std::uint64_t> total_;
  std::vector<std::uint32_t> cuts_;  // unplaced buffers crossing the boundary s | s + 1
  std::vector<std::int32_t> mark_;  // difference array of sections to revisit
  std::vector<std::uint32_t> touched_;
  std::vector<std::pair<std::uint32_t, std::uint64_t>> offset_log_;
  std::vector<std::pair<std::uint32_t, std::uint64_t>> floor_log_;
  std::vector<std::uint32_t> floor_witness_;  // per section: a member that ended its last scan
};

}  // namespace

search_graph make_search_graph(const plan_problem& p) {
  search_graph g;
  const std::uint32_t n = static_cast<std::uint32_t>(p.size());
  g.section_total.assign(p.sections, 0);
  std::vector<std::uint32_t> count(p.sections + 1, 0);
  for (std::uint32_t b = 0; b < n; ++b) {
    if (p.bytes[b] == 0) continue;
    for (std::uint32_t s = p.lo[b]; s < p.hi[b]; ++s) {
      ++count[s];
      g.section_total[s] += p.bytes[b];
    }
  }
  g.section_begin.assign(p.sections + 1, 0);
  for (std::uint32_t s = 0; s < p.sections; ++s) g.section_begin[s + 1] = g.section_begin[s] + count[s];
  g.section_members.resize(g.section_begin[p.sections]);
  std::vector<std::uint32_t> fill(g.section_begin.begin(), g.section_begin.end() - 1);
  for (std::uint32_t b = 0; b < n; ++b) {
    if (p.bytes[b] == 0) continue;
    for (std::uint32_t s = p.lo[b]; s < p.hi[b]; ++s) g.section_members[fill[s]++] = b;
  }
  // Overlap lists: buffers sorted by start; those alive when b starts or starting inside b.
  std::vector<std::vector<std::uint32_t>> overlaps(n);
  std::vector<std::uint32_t> by_start(n);
  for (std::uint32_t b = 0; b < n; ++b) by_start[b] = b;
  std::sort(by_start.begin(), by_start.end(),
            [&](std::uint32_t a, std::uint32_t b) { return p.lo[a] < p.lo[b]; });
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t a = by_start[i];
    if (p.bytes[a] == 0) continue;
    for (std::size_t j = i + 1; j < n && p.lo[by_start[j]] < p.hi[a]; ++j) {
      const std::uint32_t b = by_start[j];
      if (p.bytes[b] == 0) continue;
      overlaps[a].push_back(b);
      overlaps[b].push_back(a);
    }
  }
  g.overlap_begin.assign(n + 1, 0);
  for (std::uint32_t b = 0; b < n; ++b) {
    g.overlap_begin[b + 1] = g.overlap_begin[b] + static_cast<std::uint32_t>(overlaps[b].size());
  }
  g.overlaps.reserve(g.overlap_begin[n]);
  for (const auto& list : overlaps) g.overlaps.insert(g.overlaps.end(), list.begin(), list.end());
  return g;
}

std::uint64_t overlap_pairs(const plan_problem& p) {
  std::vector<std::uint32_t> starts(p.lo);
  std::vector<std::uint32_t> ends(p.hi);
  std::sort(starts.begin(), starts.end());
  std::sort(ends.begin(), ends.end());
  std::uint64_t pairs = 0;
  for (std::size_t b = 0; b < p.size(); ++b) {
    // Buffers starting before b ends, minus those that ended by b's start, minus b itself.
    const auto started = std::lower_bound(starts.begin(), starts.end(), p.hi[b]) - starts.begin();
    const auto ended = std::upper_bound(ends.begin(), ends.end(), p.lo[b]) - ends.begin();
    pairs += static_cast<std::uint64_t>(started - ended - 1);
  }
  return pairs / 2;
}

bool canonical_search(const plan_problem& p, const search_graph& g, std::uint64_t capacity,
                      preorder heuristic, deadline_or_stop deadline,
                      std::uint64_t node_limit, std::vector<std::uint64_t>& offsets,
                      bool& stopped) {
  canonical_dfs search(p, g, capacity, heuristic, deadline, node_limit);
  const bool found = search.run();
  stopped = search.stopped();
  if (found) offsets = search.offsets();
  return found;
}

}  // namespace tensormem::core::detail
