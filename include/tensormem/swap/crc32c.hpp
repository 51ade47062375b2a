#pragma once
// CRC-32C (Castagnoli), the checksum of swapped tensors.

#include <cstddef>
#include <cstdint>

namespace tensormem::swap {

/// CRC-32C of `bytes` bytes, continuing from `crc` (0 to start). Uses the SSE4.2 instruction
/// when the processor has it, a table otherwise.
std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0) noexcept;

}  // namespace tensormem::swap
