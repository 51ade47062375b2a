// Fuzz target: the planner on small structured instances, where plans above the lower bound
// are common and a brute-force optimum is cheap (plan_oracle.hpp). The search must prove its
// arena optimal and that arena must be the optimum; the greedy phase's plan must be valid
// and no smaller.
//
// Input: byte 0 picks the alignment (1, 2, 4 or 8, bits 0-1) and the threads (1 or 2,
// bit 2); then 3 bytes per buffer, up to 7 buffers: start (0-15), length (1-8) and size:
// 0-127 bytes where the byte's top bit is clear; 0-7 where its top bits are 10 (with tiny
// sizes, plans one byte above the optimum are common; 0 is a buffer that occupies nothing);
// 2^61 - 4 to 2^61 + 3 where they are 11 (arenas up to about 7 x 2^61: capacities and ends
// near 2^64, yet seven such buffers add up to less, as plan() requires).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "plan_oracle.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint64_t alignment = std::uint64_t{1} << (data[0] & 3U);
  const unsigned threads = 1 + ((data[0] >> 2U) & 1U);
  const std::size_t n = std::min(tensormem::fuzz::brute_force_buffers, (size - 1) / 3);
  std::vector<tensormem::core::buffer> buffers(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t* field = data + 1 + 3 * i;
    buffers[i].id = std::to_string(i);
    buffers[i].lower = field[0] % 16U;
    buffers[i].upper = buffers[i].lower + 1 + field[1] % 8U;
    const std::uint8_t b = field[2];
    buffers[i].bytes = (b & 0x80U) == 0 ? b : (b & 0x40U) == 0 ? b & 7U : (std::uint64_t{1} << 61U) - 4 + (b & 7U);
  }
  tensormem::fuzz::check_plans(buffers, alignment, threads);
  return 0;
}
