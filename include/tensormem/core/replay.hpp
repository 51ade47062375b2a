#pragma once
// Online replay of a trace through an allocator.

#include <chrono>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensormem/core/allocation.hpp"
#include "tensormem/core/lifetime.hpp"

namespace tensormem::core {

/// One step of an online replay: allocate or free buffer `index`.
struct replay_event {
  std::uint32_t index;
  bool allocate;
};

/// The order in which an online allocator sees a trace: time steps in increasing order; at
/// each step every free comes before any allocation; allocations of one step in file order
/// (frees of one step too).
std::vector<replay_event> replay_order(std::span<const buffer> buffers);

struct replay_result {
  std::vector<std::uint64_t> offsets;  ///< offset of each buffer, in input order
  std::uint64_t high_water = 0;        ///< the allocator's peak after the replay
  std::uint64_t operations = 0;        ///< allocations plus frees
  double seconds = 0;                  ///< time spent inside the allocator calls
};

/// Replays `buffers` through `allocator` (best_fit_allocator, tlsf_allocator or any type with
/// the same allocate/deallocate/peak). Throws std::runtime_error naming the buffer when an
/// allocation fails (fixed capacity too small). Precondition: buffer count below 2^32.
template <class Allocator>
replay_result replay(std::span<const buffer> buffers, Allocator& allocator) {
  const std::vector<replay_event> order = replay_order(buffers);
  std::vector<allocation> handles(buffers.size());
  std::size_t failed = buffers.size();
  const auto start = std::chrono::steady_clock::now();
  for (const replay_event& e : order) {
    if (e.allocate) {
      const auto a = allocator.allocate(buffers[e.index].bytes);
      if (!a) {
        failed = e.index;
        break;
      }
      handles[e.index] = *a;
    } else {
      allocator.deallocate(handles[e.index]);
    }
  }
  const auto stop = std::chrono::steady_clock::now();
  if (failed != buffers.size()) {
    throw std::runtime_error("replay: buffer '" + buffers[failed].id + "' (" +
                             std::to_string(buffers[failed].bytes) +
                             " bytes) does not fit in the allocator's capacity");
  }
  replay_result r;
  r.offsets.reserve(buffers.size());
  for (const allocation& a : handles) r.offsets.push_back(a.offset);
  r.high_water = allocator.peak();
  r.operations = order.size();
  r.seconds = std::chrono::duration<double>(stop - start).count();
  return r;
}

}  // namespace tensormem::core
