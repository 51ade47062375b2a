#include "report.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "tensormem/memory/pinned_host_resource.hpp"

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

void refuse_past_memory(const std::string& command, const std::string& what, std::size_t count,
                        const char* counted, std::uint64_t bytes_per_buffer) {
  const auto shortfall = memory::memory_shortfall_for(count, bytes_per_buffer);
  if (!shortfall) return;
  throw std::invalid_argument(fmt::format(
      "{}: {}: {} {} need about {} of memory to {} (about {} bytes a buffer), more than this machine's {}", command,
      what, count, counted, human_bytes(shortfall->need_bytes), command, bytes_per_buffer,
      human_bytes(shortfall->memory_bytes)));
}

void refuse_trace_past_memory(const std::string& command, const std::string& path, std::uint64_t bytes_per_buffer) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) return;
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chunk(std::size_t{1} << 20);
  std::size_t lines = 0;
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    lines += static_cast<std::size_t>(std::count(chunk.data(), chunk.data() + in.gcount(), '\n'));
  }
  refuse_past_memory(command, path, lines, "lines", bytes_per_buffer);
}

std::string unlocked_memory_note(std::uint64_t slabs, const std::string& what) {
  const std::size_t limit = memory::memlock_limit_bytes();
  const std::string limit_text =
      limit == std::numeric_limits<std::size_t>::max() ? std::string("unlimited") : human_bytes(limit);
  return fmt::format("{} slab(s) could not be page-locked (RLIMIT_MEMLOCK is {}; raise it with `ulimit -l` or run "
                     "with CAP_IPC_LOCK): {} used unlocked memory",
                     slabs, limit_text, what);
}

}  // namespace tensormem::cli
