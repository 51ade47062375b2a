#include "tensormem/arena/contiguous_arena.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "tensormem/core/align.hpp"
#include "tensormem/core/compaction.hpp"
#include "move_down.hpp"
#include "tensormem/memory/cuda_resources.hpp"

namespace tensormem::arena {

arena_out_of_memory::arena_out_of_memory(std::uint64_t requested, std::uint64_t free,
                                         std::uint64_t largest_free)
    : memory::out_of_memory("contiguous_arena: cannot allocate " + std::to_string(requested) +
                            " bytes: " + std::to_string(free) + " bytes free, largest hole " +
                            std::to_string(largest_free) + " bytes"),
      requested_(requested), free_(free), largest_free_(largest_free) {}

contiguous_arena::contiguous_arena(memory::memory_resource& resource, std::uint64_t capacity,
                                   arena_options options)
    : resource_(resource), capacity_(capacity), options_(options),
      offsets_(capacity, options.alignment) {
  if (options_.alignment > 4096) {
    throw std::invalid_argument("contiguous_arena: alignment above 4096 is not supported");
  }
  base_ = static_cast<std::byte*>(
      resource_.allocate(static_cast<std::size_t>(capacity), std::max<std::size_t>(256, options_.alignment)));
}

contiguous_arena::~contiguous_arena() {
  resource_.deallocate(base_, static_cast<std::size_t>(capacity_),
                       std::max<std::size_t>(256, options_.alignment));
}

void contiguous_arena::move_bytes(std::byte* dst, const std::byte* src, std::size_t bytes) {
  if (resource_.kind() == memory::memory_kind::cuda_device) {
    memory::cuda_move(dst, src, bytes);
  } else {
    detail::move_down(dst, src, bytes);  // every defragmentation move goes down
  }
}

tensor_block contiguous_arena::allocate(std::uint64_t bytes) {
  const std::uint64_t id = next_id_;
  if (bytes == 0) {
    live_.emplace(id, entry{0, 0, 0, {}});
    ++next_id_;
    return {id, 0, 0, base_};
  }
  const auto aligned = core::align_up(bytes, options_.alignment);
  const core::allocator_stats s = offsets_.stats();
  if (!aligned || *aligned > s.free_bytes) {
    throw arena_out_of_memory(bytes, s.free_bytes, s.largest_free_bytes);
  }
  auto where = offsets_.allocate(*aligned);
  if (!where) {
    defragment(*aligned);
    where = offsets_.allocate(*aligned);
    if (!where) throw std::logic_error("contiguous_arena: no hole after defragmentation");
  }
  try {
    live_.emplace(id, entry{where->offset, bytes, where->bytes, {}});
    by_offset_.emplace(where->offset, id);
  } catch (...) {
    live_.erase(id);
    offsets_.deallocate(*where);
    throw;
  }
  ++next_id_;
  max_allocated_ = std::max(max_allocated_, offsets_.used());
  return {id, where->offset, bytes, base_};
}

void contiguous_arena::release(std::uint64_t id) {
  const auto it = live_.find(id);
  if (it == live_.end()) {
    throw std::invalid_argument("contiguous_arena: release of tensor " + std::to_string(id) +
                                (id != 0 && id < next_id_ ? ", which was already released"
                                                          : ", which this arena never allocated"));
  }
  if (it->second.reserved != 0) {
    offsets_.free(it->second.offset, it->second.reserved);
    by_offset_.erase(it->second.offset);
  }
  live_.erase(it);
}

void contiguous_arena::bind(std::uint64_t id, arena_observer observer) {
  const auto it = live_.find(id);
  if (it == live_.end()) {
    throw std::invalid_argument("contiguous_arena: bind to tensor " + std::to_string(id) +
                                ", which is not live");
  }
  it->second.observers.push_back(std::move(observer));
}

tensor_block contiguous_arena::block(std::uint64_t id) const {
  const auto it = live_.find(id);
  if (it == live_.end()) {
    throw std::invalid_argument("contiguous_arena: tensor " + std::to_string(id) + " is not live");
  }
  return {id, it->second.offset, it->second.bytes, base_};
}

std::vector<tensor_block> contiguous_arena::blocks() const {
  std::vector<tensor_block> out;
  for (const auto& [offset, id] : by_offset_) out.push_back(block(id));
  return out;
}

void contiguous_arena::rebuild_allocator() {
  core::best_fit_allocator rebuilt(capacity_, options_.alignment);
  for (const auto& [offset, id] : by_offset_) {
    if (!rebuilt.allocate_at(offset, live_.at(id).reserved)) {
      throw std::logic_error("contiguous_arena: overlapping blocks after defragmentation");
    }
  }
  offsets_ = std::move(rebuilt);
}

bool contiguous_arena::defragment(std::uint64_t bytes) {
  std::vector<core::placed_block> placed;
  placed.reserve(by_offset_.size());
  for (const auto& [offset, id] : by_offset_) placed.push_back({offset, live_.at(id).reserved, id});
  std::vector<core::block_move> moves;
  if (options_.policy == defrag_policy::full_compaction) {
    if (offsets_.stats().free_bytes < bytes) return false;
    moves = core::plan_full_compaction(placed);
  } else {
    auto plan = core::plan_minimal_move(placed, capacity_, bytes);
    if (!plan) return false;
    moves = std::move(*plan);
  }
  // Moves go down in address order: each copy lands below its source and above everything
  // already moved, so an overlap-tolerant copy keeps every byte.
  std::map<std::uint64_t, std::uint64_t> moved_offsets;
  for (const core::block_move& m : moves) {
    move_bytes(base_ + m.to, base_ + m.from, static_cast<std::size_t>(m.bytes));
    by_offset_.erase(m.from);
    live_.at(m.id).offset = m.to;
    moved_offsets.emplace(m.to, m.id);
    bytes_moved_ += m.bytes;
    ++moves_;
  }
  by_offset_.merge(moved_offsets);
  ++defragmentations_;
  rebuild_allocator();
  for (const core::block_move& m : moves) {
    const entry& e = live_.at(m.id);
    const tensor_block moved{m.id, e.offset, e.bytes, base_};
    for (const arena_observer& observer : e.observers) {
      [&]() noexcept { observer(moved); }();
    }
  }
  return true;
}

std::string contiguous_arena::print_allocation(std::size_t resolution) const {
  std::string line(resolution, '.');
  if (resolution == 0 || capacity_ == 0) return line;
  const long double scale = static_cast<long double>(resolution) / static_cast<long double>(capacity_);
  for (const auto& [offset, id] : by_offset_) {
    const std::uint64_t end = offset + live_.at(id).reserved;
    auto first = static_cast<std::size_t>(static_cast<long double>(offset) * scale);
    auto last = static_cast<std::size_t>(static_cast<long double>(end - 1) * scale);
    last = std::min(last, resolution - 1);
    for (std::size_t c = first; c <= last; ++c) line[c] = '|';
  }
  return line;
}

arena_stats contiguous_arena::stats() const {
  const core::allocator_stats s = offsets_.stats();
  arena_stats a;
  a.capacity_bytes = capacity_;
  a.used_bytes = s.used_bytes;
  a.free_bytes = s.free_bytes;
  a.largest_free_bytes = s.largest_free_bytes;
  a.max_allocated_bytes = max_allocated_;
  a.live_tensors = live_.size();
  a.defragmentations = defragmentations_;
  a.bytes_moved = bytes_moved_;
  a.moves = moves_;
  return a;
}

}  // namespace tensormem::arena
