#include "tensormem/memory/memory_resource.hpp"

#include <bit>
#include <limits>
#include <stdexcept>
#include <string>

#include "tensormem/memory/errors.hpp"

namespace tensormem::memory {

std::string_view to_string(memory_kind kind) noexcept {
  switch (kind) {
    case memory_kind::host: return "host";
    case memory_kind::pinned_host: return "pinned_host";
    case memory_kind::cuda_pinned_host: return "cuda_pinned_host";
    case memory_kind::cuda_device: return "cuda_device";
  }
  return "unknown";
}

void* memory_resource::allocate(std::size_t bytes, std::size_t alignment) {
  return do_allocate(checked_request(bytes, alignment), alignment);
}

std::size_t memory_resource::checked_request(std::size_t bytes, std::size_t alignment) {
  if (!std::has_single_bit(alignment)) {
    throw std::invalid_argument("memory_resource: alignment " + std::to_string(alignment) +
                                " is not a power of two");
  }
  // No implementation is asked for a size that cannot be padded to its alignment: aligned
  // operator new would wrap it to a tiny block.
  if (bytes > std::numeric_limits<std::size_t>::max() - alignment) {
    throw out_of_memory("memory_resource: " + std::to_string(bytes) + " bytes aligned to " +
                        std::to_string(alignment) + " cannot be represented");
  }
  // A zero-byte request gets a distinct pointer: one byte is reserved behind it.
  return bytes == 0 ? 1 : bytes;
}

void memory_resource::deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept {
  if (p == nullptr) return;
  do_deallocate(p, bytes == 0 ? 1 : bytes, alignment);
}

}  // namespace tensormem::memory
