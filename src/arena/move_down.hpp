#pragma once
// Host copy for defragmentation moves, which always go to a lower address.

#include <cstddef>

namespace tensormem::arena::detail {

/// Copies `bytes` from `src` to `dst`, with dst < src; the ranges may overlap. Large moves
/// use non-temporal stores on x86-64 (a compaction streams far more bytes than the caches
/// hold, and ordinary stores would read every destination line first); others use memmove.
void move_down(std::byte* dst, const std::byte* src, std::size_t bytes) noexcept;

}  // namespace tensormem::arena::detail
