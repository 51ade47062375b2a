#pragma once
// Formatting helpers shared by the sub-commands.

#include <cstdint>
#include <string>

namespace tensormem::cli {

/// "1.41 GiB", "12.0 MiB", "512 B".
std::string human_bytes(std::uint64_t bytes);
/// high / low with four decimals, or "n/a" when low is zero.
std::string ratio_text(std::uint64_t high, std::uint64_t low);
double ratio_of(std::uint64_t high, std::uint64_t low);

}  // namespace tensormem::cli
