#include "tensormem/arena/contiguous_arena.hpp"

#include <algorithm>
#include <atomic>
#include <limits>
#include <cstring>
#include <stdexcept>

#include "tensormem/core/align.hpp"
#include "tensormem/core/allocation.hpp"
#include "tensormem/core/compaction.hpp"
#include "move_down.hpp"
#include "tensormem/memory/detail/poison.hpp"
#include "tensormem/memory/cuda_resources.hpp"

namespace tensormem::arena {

arena_out_of_memory::arena_out_of_memory(std::uint64_t requested, std::uint64_t free,
                                         std::uint64_t largest_free)
    : memory::out_of_memory("contiguous_arena: cannot allocate " + std::to_string(requested) +
                            " bytes: " + std::to_string(free) + " bytes free, largest hole " +
                            std::to_string(largest_free) + " bytes"),
      requested_(requested), free_(free), largest_free_(largest_free) {}

namespace {

constexpr unsigned id_counter_bits = 40;

// The arena's part of every id it hands out: 24 bits, never 0, from a process-wide counter.
std::uint64_t next_arena_serial() noexcept {
  static std::atomic<std::uint64_t> next{0};
  for (;;) {
    const std::uint64_t serial = (next.fetch_add(1, std::memory_order_relaxed) + 1) & 0xffffffU;
    if (serial != 0) return serial;
  }
}

bool host_poisonable(const memory::memory_resource& r) noexcept { return r.host_accessible(); }

// The alignment, checked before the offset allocator sees it, so that the error names the arena.
std::uint64_t arena_alignment(std::uint64_t alignment) {
  core::check_alignment_argument("contiguous_arena", alignment);
  return alignment;
}

}  // namespace

contiguous_arena::contiguous_arena(memory::memory_resource& resource, std::uint64_t capacity,
                                   arena_options options)
    : resource_(resource), capacity_(capacity), options_(options),
      offsets_(capacity, arena_alignment(options.alignment)), serial_(next_arena_serial()),
      next_id_(serial_ << id_counter_bits | 1U) {
  if (options_.alignment > 4096) {
    throw std::invalid_argument("contiguous_arena: alignment above 4096 is not supported");
  }
  if (capacity > std::numeric_limits<std::size_t>::max()) {
    throw arena_out_of_memory(capacity, 0, 0);
  }
  base_ = static_cast<std::byte*>(
      resource_.allocate(static_cast<std::size_t>(capacity), std::max<std::size_t>(256, options_.alignment)));
  if (host_poisonable(resource_)) memory::detail::poison(base_, static_cast<std::size_t>(capacity_));
}

contiguous_arena::~contiguous_arena() {
  if (host_poisonable(resource_)) memory::detail::unpoison(base_, static_cast<std::size_t>(capacity_));
  resource_.deallocate(base_, static_cast<std::size_t>(capacity_),
                       std::max<std::size_t>(256, options_.alignment));
}

void contiguous_arena::check_owner(std::uint64_t id, const char* what) const {
  if (const std::uint64_t serial = id >> id_counter_bits; serial != serial_) {
    // Serial 0 is never issued: such a number was made by no arena at all.
    throw std::invalid_argument(std::string("contiguous_arena: ") + what + " of tensor " + std::to_string(id) +
                                (serial == 0 ? ", which no arena handed out (not a tensor id)"
                                             : ", which belongs to another arena"));
  }
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
  // Strong guarantee: the index nodes of the new tensor exist before anything changes, and
  // a defragmentation allocates the tensor in the rebuilt allocator before any byte moves.
  // Id 0 and offset 2^64 - 1 are never real, so the placeholders collide with nothing.
  live_.reserve(live_.size() + 1);
  auto live_node = live_.extract(live_.emplace(0, entry{}).first);
  if (bytes == 0) {
    live_node.key() = id;
    live_.insert(std::move(live_node));
    ++next_id_;
    return {id, 0, 0, base_};
  }
  const auto aligned = core::align_up(bytes, options_.alignment);
  const core::allocator_stats s = offsets_.stats();
  if (!aligned || *aligned > s.free_bytes) {
    throw arena_out_of_memory(bytes, s.free_bytes, s.largest_free_bytes);
  }
  auto offset_node =
      by_offset_.extract(by_offset_.emplace(std::numeric_limits<std::uint64_t>::max(), 0).first);
  auto where = offsets_.allocate(*aligned);
  if (!where) where = defragment_for(*aligned, *aligned);
  if (!where) throw std::logic_error("contiguous_arena: no hole after defragmentation");
  // Nothing below allocates or throws.
  live_node.key() = id;
  live_node.mapped().offset = where->offset;
  live_node.mapped().bytes = bytes;
  live_node.mapped().reserved = where->bytes;
  live_.insert(std::move(live_node));
  offset_node.key() = where->offset;
  offset_node.mapped() = id;
  by_offset_.insert(std::move(offset_node));
  ++next_id_;
  max_allocated_ = std::max(max_allocated_, offsets_.used());
  if (host_poisonable(resource_)) memory::detail::unpoison(base_ + where->offset, static_cast<std::size_t>(bytes));
  return {id, where->offset, bytes, base_};
}

void contiguous_arena::release(std::uint64_t id) {
  check_owner(id, "release");
  const auto it = live_.find(id);
  if (it == live_.end()) {
    throw std::invalid_argument("contiguous_arena: release of tensor " + std::to_string(id) +
                                (id < next_id_ ? ", which was already released"
                                               : ", which this arena never allocated"));
  }
  if (it->second.reserved != 0) {
    offsets_.free(it->second.offset, it->second.reserved);
    by_offset_.erase(it->second.offset);
    if (host_poisonable(resource_)) {
      memory::detail::poison(base_ + it->second.offset, static_cast<std::size_t>(it->second.reserved));
    }
  }
  live_.erase(it);
}

void contiguous_arena::bind(std::uint64_t id, arena_observer observer) {
  check_owner(id, "bind");
  const auto it = live_.find(id);
  if (it == live_.end()) {
    throw std::invalid_argument("contiguous_arena: bind to tensor " + std::to_string(id) +
                                ", which is not live");
  }
  it->second.observers.push_back(std::move(observer));
}

tensor_block contiguous_arena::block(std::uint64_t id) const {
  check_owner(id, "lookup");
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

bool contiguous_arena::defragment(std::uint64_t bytes) {
  if (bytes == 0) bytes = 1;
  const auto aligned = core::align_up(bytes, options_.alignment);
  if (!aligned) return false;
  return defragment_for(*aligned, 0).has_value();
}

std::optional<core::allocation> contiguous_arena::defragment_for(std::uint64_t bytes,
                                                                 std::uint64_t allocate_bytes) {
  std::vector<core::placed_block> placed;
  placed.reserve(by_offset_.size());
  for (const auto& [offset, id] : by_offset_) placed.push_back({offset, live_.at(id).reserved, id});
  std::vector<core::block_move> moves;
  if (options_.policy == defrag_policy::full_compaction) {
    if (offsets_.stats().free_bytes < bytes) return std::nullopt;
    moves = core::plan_full_compaction(placed);
  } else {
    auto plan = core::plan_minimal_move(placed, capacity_, bytes);
    if (!plan) return std::nullopt;
    moves = std::move(*plan);
  }
  // Strong guarantee: the new offset index and allocator are built before a byte moves, so
  // a std::bad_alloc leaves the arena as it was. From the first move on nothing allocates.
  std::map<std::uint64_t, std::uint64_t> new_by_offset = by_offset_;
  for (const core::block_move& m : moves) new_by_offset.erase(m.from);
  for (const core::block_move& m : moves) new_by_offset.emplace(m.to, m.id);
  core::best_fit_allocator rebuilt(capacity_, options_.alignment);
  for (const auto& [offset, id] : new_by_offset) {
    if (!rebuilt.allocate_at(offset, live_.at(id).reserved)) {
      throw std::logic_error("contiguous_arena: overlapping blocks after defragmentation");
    }
  }
  // The new tensor's place, or a placeholder that says the hole opened (defragment()).
  std::optional<core::allocation> result = core::allocation{};
  if (allocate_bytes != 0) {
    result = rebuilt.allocate(allocate_bytes);
    if (!result) throw std::logic_error("contiguous_arena: no hole after defragmentation");
  }
  const bool poisoned = host_poisonable(resource_);
  if (poisoned) memory::detail::unpoison(base_, static_cast<std::size_t>(capacity_));
  // Moves go down in address order: each copy lands below its source and above everything
  // already moved, so an overlap-tolerant copy keeps every byte.
  for (const core::block_move& m : moves) {
    move_bytes(base_ + m.to, base_ + m.from, static_cast<std::size_t>(m.bytes));
    live_.find(m.id)->second.offset = m.to;
    bytes_moved_ += m.bytes;
    ++moves_;
  }
  by_offset_.swap(new_by_offset);
  offsets_ = std::move(rebuilt);
  ++defragmentations_;
  if (poisoned) poison_free_ranges();
  for (const core::block_move& m : moves) {
    const entry& e = live_.find(m.id)->second;
    const tensor_block moved{m.id, e.offset, e.bytes, base_};
    for (const arena_observer& observer : e.observers) {
      [&]() noexcept { observer(moved); }();
    }
  }
  return result;
}

// Poisons every byte no live tensor holds (alignment padding included) for AddressSanitizer.
void contiguous_arena::poison_free_ranges() noexcept {
  std::uint64_t cursor = 0;
  for (const auto& [offset, id] : by_offset_) {
    if (offset > cursor) memory::detail::poison(base_ + cursor, static_cast<std::size_t>(offset - cursor));
    const entry& e = live_.find(id)->second;
    if (e.reserved > e.bytes) {
      memory::detail::poison(base_ + offset + e.bytes, static_cast<std::size_t>(e.reserved - e.bytes));
    }
    cursor = offset + e.reserved;
  }
  if (capacity_ > cursor) memory::detail::poison(base_ + cursor, static_cast<std::size_t>(capacity_ - cursor));
}

std::string contiguous_arena::print_allocation(std::size_t resolution) const {
  if (resolution > max_resolution) {
    throw std::invalid_argument("contiguous_arena::print_allocation: " + std::to_string(resolution) +
                                " cells; at most " + std::to_string(max_resolution));
  }
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
