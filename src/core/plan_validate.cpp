// Plan validation by a sweep over time, independent of the planner's data structures.

#include <algorithm>
#include <map>
#include <tuple>

#include "tensormem/core/align.hpp"
#include "tensormem/core/planner.hpp"

namespace tensormem::core {

std::string validate(std::span<const buffer> buffers, std::span<const std::uint64_t> offsets,
                     std::uint64_t arena_bytes, std::uint64_t alignment) {
  if (!is_power_of_two(alignment)) return "alignment is not a power of two";
  if (offsets.size() != buffers.size()) {
    return "plan has " + std::to_string(offsets.size()) + " offsets for " +
           std::to_string(buffers.size()) + " buffers";
  }
  std::vector<std::uint64_t> ends(buffers.size());
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    if (!is_aligned(offsets[i], alignment)) {
      return "offset " + std::to_string(offsets[i]) + " of '" + buffers[i].id +
             "' is not a multiple of " + std::to_string(alignment);
    }
    const auto bytes = align_up(buffers[i].bytes, alignment);
    if (!bytes || offsets[i] > UINT64_MAX - *bytes) return "'" + buffers[i].id + "' overflows";
    ends[i] = offsets[i] + *bytes;
    if (ends[i] > arena_bytes) {
      return "'" + buffers[i].id + "' ends at " + std::to_string(ends[i]) +
             ", past the arena of " + std::to_string(arena_bytes) + " bytes";
    }
  }
  // Only buffers that hold bytes for some time can conflict: a zero-byte buffer or an
  // empty (or inverted) lifetime occupies nothing.
  auto occupies = [&](std::size_t i) { return ends[i] != offsets[i] && buffers[i].lower < buffers[i].upper; };
  // Events: at equal times, ends before starts (half-open lifetimes).
  std::vector<std::tuple<std::uint64_t, bool, std::size_t>> events;
  events.reserve(buffers.size() * 2);
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    if (!occupies(i)) continue;
    events.emplace_back(buffers[i].lower, true, i);
    events.emplace_back(buffers[i].upper, false, i);
  }
  std::sort(events.begin(), events.end());
  // Live byte ranges by offset. While no overlap has been found they are disjoint, so each
  // offset names one buffer.
  std::map<std::uint64_t, std::size_t> live;
  auto overlap = [&](std::size_t a, std::size_t b, std::uint64_t time) {
    return "'" + buffers[a].id + "' and '" + buffers[b].id + "' overlap in time and space at time " +
           std::to_string(time);
  };
  for (const auto& [time, starts, i] : events) {
    if (!starts) {
      live.erase(offsets[i]);
      continue;
    }
    const auto next = live.lower_bound(offsets[i]);
    if (next != live.end() && next->first < ends[i]) return overlap(i, next->second, time);
    if (next != live.begin()) {
      const auto prev = std::prev(next);
      if (ends[prev->second] > offsets[i]) return overlap(i, prev->second, time);
    }
    live.emplace(offsets[i], i);
  }
  return {};
}

}  // namespace tensormem::core
