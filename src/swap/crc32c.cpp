#include "tensormem/swap/crc32c.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace tensormem::swap {

namespace {

constexpr std::uint32_t polynomial = 0x82F63B78U;  // reflected Castagnoli

constexpr std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1U) != 0 ? (c >> 1) ^ polynomial : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<std::uint32_t, 256> table = make_table();

std::uint32_t crc_table(const unsigned char* p, std::size_t n, std::uint32_t crc) noexcept {
  while (n-- != 0) crc = table[(crc ^ *p++) & 0xffU] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t crc_hw(const unsigned char* p, std::size_t n,
                                                      std::uint32_t crc) noexcept {
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n-- != 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
const bool have_sse42 = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (have_sse42) return ~crc_hw(p, bytes, crc);
#endif
  return ~crc_table(p, bytes, crc);
}

}  // namespace tensormem::swap
