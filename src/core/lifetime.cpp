#include "tensormem/core/lifetime.hpp"

#include <algorithm>
#include <utility>
#include <vector>

#include "tensormem/core/align.hpp"

namespace tensormem::core {

std::uint64_t lower_bound(std::span<const buffer> buffers, std::uint64_t alignment) {
  // Events (time, +bytes or -bytes); at equal times frees come first (half-open lifetimes).
  std::vector<std::pair<std::uint64_t, std::int64_t>> events;
  events.reserve(buffers.size() * 2);
  for (const buffer& b : buffers) {
    const auto bytes = static_cast<std::int64_t>(align_up(b.bytes, alignment).value_or(b.bytes));
    events.emplace_back(b.lower, bytes);
    events.emplace_back(b.upper, -bytes);
  }
  std::sort(events.begin(), events.end());
  std::int64_t live = 0;
  std::int64_t best = 0;
  for (const auto& [time, delta] : events) {
    live += delta;
    best = std::max(best, live);
  }
  return static_cast<std::uint64_t>(best);
}

}  // namespace tensormem::core
