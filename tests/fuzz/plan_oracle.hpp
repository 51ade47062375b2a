// Checks shared by the planner fuzz targets: every plan valid, and on a few buffers the
// search's arena proven optimal and equal to a brute-force optimum.

#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <utility>
#include <vector>

#include "tensormem/core/align.hpp"
#include "tensormem/core/planner.hpp"

namespace tensormem::fuzz {

/// The most buffers brute_force_optimum takes (7! orders).
inline constexpr std::size_t brute_force_buffers = 7;

// Stops the run, naming the file and line of the check that failed.
[[noreturn]] inline void fail_at(const char* file, int line) {
  std::fprintf(stderr, "%s:%d: check failed\n", file, line);
  std::abort();
}
#define TENSORMEM_FUZZ_REQUIRE(condition) ((condition) ? void() : ::tensormem::fuzz::fail_at(__FILE__, __LINE__))

/// The least arena of any plan of `b` at `alignment`, by first fit over every order: sliding
/// each buffer down in the order of its offset never raises a packing, so some order's first
/// fit is optimal. The aligned sizes must add up to at most 2^64 - 1 (plan() refuses the
/// rest), so no end overflows.
inline std::uint64_t brute_force_optimum(const std::vector<core::buffer>& b, std::uint64_t alignment) {
  std::vector<std::uint64_t> bytes(b.size());
  for (std::size_t i = 0; i < b.size(); ++i) bytes[i] = *core::align_up(b[i].bytes, alignment);
  std::vector<std::size_t> order(b.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::vector<std::uint64_t> offset(b.size());
  std::uint64_t best = UINT64_MAX;
  do {
    std::uint64_t arena = 0;
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::size_t x = order[k];
      // The byte ranges of the placed buffers alive with x, by offset.
      std::vector<std::pair<std::uint64_t, std::uint64_t>> taken;
      for (std::size_t j = 0; j < k; ++j) {
        const std::size_t y = order[j];
        if (bytes[y] != 0 && b[x].lower < b[y].upper && b[y].lower < b[x].upper) {
          taken.emplace_back(offset[y], offset[y] + bytes[y]);
        }
      }
      std::sort(taken.begin(), taken.end());
      std::uint64_t at = 0;
      if (bytes[x] != 0) {
        for (const auto& [lo, hi] : taken) {
          if (lo >= at && lo - at >= bytes[x]) break;
          at = std::max(at, hi);
        }
      }
      offset[x] = at;
      arena = std::max(arena, at + bytes[x]);
    }
    best = std::min(best, arena);
  } while (std::next_permutation(order.begin(), order.end()));
  return best;
}

/// plan() with the validator's verdict and the bounds every plan keeps.
inline core::plan_result checked_plan(const std::vector<core::buffer>& buffers, const core::plan_options& o) {
  core::plan_result r = core::plan(buffers, o);
  TENSORMEM_FUZZ_REQUIRE(core::validate(buffers, r.offsets, r.arena_bytes, o.alignment).empty());
  TENSORMEM_FUZZ_REQUIRE(r.arena_bytes >= r.lower_bound);
  TENSORMEM_FUZZ_REQUIRE(!r.optimal || r.arena_bytes == r.lower_bound || o.search);
  return r;
}

/// The greedy phase alone, then the search on `threads` threads (small inputs until proven
/// optimal, at once on so few buffers, the limit only bounding a failure; larger ones for
/// 10 ms): both valid, and on up to brute_force_buffers buffers the search's arena proven
/// and equal to the brute-force optimum. std::invalid_argument from plan() (sizes past 2^64)
/// passes through.
inline void check_plans(const std::vector<core::buffer>& buffers, std::uint64_t alignment, unsigned threads) {
  core::plan_options o;
  o.alignment = alignment;
  o.search = false;
  o.threads = 1;
  const core::plan_result greedy = checked_plan(buffers, o);
  const bool small = buffers.size() <= brute_force_buffers;
  o.search = true;
  o.threads = threads;
  o.time_limit_seconds = small ? 5.0 : 0.01;
  const core::plan_result searched = checked_plan(buffers, o);
  TENSORMEM_FUZZ_REQUIRE(searched.lower_bound == greedy.lower_bound);
  if (small) {
    const std::uint64_t optimum = brute_force_optimum(buffers, alignment);
    TENSORMEM_FUZZ_REQUIRE(searched.optimal);
    TENSORMEM_FUZZ_REQUIRE(searched.arena_bytes == optimum);
    TENSORMEM_FUZZ_REQUIRE(greedy.arena_bytes >= optimum);
  } else if (searched.optimal) {
    TENSORMEM_FUZZ_REQUIRE(searched.arena_bytes <= greedy.arena_bytes);
  }
}

}  // namespace tensormem::fuzz
