// Fuzz target: both online allocators driven by one stream of operations, sizes anywhere in
// 64 bits, misuse included. After every operation: the allocator's own invariants hold,
// `used()` is the sum of the live handles, live blocks are aligned, disjoint and below the
// high-water mark (itself within the capacity), a refused free or a failed allocation
// changes nothing, and best fit never fails while a free block or the untouched end of the
// arena could hold the request.
//
// Input: byte 0 chooses the alignment (a power of two up to 2^63), bytes 1-8 the capacity
// (growing when zero), then 9 bytes per operation: a code and a 64-bit operand.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "tensormem/core/align.hpp"
#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/tlsf_allocator.hpp"

namespace {

using tensormem::core::allocation;
using tensormem::core::allocator_stats;
using tensormem::core::free_status;

constexpr std::uint64_t max64 = std::numeric_limits<std::uint64_t>::max();

// Stops the run, naming the line of the check that failed (clang 14 has no
// std::source_location).
void fail_at(int line) {
  std::fprintf(stderr, "fuzz_allocators.cpp:%d: check failed\n", line);
  std::abort();
}
#define REQUIRE(condition) ((condition) ? void() : fail_at(__LINE__))

bool same(const allocator_stats& a, const allocator_stats& b) {
  return a.used_bytes == b.used_bytes && a.peak_bytes == b.peak_bytes && a.free_bytes == b.free_bytes &&
         a.free_blocks == b.free_blocks && a.largest_free_bytes == b.largest_free_bytes &&
         a.live_allocations == b.live_allocations;
}

// A request size from an operand: the code's upper bits pick how the operand is read, so
// that small sizes, sizes near 2^64 and sizes near powers of two are all easy to reach.
std::uint64_t request_size(std::uint8_t code, std::uint64_t operand) {
  switch ((code >> 4U) & 3U) {
    case 0: return operand % 4096;
    case 1: return max64 - operand % 4096;
    case 2: {
      const std::uint64_t power = std::uint64_t{1} << (operand % 64);
      const auto delta = static_cast<std::int64_t>((operand >> 8U) % 9) - 4;
      return power + static_cast<std::uint64_t>(delta);
    }
    default: return operand;
  }
}

template <class Allocator>
class driver {
 public:
  driver(std::uint64_t capacity, std::uint64_t alignment)
      : a_(capacity, alignment), capacity_(capacity), alignment_(alignment) {}

  void step(std::uint8_t code, std::uint64_t operand) {
    const allocator_stats before = a_.stats();
    switch (code % 6U) {
      case 0: allocate(request_size(code, operand), before); break;
      case 1:  // free a live handle
        if (!live_.empty()) {
          const std::size_t i = operand % live_.size();
          REQUIRE(a_.try_deallocate(live_[i]) == free_status::ok);
          retire(i);
        }
        break;
      case 2:  // free a handle that was freed before
        if (!freed_.empty()) refused(a_.try_deallocate(freed_[operand % freed_.size()]), before);
        break;
      case 3: free_by_offset(code, operand, before); break;
      case 4: {  // another allocator's handle, or a reserve
        if ((code & 0x80U) != 0) {
          reserve(operand, before);
          break;
        }
        if (!other_) other_.emplace(capacity_, alignment_);
        const auto foreign = other_->allocate(operand % 4096 + 1);
        if (foreign) {
          REQUIRE(a_.try_deallocate(*foreign) == free_status::foreign_handle);
          REQUIRE(same(a_.stats(), before));
        }
        break;
      }
      default: forge(code, operand, before); break;
    }
    // The allocator's own invariants cost O(blocks + lists), 2^16 lists for the O(1)
    // allocator: after each of the first operations, then after every 64th, and at the end.
    check(++steps_ <= 8 || steps_ % 64 == 0);
  }

  void finish() const { check(true); }

 private:
  void allocate(std::uint64_t bytes, const allocator_stats& before) {
    const std::optional<allocation> r = a_.allocate(bytes);
    const std::optional<std::uint64_t> need = tensormem::core::align_up(bytes, alignment_);
    if (!r) {
      REQUIRE(same(a_.stats(), before));
      if constexpr (std::is_same_v<Allocator, tensormem::core::best_fit_allocator>) {
        if (need) REQUIRE(!fits_somewhere(*need));
      }
      return;
    }
    REQUIRE(need.has_value() && r->bytes == *need);
    if (r->bytes == 0) return;  // the zero-byte allocation: nothing to keep
    REQUIRE(r->offset % alignment_ == 0);
    live_.push_back(*r);
  }

  // A reserve of up to 4,095 blocks, or of 2^63 or more: refused past the node limit,
  // unless a fixed capacity cuts the count to the blocks its arena can hold (one per
  // alignment unit), made where that is a small number. Either way the allocator is as before.
  void reserve(std::uint64_t operand, const allocator_stats& before) {
    if ((operand >> 63U) != 0) {
      const auto wanted = static_cast<std::size_t>(operand);
      const std::size_t capped = a_.blocks_to_reserve(wanted);
      const std::uint64_t most = capacity_ / alignment_ + (capacity_ % alignment_ != 0 ? 1U : 0U);
      REQUIRE(capped == (capacity_ == tensormem::core::growing ? wanted : std::min<std::uint64_t>(wanted, most)));
      if (capped > Allocator::max_reserved_blocks) {
        bool refused = false;
        try {
          a_.reserve(wanted);
        } catch (const std::length_error&) {
          refused = true;
        }
        REQUIRE(refused);
      } else if (capped <= 4096) {
        a_.reserve(wanted);
      }
    } else {
      a_.reserve(static_cast<std::size_t>(operand % 4096));
    }
    REQUIRE(same(a_.stats(), before));
  }

