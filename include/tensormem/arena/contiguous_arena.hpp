#pragma once
// A fixed buffer that hands out tensors and defragments itself.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/memory/errors.hpp"
#include "tensormem/memory/memory_resource.hpp"

namespace tensormem::arena {

/// A tensor's place in the arena. `data()` is valid until the tensor is released or moved
/// by a defragmentation (observers learn the new place; `contiguous_arena::block(id)` tells
/// it too).
struct tensor_block {
  std::uint64_t id = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;  ///< as requested (the arena reserves it rounded to its alignment)
  std::byte* base = nullptr;
  std::byte* data() const noexcept { return base + offset; }
};

enum class defrag_policy {
  minimal_move,     ///< move the fewest bytes that open a large enough hole
  full_compaction,  ///< slide every tensor down (DeepSpeed's behaviour)
};

struct arena_options {
  std::uint64_t alignment = 256;  ///< power of two; 1 gives byte-exact placement
  defrag_policy policy = defrag_policy::minimal_move;
};

struct arena_stats {
  std::uint64_t capacity_bytes = 0;
  std::uint64_t used_bytes = 0;          ///< reserved by live tensors (aligned)
  std::uint64_t free_bytes = 0;
  std::uint64_t largest_free_bytes = 0;
  std::uint64_t max_allocated_bytes = 0;  ///< most bytes in use at once
  std::uint64_t live_tensors = 0;
  std::uint64_t defragmentations = 0;
  std::uint64_t bytes_moved = 0;
  std::uint64_t moves = 0;
};

/// Called after a defragmentation moved the tensor it is bound to, with its new place,
/// before `allocate` returns. Must not throw (a throwing observer terminates the program).
using arena_observer = std::function<void(const tensor_block&)>;

/// The contract of DeepSpeed's ContiguousMemoryAllocator over any memory resource.
///
/// - The arena owns one buffer of `capacity` bytes from the resource for its lifetime.
/// - `allocate(bytes)`: when the free bytes are short, throws arena_out_of_memory naming the
///   requested, free and largest free bytes, and nothing changes. When they suffice but no
///   hole fits, the arena defragments first (policy above), moving tensor bytes with a copy
///   suited to the memory (memmove on the host, device copies for CUDA memory), preserving
///   every live tensor's contents, then tells each bound observer of a moved tensor its new
///   place, then allocates. A zero-byte tensor gets its own id, occupies nothing and never
///   moves. Ids are unique for the arena's lifetime.
/// - `release(id)` / `release(block)`: an unknown or already released id, or an id of another
///   arena, throws std::invalid_argument and nothing changes. Releasing drops the tensor's
///   observers. Ids carry the arena that made them (24 bits of a process-wide arena serial,
///   40 bits of counter), so another arena's id is recognised, not mistaken for one's own.
/// - Exception safety: a throwing `allocate` or `defragment` changes nothing (the new layout
///   is built before any byte moves); `release` either succeeds or throws before changing
///   anything.
/// - Under AddressSanitizer every byte of host memory that no live tensor holds is poisoned,
///   so a stale pointer into a released or moved tensor is reported.
/// - Placement inside the buffer is exact best fit (best_fit_allocator).
/// Thread safety: none; synchronize externally (one arena per thread, or a lock around it).
class contiguous_arena {
 public:
  contiguous_arena(memory::memory_resource& resource, std::uint64_t capacity,
                   arena_options options = {});
  ~contiguous_arena();
  contiguous_arena(const contiguous_arena&) = delete;
  contiguous_arena& operator=(const contiguous_arena&) = delete;

  tensor_block allocate(std::uint64_t bytes);
  void release(std::uint64_t id);
  void release(const tensor_block& block) { release(block.id); }
  /// Adds an observer to a live tensor (DeepSpeed's assign_to_param).
  void bind(std::uint64_t id, arena_observer observer);
  /// Where tensor `id` is now; std::invalid_argument when it is not live.
  tensor_block block(std::uint64_t id) const;
  bool contains(std::uint64_t id) const noexcept { return live_.contains(id); }
  /// Live tensors in address order.
  std::vector<tensor_block> blocks() const;

  /// Defragments now with the arena's policy so that the largest hole is at least `bytes`
  /// (full compaction: all free space in one hole). Returns false, changing nothing, when
  /// the free bytes are fewer than `bytes`.
  bool defragment(std::uint64_t bytes);

  /// One line of `resolution` cells: '|' where a cell holds any used byte, '.' where it is
  /// all free (DeepSpeed's picture). More than `max_resolution` cells is
  /// std::invalid_argument (2^63 was a length error from std::string, 2^40 a terabyte).
  std::string print_allocation(std::size_t resolution = 200) const;
  static constexpr std::size_t max_resolution = 1'000'000;
  std::uint64_t max_allocated() const noexcept { return max_allocated_; }
  arena_stats stats() const;
  std::byte* base() const noexcept { return base_; }
  std::uint64_t capacity() const noexcept { return capacity_; }
  const arena_options& options() const noexcept { return options_; }

 private:
  struct entry {
    std::uint64_t offset;
    std::uint64_t bytes;     // as requested
    std::uint64_t reserved;  // aligned
    std::vector<arena_observer> observers;
  };
  void move_bytes(std::byte* dst, const std::byte* src, std::size_t bytes);
  void check_owner(std::uint64_t id, const char* what) const;
  /// Defragments so that a hole of `bytes` (aligned) opens; when `allocate_bytes` is not 0,
  /// also allocates that many bytes in the new layout before anything moves. Empty when
  /// the free bytes do not suffice (nothing changed).
  std::optional<core::allocation> defragment_for(std::uint64_t bytes, std::uint64_t allocate_bytes);
  void poison_free_ranges() noexcept;

  memory::memory_resource& resource_;
  std::uint64_t capacity_;
  arena_options options_;
  std::byte* base_ = nullptr;
  core::best_fit_allocator offsets_;
  std::unordered_map<std::uint64_t, entry> live_;
  std::map<std::uint64_t, std::uint64_t> by_offset_;  // offset -> id (non-empty tensors)
  std::uint64_t serial_;   // this arena's part of every id it hands out
  std::uint64_t next_id_;
  std::uint64_t max_allocated_ = 0;
  std::uint64_t defragmentations_ = 0;
  std::uint64_t bytes_moved_ = 0;
  std::uint64_t moves_ = 0;
};

/// The arena cannot hold a request: fewer free bytes than asked.
class arena_out_of_memory : public memory::out_of_memory {
 public:
  arena_out_of_memory(std::uint64_t requested, std::uint64_t free, std::uint64_t largest_free);
  std::uint64_t requested_bytes() const noexcept { return requested_; }
  std::uint64_t free_bytes() const noexcept { return free_; }
  std::uint64_t largest_free_bytes() const noexcept { return largest_free_; }

 private:
  std::uint64_t requested_;
  std::uint64_t free_;
  std::uint64_t largest_free_;
};

}  // namespace tensormem::arena
