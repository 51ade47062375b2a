#include "tensormem/core/allocation.hpp"

#include <algorithm>
#include <atomic>
#include <string>

#include "tensormem/core/align.hpp"

namespace tensormem::core {

void throw_free_error(const char* allocator_name, free_status status, std::uint64_t offset,
                      std::uint64_t bytes, std::uint64_t allocated_bytes) {
  std::string msg = std::string(allocator_name) + ": cannot free offset " +
                    std::to_string(offset) + " (" + std::to_string(bytes) + " bytes): ";
  switch (status) {
    case free_status::not_allocated:
      msg += "no live allocation starts there (unknown offset or double free)";
      break;
    case free_status::size_mismatch:
      msg += "the allocation there holds " + std::to_string(allocated_bytes) + " bytes";
      break;
    case free_status::stale_handle:
      msg += "the handle does not name a live allocation (double free or foreign handle)";
      break;
    case free_status::foreign_handle:
      msg += "the handle belongs to another allocator";
      break;
    case free_status::ok:
      msg += "internal error";
      break;
  }
  throw allocator_misuse(msg);
}

std::uint64_t next_owner_id() noexcept {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

void add_untouched_tail(allocator_stats& s, std::uint64_t end, std::uint64_t peak,
                        std::uint64_t tail_free_bytes) noexcept {
  if (end <= peak) return;
  if (tail_free_bytes == 0) ++s.free_blocks;  // otherwise that block is counted already
  s.largest_free_bytes = std::max(s.largest_free_bytes, end - peak + tail_free_bytes);
}

void check_alignment_argument(const char* allocator_name, std::uint64_t alignment) {
  if (!is_power_of_two(alignment)) {
    throw std::invalid_argument(std::string(allocator_name) + ": alignment " +
                                std::to_string(alignment) + " is not a power of two");
  }
}

}  // namespace tensormem::core
