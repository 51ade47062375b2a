#include "move_down.hpp"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define TENSORMEM_STREAM_COPY 1
#endif

namespace tensormem::arena::detail {

void move_down(std::byte* dst, const std::byte* src, std::size_t bytes) noexcept {
#ifdef TENSORMEM_STREAM_COPY
  constexpr std::size_t streaming_threshold = std::size_t{256} << 10;
  if (bytes >= streaming_threshold) {
    // Align the destination to 16 bytes with an ordinary copy of the head.
    const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16;
    std::memmove(dst, src, head);
    dst += head;
    src += head;
    bytes -= head;
    // Forward copy: every write lands below every later read (dst < src), so overlapping
    // ranges are safe. Each 64-byte step loads before it stores.
    const std::size_t body = bytes / 64 * 64;
    for (std::size_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    _mm_sfence();
    std::memmove(dst + body, src + body, bytes - body);
    return;
  }
#endif
  std::memmove(dst, src, bytes);
}

}  // namespace tensormem::arena::detail
