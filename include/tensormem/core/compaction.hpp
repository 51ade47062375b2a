#pragma once
// Planning the moves that defragment an arena. Pure offset arithmetic.

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace tensormem::core {

/// A live block of an arena.
struct placed_block {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t id = 0;
};

/// Move `bytes` of block `id` from `from` to `to` (to < from in every plan below).
struct block_move {
  std::uint64_t id = 0;
  std::uint64_t from = 0;
  std::uint64_t to = 0;
  std::uint64_t bytes = 0;
};

/// Full compaction, as DeepSpeed's ContiguousMemoryAllocator does it: every block slides down
/// in address order so that all free space ends up at the top. `blocks` sorted by offset.
/// The moves, applied in order, are safe with an overlap-tolerant copy (memmove).
std::vector<block_move> plan_full_compaction(std::span<const placed_block> blocks);

/// Minimal-move compaction: among all compactions of one contiguous address range (the
/// blocks between two gaps slide down until the range's free space is one hole at its
/// top), the one that opens at least `need` contiguous bytes while moving the fewest bytes
/// (the lowest such range where several move equally few).
/// Two pointers over the gaps: O(n). Returns nothing when the free bytes in `[0, capacity)`
/// are fewer than `need`. `blocks` sorted by offset, all inside `[0, capacity)`.
/// Compared with full compaction it never moves more and usually far less: blocks below and
/// above the chosen range stay where they are.
std::optional<std::vector<block_move>> plan_minimal_move(std::span<const placed_block> blocks,
                                                         std::uint64_t capacity,
                                                         std::uint64_t need);

}  // namespace tensormem::core
