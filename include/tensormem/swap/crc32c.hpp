#pragma once
// CRC-32C (Castagnoli), the checksum of swapped tensors.

#include <cstddef>
#include <cstdint>

namespace tensormem::swap {

/// CRC-32C of `bytes` bytes, continuing from `crc` (0 to start). Uses the SSE4.2 instruction
/// when the processor has it, a table otherwise.
std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0) noexcept;

/// CRC-32C of A followed by B from crc32c(A), crc32c(B) and the length of B: lets blocks be
/// checksummed as they arrive, in any order, and combined in file order. O(log bytes_b).
std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t bytes_b) noexcept;

namespace detail {
/// The table implementation `crc32c` uses on a processor without SSE4.2 (and off x86-64),
/// callable on any processor so that it is tested against the instruction's results.
std::uint32_t crc32c_portable(const void* data, std::size_t bytes, std::uint32_t crc = 0) noexcept;
}  // namespace detail

}  // namespace tensormem::swap
