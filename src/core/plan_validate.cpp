// Plan validation by a sweep over time, independent of the planner's data structures.

#include <algorithm>
#include <map>
#include <utility>

#include "event_sort.hpp"
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
    if (!bytes || offsets[i] > UINT64_MAX - *bytes) {
      return "'" + buffers[i].id + "' at offset " + std::to_string(offsets[i]) + " with " +
             std::to_string(buffers[i].bytes) + " bytes ends past 2^64 - 1";
    }
    ends[i] = offsets[i] + *bytes;
    if (ends[i] > arena_bytes) {
      return "'" + buffers[i].id + "' ends at " + std::to_string(ends[i]) +
             ", past the arena of " + std::to_string(arena_bytes) + " bytes";
    }
  }
  // Only buffers that hold bytes for some time can conflict: a zero-byte buffer or an
  // empty (or inverted) lifetime occupies nothing.
  auto occupies = [&](std::size_t i) { return ends[i] != offsets[i] && buffers[i].lower < buffers[i].upper; };
  // Events (time, code): at equal times, ends before starts (half-open lifetimes); the code
  // is the buffer index, with the top bit set for a start. Laid out as every end, then every
  // start, for the stable sort by time to keep that order among equal times.
  constexpr std::uint64_t start_bit = std::uint64_t{1} << 63;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> events;
  events.reserve(buffers.size() * 2);
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    if (occupies(i)) events.emplace_back(buffers[i].upper, i);
  }
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    if (occupies(i)) events.emplace_back(buffers[i].lower, i | start_bit);
  }
  detail::stable_sort_by_time(events);
  // Live byte ranges by offset, with their ends and buffers. While no overlap has been found
  // they are disjoint, so each offset names one buffer.
  using live_map = std::map<std::uint64_t, std::pair<std::uint64_t, std::size_t>>;
  live_map live;
  // Where each live buffer sits in `live`: its end erases it without a search.
  std::vector<live_map::iterator> where(buffers.size());
  auto overlap = [&](std::size_t a, std::size_t b, std::uint64_t time) {
    return "'" + buffers[a].id + "' and '" + buffers[b].id + "' overlap in time and space at time " +
           std::to_string(time);
  };
  // The sweep reads the arrays by buffer index in time order, a cache miss per event on a
  // large plan: each event's entries are fetched a few events ahead.
  constexpr std::size_t ahead = 16;
  for (std::size_t e = 0; e < events.size(); ++e) {
    if (e + ahead < events.size()) {
      const std::uint64_t later = events[e + ahead].second;
      const std::size_t j = later & ~start_bit;
      if ((later & start_bit) != 0) {
        __builtin_prefetch(&offsets[j]);
        __builtin_prefetch(&ends[j]);
      }
      __builtin_prefetch(&where[j], 1);
    }
    const auto [time, code] = events[e];
    const std::size_t i = code & ~start_bit;
    if ((code & start_bit) == 0) {
      live.erase(where[i]);
      continue;
    }
    const std::uint64_t offset = offsets[i];
    const std::uint64_t end = ends[i];
    const auto next = live.lower_bound(offset);
    if (next != live.end() && next->first < end) return overlap(i, next->second.second, time);
    if (next != live.begin()) {
      const auto prev = std::prev(next);
      if (prev->second.first > offset) return overlap(i, prev->second.second, time);
    }
    where[i] = live.emplace_hint(next, offset, std::pair{end, i});
  }
  return {};
}

}  // namespace tensormem::core
