#include "tensormem/core/compaction.hpp"

namespace tensormem::core {

namespace {

// Slides blocks [first, last) down so that they start at `to`, keeping their order.
void slide(std::span<const placed_block> blocks, std::size_t first, std::size_t last,
           std::uint64_t to, std::vector<block_move>& moves) {
  for (std::size_t k = first; k < last; ++k) {
    const placed_block& b = blocks[k];
    if (b.offset != to) moves.push_back({b.id, b.offset, to, b.bytes});
    to += b.bytes;
  }
}

}  // namespace

std::vector<block_move> plan_full_compaction(std::span<const placed_block> blocks) {
  std::vector<block_move> moves;
  slide(blocks, 0, blocks.size(), 0, moves);
  return moves;
}

std::optional<std::vector<block_move>> plan_minimal_move(std::span<const placed_block> blocks,
                                                         std::uint64_t capacity,
                                                         std::uint64_t need) {
  const std::size_t n = blocks.size();
  // gap[k]: free bytes before block k (gap[n]: after the last block, up to capacity).
  std::vector<std::uint64_t> gap(n + 1);
  std::uint64_t cursor = 0;
  std::uint64_t free_total = 0;
  for (std::size_t k = 0; k < n; ++k) {
    gap[k] = blocks[k].offset - cursor;
    free_total += gap[k];
    cursor = blocks[k].offset + blocks[k].bytes;
  }
  gap[n] = capacity - cursor;
  free_total += gap[n];
  if (free_total < need) return std::nullopt;

  // Window of gaps [i, j]: blocks i .. j-1 slide down onto the start of gap i, opening
  // gap[i] + ... + gap[j] bytes at the window's top; cost = bytes of blocks i .. j-1.
  std::size_t best_i = 0;
  std::size_t best_j = n;
  std::uint64_t best_cost = UINT64_MAX;
  std::size_t j = 0;
  std::uint64_t window_free = gap[0];
  std::uint64_t window_cost = 0;
  for (std::size_t i = 0; i <= n; ++i) {
    if (j < i) {  // restart the window at i
      j = i;
      window_free = gap[i];
      window_cost = 0;
    }
    while (window_free < need && j < n) {
      window_cost += blocks[j].bytes;
      ++j;
      window_free += gap[j];
    }
    if (window_free < need) break;  // no window starting at i or later is large enough
    if (window_cost < best_cost) {
      best_cost = window_cost;
      best_i = i;
      best_j = j;
    }
    if (i < n) {  // drop gap i and block i from the window
      window_free -= gap[i];
      if (j > i) window_cost -= blocks[i].bytes;
    }
  }
  std::vector<block_move> moves;
  const std::uint64_t start = best_i == 0 ? 0 : blocks[best_i - 1].offset + blocks[best_i - 1].bytes;
  slide(blocks, best_i, best_j, start, moves);
  return moves;
}

}  // namespace tensormem::core
