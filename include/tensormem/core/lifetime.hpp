#pragma once
// Buffers with known lifetimes: the input of the planner and of online replay.

#include <cstdint>
#include <optional>
#include <span>
#include <string>

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
/// more than 2^64 - 1 bytes are alive at once (no plan in 64-bit offsets exists). O(n log n).
std::uint64_t lower_bound(std::span<const buffer> buffers, std::uint64_t alignment = 1);

}  // namespace tensormem::core
