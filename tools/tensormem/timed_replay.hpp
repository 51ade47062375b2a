#pragma once
// Online replays timed as an engine meets them: the same step again and again.

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensormem/core/replay.hpp"

namespace tensormem::cli {

struct timed_replay {
  core::replay_result first;  // the first replay: offsets, high-water mark, operations
  double ns_per_op = 0;       // median over the replays; 0 when there is no operation
  std::size_t replays = 0;
};

/// Replays `buffers` through a new `Allocator(core::growing, alignment)` again and again,
/// each allocator built outside the timed part, until the replays add up to `budget_seconds`
/// of allocator calls or `max_replays` are done (at least one), and reports the median time
/// per operation. A step of a few hundred buffers replays in microseconds, so one timing of
/// it is mostly cold caches and timer noise. The allocators are deterministic: a replay that
/// lands on another high-water mark than the first is a bug (std::logic_error).
template <class Allocator>
timed_replay replay_timed(std::span<const core::buffer> buffers, std::uint64_t alignment,
                          double budget_seconds = 0.02, std::size_t max_replays = 1000) {
  timed_replay t;
  std::vector<double> ns;
  double total = 0;
  do {
    Allocator a(core::growing, alignment);
    core::replay_result r = core::replay(buffers, a);
    if (r.operations == 0) {  // nothing to time
      t.first = std::move(r);
      t.replays = 1;
      return t;
    }
    total += r.seconds;
    ns.push_back(r.seconds * 1e9 / static_cast<double>(r.operations));
    if (ns.size() == 1) {
      t.first = std::move(r);
    } else if (r.high_water != t.first.high_water) {
      throw std::logic_error("replay " + std::to_string(ns.size()) + " reached a high-water mark of " +
                             std::to_string(r.high_water) + " bytes, the first " +
                             std::to_string(t.first.high_water));
    }
  } while (total < budget_seconds && ns.size() < max_replays);
  const auto middle = ns.begin() + static_cast<std::ptrdiff_t>(ns.size() / 2);
  std::nth_element(ns.begin(), middle, ns.end());
  t.ns_per_op = *middle;
  t.replays = ns.size();
  return t;
}

}  // namespace tensormem::cli
