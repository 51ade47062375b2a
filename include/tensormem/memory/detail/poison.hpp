#pragma once
// AddressSanitizer poisoning of memory that a sub-allocator holds but nobody may touch
// (free ranges of a pool slab or an arena). No-ops in builds without AddressSanitizer.

#include <cstddef>

#if defined(__SANITIZE_ADDRESS__)
#define TENSORMEM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TENSORMEM_ASAN 1
#endif
#endif

#ifdef TENSORMEM_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace tensormem::memory::detail {

/// Marks [p, p + bytes) as unaddressable: a later access is reported by AddressSanitizer.
inline void poison(const void* p, std::size_t bytes) noexcept {
#ifdef TENSORMEM_ASAN
  ASAN_POISON_MEMORY_REGION(p, bytes);
#else
  (void)p;
  (void)bytes;
#endif
}

/// Marks [p, p + bytes) as addressable again.
inline void unpoison(const void* p, std::size_t bytes) noexcept {
#ifdef TENSORMEM_ASAN
  ASAN_UNPOISON_MEMORY_REGION(p, bytes);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace tensormem::memory::detail
