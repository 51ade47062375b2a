#include "tensormem/core/lifetime.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tensormem/core/align.hpp"

namespace tensormem::core {

std::uint64_t lower_bound(std::span<const buffer> buffers, std::uint64_t alignment) {
  // Events (time, is_start, bytes); at equal times frees come first (half-open lifetimes).
  // Unsigned throughout: sizes up to 2^64 - 1 are valid, and a sum that passes it is an
  // error, never a wrapped value.
  struct event {
    std::uint64_t time;
    bool start;
    std::uint64_t bytes;
  };
  if (!is_power_of_two(alignment)) {
    throw std::invalid_argument("lower_bound: alignment " + std::to_string(alignment) + " is not a power of two");
  }
  std::vector<event> events;
  events.reserve(buffers.size() * 2);
  for (const buffer& b : buffers) {
    if (b.lower >= b.upper) continue;  // an empty lifetime is never alive
    const auto bytes = align_up(b.bytes, alignment);
    if (!bytes) {
      throw std::overflow_error("lower_bound: buffer '" + b.id + "' of " + std::to_string(b.bytes) +
                                " bytes does not fit in 64 bits once aligned to " +
                                std::to_string(alignment));
    }
    events.push_back({b.lower, true, *bytes});
    events.push_back({b.upper, false, *bytes});
  }
  std::sort(events.begin(), events.end(), [](const event& a, const event& b) {
    return a.time != b.time ? a.time < b.time : (!a.start && b.start);
  });
  std::uint64_t live = 0;
  std::uint64_t best = 0;
  for (const event& e : events) {
    if (!e.start) {
      live -= e.bytes;  // never below zero: its start came first
      continue;
    }
    if (e.bytes > std::numeric_limits<std::uint64_t>::max() - live) {
      throw std::overflow_error("lower_bound: more than 2^64 - 1 bytes are alive at time " +
                                std::to_string(e.time));
    }
    live += e.bytes;
    best = std::max(best, live);
  }
  return best;
}

std::vector<buffer> synthetic_lifetimes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> life(0.0, 12.0);
  std::uniform_real_distribution<double> size(10.0, 24.0);
  std::vector<buffer> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    buffer b;
    b.id = std::to_string(i);
    b.lower = rng() % std::max<std::size_t>(n, 1);
    b.upper = b.lower + static_cast<std::uint64_t>(std::exp2(life(rng)));
    b.bytes = static_cast<std::uint64_t>(std::exp2(size(rng)));
    out.push_back(std::move(b));
  }
  return out;
}

}  // namespace tensormem::core
