#include "report.hpp"

#include <limits>

#include <fmt/format.h>

namespace tensormem::cli {

std::string human_bytes(std::uint64_t bytes) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  auto value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(units)) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.2f} {}", value, units[unit]);
}

double ratio_of(std::uint64_t high, std::uint64_t low) {
  // Nothing to place (a lower bound of 0) and nothing used is the bound met, as in
  // plan_result::ratio().
  if (low == 0) return high == 0 ? 1.0 : std::numeric_limits<double>::infinity();
  return static_cast<double>(high) / static_cast<double>(low);
}

std::string ratio_text(std::uint64_t high, std::uint64_t low) {
  if (low == 0 && high != 0) return "n/a";
  return fmt::format("{:.4f}", ratio_of(high, low));
}

}  // namespace tensormem::cli
