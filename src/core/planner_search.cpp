// Depth-first search over canonical solutions at a fixed capacity (after MiniMalloc).

#include <algorithm>

#include "planner_detail.hpp"

namespace tensormem::core::detail {

namespace {

class canonical_dfs {
 public:
  canonical_dfs(const plan_problem& p, std::uint64_t capacity, clock::time_point deadline,
                std::uint64_t node_limit, std::mt19937_64& rng, bool randomize)
      : p_(p), capacity_(capacity), deadline_(deadline), node_limit_(node_limit),
        floor_(p.sections, 0), remaining_(p.sections, 0), alive_(p.sections),
        placed_(p.size(), false), offsets_(p.size(), 0), priority_(p.size()) {
    for (std::uint32_t b = 0; b < p.size(); ++b) {
      if (p.bytes[b] == 0) {
        placed_[b] = true;
        ++placed_count_;
        continue;
      }
      for (std::uint32_t s = p.lo[b]; s < p.hi[b]; ++s) {
        alive_[s].push_back(b);
        remaining_[s] += p.bytes[b];
      }
      // Candidates are tried largest first, then longest; restarts perturb the order.
      const double noise = randomize ? std::uniform_real_distribution<double>(0.8, 1.25)(rng) : 1.0;
      priority_[b] = static_cast<double>(p.bytes[b]) * noise *
                     (1.0 + 1e-3 * static_cast<double>(p.hi[b] - p.lo[b]));
    }
  }

  bool run() {
    for (std::uint32_t s = 0; s < p_.sections; ++s) {
      if (remaining_[s] > capacity_) {
        exhausted_ = true;
        return false;
      }
    }
    const bool found = dfs();
    exhausted_ = !found && !stopped_;
    return found;
  }

  bool exhausted() const noexcept { return exhausted_; }
  const std::vector<std::uint64_t>& offsets() const noexcept { return offsets_; }

 private:
  std::uint64_t lowest(std::uint32_t b) const {
    std::uint64_t x = 0;
    for (std::uint32_t s = p_.lo[b]; s < p_.hi[b]; ++s) x = std::max(x, floor_[s]);
    return x;
  }

  bool out_of_budget() {
    ++nodes_;
    if (nodes_ > node_limit_ || ((nodes_ & 255U) == 0 && clock::now() > deadline_)) {
      stopped_ = true;
    }
    return stopped_;
  }

  bool dfs() {
    if (placed_count_ == p_.size()) return true;
    if (out_of_budget()) return false;
    // The lowest (then leftmost) section that still has unplaced buffers.
    std::uint32_t s = p_.sections;
    for (std::uint32_t t = 0; t < p_.sections; ++t) {
      if (remaining_[t] != 0 && (s == p_.sections || floor_[t] < floor_[s])) s = t;
    }
    const std::uint64_t x = floor_[s];
    std::vector<std::uint32_t> candidates;
    std::uint64_t next_level = std::numeric_limits<std::uint64_t>::max();
    for (const std::uint32_t b : alive_[s]) {
      if (placed_[b]) continue;
      const std::uint64_t low = lowest(b);
      if (low == x) candidates.push_back(b);
      else next_level = std::min(next_level, low);
    }
    if (candidates.empty()) {
      // Nothing can start at this height here: the space up to the next level is waste.
      floor_[s] = next_level;
      const bool ok = next_level + remaining_[s] <= capacity_ && dfs();
      if (!ok) floor_[s] = x;
      return ok;
    }
    std::sort(candidates.begin(), candidates.end(), [&](std::uint32_t a, std::uint32_t b) {
      return priority_[a] != priority_[b] ? priority_[a] > priority_[b] : a < b;
    });
    std::vector<std::uint64_t> saved;
    for (std::size_t k = 0; k < candidates.size() && !stopped_; ++k) {
      const std::uint32_t c = candidates[k];
      // Buffers with the same size and span are interchangeable: try one of them.
      bool duplicate = false;
      for (std::size_t j = 0; j < k && !duplicate; ++j) {
        const std::uint32_t d = candidates[j];
        duplicate = p_.bytes[d] == p_.bytes[c] && p_.lo[d] == p_.lo[c] && p_.hi[d] == p_.hi[c];
      }
      if (duplicate) continue;
      const std::uint64_t top = x + p_.bytes[c];
      if (top > capacity_) continue;
      saved.assign(floor_.begin() + p_.lo[c], floor_.begin() + p_.hi[c]);
      bool feasible = true;
      for (std::uint32_t t = p_.lo[c]; t < p_.hi[c]; ++t) {
        floor_[t] = top;
        remaining_[t] -= p_.bytes[c];
        feasible = feasible && top + remaining_[t] <= capacity_;
      }
      if (feasible) {
        placed_[c] = true;
        offsets_[c] = x;
        ++placed_count_;
        if (dfs()) return true;
        placed_[c] = false;
        --placed_count_;
      }
      for (std::uint32_t t = p_.lo[c]; t < p_.hi[c]; ++t) {
        floor_[t] = saved[t - p_.lo[c]];
        remaining_[t] += p_.bytes[c];
      }
    }
    return false;
  }

  const plan_problem& p_;
  std::uint64_t capacity_;
  clock::time_point deadline_;
  std::uint64_t node_limit_;
  std::uint64_t nodes_ = 0;
  bool stopped_ = false;
  bool exhausted_ = false;
  std::vector<std::uint64_t> floor_;
  std::vector<std::uint64_t> remaining_;
  std::vector<std::vector<std::uint32_t>> alive_;
  std::vector<bool> placed_;
  std::size_t placed_count_ = 0;
  std::vector<std::uint64_t> offsets_;
  std::vector<double> priority_;
};

}  // namespace

bool canonical_search(const plan_problem& p, std::uint64_t capacity, clock::time_point deadline,
                      std::uint64_t node_limit, std::mt19937_64& rng, bool randomize,
                      std::vector<std::uint64_t>& offsets, bool& exhausted) {
  canonical_dfs search(p, capacity, deadline, node_limit, rng, randomize);
  const bool found = search.run();
  exhausted = search.exhausted();
  if (found) offsets = search.offsets();
  return found;
}

}  // namespace tensormem::core::detail
