#pragma once
// Types shared by the online offset allocators (best_fit_allocator, tlsf_allocator).

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace tensormem::core {

/// One live allocation: where it is, how many bytes it holds (already rounded up to the
/// allocator's alignment), an allocator-private index that lets `deallocate` work in O(1),
/// and the identity of the allocator that made it, so that a handle given to another
/// allocator is recognised as foreign instead of freeing that allocator's block with the
/// same offset. Copyable value; valid until it is deallocated.
struct allocation {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint32_t node = 0;        ///< allocator-private metadata index
  std::uint32_t generation = 0;  ///< allocator-private; detects stale handles
  std::uint64_t owner = 0;       ///< the allocator that made it (see next_owner_id)

  friend bool operator==(const allocation&, const allocation&) = default;
};

/// A process-wide unique identity for a new allocator (never 0). Thread-safe.
std::uint64_t next_owner_id() noexcept;

/// Capacity value that selects growing mode: the arena is the high-water mark `peak()`.
inline constexpr std::uint64_t growing = std::numeric_limits<std::uint64_t>::max();

/// Outcome of a checked free, for callers that do not want exceptions.
enum class free_status {
  ok,             ///< freed
  not_allocated,  ///< no live allocation starts at that offset (unknown or double free)
  size_mismatch,  ///< an allocation starts there but holds another number of bytes
  stale_handle,   ///< the handle does not name a live allocation of this allocator
  foreign_handle, ///< the handle was made by another allocator
};

/// Counters every online allocator reports. All values are bytes unless named otherwise.
struct allocator_stats {
  std::uint64_t used_bytes = 0;       ///< sum of live allocations (aligned sizes)
  std::uint64_t peak_bytes = 0;       ///< high-water mark: highest end offset ever handed out
  std::uint64_t free_bytes = 0;       ///< capacity (or peak when growing) minus used
  std::uint64_t free_blocks = 0;      ///< number of maximal free ranges, the tail included
  std::uint64_t largest_free_bytes = 0;
  std::uint64_t live_allocations = 0;
  /// 1 - largest_free / free_bytes; 0 when nothing is free.
  double fragmentation() const noexcept {
    return free_bytes == 0 ? 0.0
                           : 1.0 - static_cast<double>(largest_free_bytes) /
                                       static_cast<double>(free_bytes);
  }
};

/// Fixed-capacity accounting shared by the allocators' stats(): the untouched range
/// [peak, end) is free, and joins a free block of `tail_free_bytes` that ends at the peak
/// (0 when there is none).
void add_untouched_tail(allocator_stats& s, std::uint64_t end, std::uint64_t peak,
                        std::uint64_t tail_free_bytes) noexcept;

/// Thrown by the allocators' throwing `free`/`deallocate` on misuse. The allocator is unchanged.
class allocator_misuse : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Builds the message for a failed free and throws allocator_misuse.
[[noreturn]] void throw_free_error(const char* allocator_name, free_status status,
                                   std::uint64_t offset, std::uint64_t bytes,
                                   std::uint64_t allocated_bytes);

/// Validates an alignment given to a constructor; throws std::invalid_argument.
void check_alignment_argument(const char* allocator_name, std::uint64_t alignment);

}  // namespace tensormem::core
