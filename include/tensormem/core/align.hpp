#pragma once
// Alignment arithmetic on byte counts and offsets. Pure functions, no exceptions.

#include <bit>
#include <cstdint>
#include <limits>
#include <optional>

namespace tensormem::core {

/// True when `alignment` is a power of two (zero is not).
constexpr bool is_power_of_two(std::uint64_t alignment) noexcept {
  return std::has_single_bit(alignment);
}

/// `bytes` rounded up to a multiple of `alignment` (a power of two), or empty when the
/// result does not fit in 64 bits.
constexpr std::optional<std::uint64_t> align_up(std::uint64_t bytes,
                                                std::uint64_t alignment) noexcept {
  const std::uint64_t mask = alignment - 1;
  if (bytes > std::numeric_limits<std::uint64_t>::max() - mask) return std::nullopt;
  return (bytes + mask) & ~mask;
}

/// True when `value` is a multiple of `alignment` (a power of two).
constexpr bool is_aligned(std::uint64_t value, std::uint64_t alignment) noexcept {
  return (value & (alignment - 1)) == 0;
}

}  // namespace tensormem::core
