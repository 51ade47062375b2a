#pragma once
// Formatting helpers shared by the sub-commands.

#include <chrono>
#include <cstdint>
#include <string>

namespace tensormem::cli {

/// "1.41 GiB", "12.0 MiB", "512 B".
std::string human_bytes(std::uint64_t bytes);
/// high / low with four decimals: 1.0000 when both are zero (nothing to place, nothing
/// used), "n/a" when only low is.
std::string ratio_text(std::uint64_t high, std::uint64_t low);
/// high / low: 1 when both are zero, infinity when only low is.
double ratio_of(std::uint64_t high, std::uint64_t low);
/// Seconds of the steady clock since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace tensormem::cli