  // Whether a free block, or the untouched end of a fixed arena joined to a free block
  // that ends at the high-water mark, holds `need` bytes.
  bool fits_somewhere(std::uint64_t need) const {
    bool fits = false;
    std::uint64_t tail_free = 0;
    a_.for_each_block([&](std::uint64_t, std::uint64_t bytes, bool is_free) {
      if (is_free && bytes >= need) fits = true;
      tail_free = is_free ? bytes : 0;
    });
    const std::uint64_t untouched = capacity_ - a_.peak();  // growing: up to 2^64 - 1
    return fits || (untouched >= need) || (tail_free > 0 && untouched >= need - std::min(need, tail_free));
  }

  void free_by_offset(std::uint8_t code, std::uint64_t operand, const allocator_stats& before) {
    if (live_.empty() || (code & 0x40U) != 0) {  // an offset that may hold no allocation
      const std::uint64_t offset = operand;
      const std::uint64_t bytes = operand >> 7U;
      const auto hit = std::find_if(live_.begin(), live_.end(), [&](const allocation& x) { return x.offset == offset; });
      const free_status s = a_.try_free(offset, bytes);
      if (offset == 0 && bytes == 0) {
        REQUIRE(s == free_status::ok);  // the zero-byte allocation's free
        REQUIRE(same(a_.stats(), before));
      } else if (hit == live_.end()) {
        refused(s, before);
        REQUIRE(s == free_status::not_allocated);
      } else if (s == free_status::ok) {
        retire(static_cast<std::size_t>(hit - live_.begin()));
      } else {
        refused(s, before);
      }
      return;
    }
    const std::size_t i = operand % live_.size();
    const allocation x = live_[i];
    // The size as asked, or one unit off either way.
    const auto shift = static_cast<std::int64_t>((operand >> 32U) % 3) - 1;
    const std::uint64_t bytes = x.bytes + static_cast<std::uint64_t>(shift) * alignment_;
    const free_status s = a_.try_free(x.offset, bytes);
    const std::optional<std::uint64_t> rounded = tensormem::core::align_up(bytes, alignment_);
    if (x.offset == 0 && bytes == 0) {  // reads as the zero-byte allocation's free
      REQUIRE(s == free_status::ok);
      REQUIRE(same(a_.stats(), before));
    } else if (rounded && *rounded == x.bytes) {
      REQUIRE(s == free_status::ok);
      retire(i);
    } else {
      REQUIRE(s == free_status::size_mismatch);
      REQUIRE(same(a_.stats(), before));
    }
  }

  // A live handle with one field changed is refused.
  void forge(std::uint8_t code, std::uint64_t operand, const allocator_stats& before) {
    if (live_.empty()) return;
    allocation x = live_[operand % live_.size()];
    switch ((code >> 4U) % 4U) {
      case 0: x.offset += alignment_; break;
      case 1: x.bytes += alignment_; break;
      case 2: x.generation += 1; break;
      default: x.node = static_cast<std::uint32_t>(operand >> 32U); break;
    }
    const free_status s = a_.try_deallocate(x);
    const bool still_names_a_live_block = std::find(live_.begin(), live_.end(), x) != live_.end();
    if (still_names_a_live_block) {  // the forged node index named this very handle's node
      REQUIRE(s == free_status::ok);
      live_.erase(std::find(live_.begin(), live_.end(), x));
      freed_.push_back(x);
      return;
    }
    refused(s, before);
  }

  void refused(free_status s, const allocator_stats& before) const {
    REQUIRE(s != free_status::ok);
    REQUIRE(same(a_.stats(), before));
  }

  void retire(std::size_t i) {
    freed_.push_back(live_[i]);
    live_[i] = live_.back();
    live_.pop_back();
  }

  void check(bool full) const {
    if (full) REQUIRE(a_.check_invariants().empty());
    std::vector<allocation> sorted = live_;
    std::sort(sorted.begin(), sorted.end(), [](const allocation& x, const allocation& y) { return x.offset < y.offset; });
    std::uint64_t sum = 0;
    std::uint64_t end = 0;
    for (const allocation& x : sorted) {
      REQUIRE(x.offset >= end);  // disjoint
      REQUIRE(x.bytes <= a_.peak() && x.offset <= a_.peak() - x.bytes);
      end = x.offset + x.bytes;
      sum += x.bytes;
    }
    REQUIRE(a_.used() == sum);
    REQUIRE(a_.peak() <= capacity_);
    REQUIRE(a_.stats().live_allocations == live_.size());
  }

  Allocator a_;
  std::optional<Allocator> other_;  // made when a foreign handle is first needed
  std::uint64_t capacity_;
  std::uint64_t alignment_;
  std::vector<allocation> live_;
  std::vector<allocation> freed_;
  std::size_t steps_ = 0;
};

template <class Allocator>
void run(const std::uint8_t* data, std::size_t size, std::uint64_t capacity, std::uint64_t alignment) {
  driver<Allocator> d(capacity, alignment);
  for (std::size_t at = 9; at + 9 <= size; at += 9) {
    std::uint64_t operand = 0;
    std::memcpy(&operand, data + at + 1, sizeof operand);
    d.step(data[at], operand);
  }
  d.finish();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 9) return 0;
  const std::uint64_t alignment = std::uint64_t{1} << (data[0] % 64);
  std::uint64_t capacity = 0;
  std::memcpy(&capacity, data + 1, sizeof capacity);
  if (capacity == 0) capacity = tensormem::core::growing;
  run<tensormem::core::best_fit_allocator>(data, size, capacity, alignment);
  run<tensormem::core::tlsf_allocator>(data, size, capacity, alignment);
  return 0;
}
