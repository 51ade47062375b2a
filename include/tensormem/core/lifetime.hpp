#pragma once
// Buffers with known lifetimes: the input of the planner and of online replay.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace tensormem::core {

/// One buffer of a trace: `bytes` bytes alive during the half-open interval of time steps
/// `[lower, upper)`. Two buffers conflict when their lifetimes and their byte ranges overlap.
/// `offset` holds a placement when the trace carries a solution.
struct buffer {
  std::string id;
  std::uint64_t lower = 0;
  std::uint64_t upper = 0;
  std::uint64_t bytes = 0;
  std::optional<std::uint64_t> offset;
};

/// True when the lifetimes of `a` and `b` overlap (half-open intervals).
constexpr bool lifetimes_overlap(const buffer& a, const buffer& b) noexcept {
  return a.lower < b.upper && b.lower < a.upper;
}

/// The lower bound of every plan: the largest total of sizes (each rounded up to
/// `alignment`, a power of two) alive at one time. Buffers with an empty lifetime
/// (`lower >= upper`) are never alive. Throws std::overflow_error, naming the time, when
/// more than 2^64 - 1 bytes are alive at once (no plan in 64-bit offsets exists), and
/// std::invalid_argument when `alignment` is not a power of two. O(n log n).
std::uint64_t lower_bound(std::span<const buffer> buffers, std::uint64_t alignment = 1);

/// The synthetic family used to measure the planner at scale: `n` buffers (ids "0".."n-1"),
/// with std::mt19937_64(seed) drawing, per buffer and in this order, a start uniform in
/// [0, n), a lifetime floor(2^u) with u uniform in [0, 12) (1 to 4095 steps) and a size
/// floor(2^u) with u uniform in [10, 24) (1 KiB to 16 MiB - 1). About 490 buffers are alive
/// at once whatever n.
std::vector<buffer> synthetic_lifetimes(std::size_t n, std::uint64_t seed);

}  // namespace tensormem::core
