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

// Polynomial arithmetic modulo the (reflected) Castagnoli polynomial: a * b mod P.
std::uint32_t multiply_mod(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t product = 0;
  for (std::uint32_t bit = 1U << 31; bit != 0; bit >>= 1) {
    if ((a & bit) != 0) product ^= b;
    b = (b & 1U) != 0 ? (b >> 1) ^ polynomial : b >> 1;
  }
  return product;
}

// x^(2^k) mod P for k = 0..63.
constexpr std::array<std::uint32_t, 64> make_powers() {
  std::array<std::uint32_t, 64> t{};
  std::uint32_t p = 1U << 30;  // x^1
  for (auto& v : t) {
    v = p;
    // p = p * p mod P (constexpr copy of multiply_mod)
    std::uint32_t a = p;
    std::uint32_t b = p;
    std::uint32_t product = 0;
    for (std::uint32_t bit = 1U << 31; bit != 0; bit >>= 1) {
      if ((a & bit) != 0) product ^= b;
      b = (b & 1U) != 0 ? (b >> 1) ^ polynomial : b >> 1;
    }
    p = product;
  }
  return t;
}
constexpr std::array<std::uint32_t, 64> powers = make_powers();

std::uint32_t shift_constant(std::uint64_t bytes) noexcept {  // x^(8 * bytes) mod P
  std::uint32_t shift = 1U << 31;
  for (unsigned k = 3; bytes != 0; bytes >>= 1, ++k) {
    if ((bytes & 1U) != 0) shift = multiply_mod(powers[k & 63U], shift);
  }
  return shift;
}

#if defined(__x86_64__)
// Three independent streams hide the 3-cycle latency of the crc32 instruction: each chunk of
// 3 lanes is checksummed lane by lane in one loop, then the lanes are joined by polynomial
// shifts (crc(A||B) = crc(A) * x^(8|B|) + crc(B), on the raw register).
constexpr std::size_t lane_bytes = 8192;
const std::uint32_t shift_one_lane = shift_constant(lane_bytes);
const std::uint32_t shift_two_lanes = shift_constant(2 * lane_bytes);

__attribute__((target("sse4.2"))) std::uint32_t crc_hw_lanes(const unsigned char* p, std::size_t n,
                                                            std::uint32_t crc) noexcept {
  while (n >= 3 * lane_bytes) {
    std::uint64_t a = crc;
    std::uint64_t b = 0;
    std::uint64_t c = 0;
    for (std::size_t i = 0; i < lane_bytes; i += 8) {
      std::uint64_t wa, wb, wc;
      std::memcpy(&wa, p + i, 8);
      std::memcpy(&wb, p + lane_bytes + i, 8);
      std::memcpy(&wc, p + 2 * lane_bytes + i, 8);
      a = _mm_crc32_u64(a, wa);
      b = _mm_crc32_u64(b, wb);
      c = _mm_crc32_u64(c, wc);
    }
    crc = multiply_mod(shift_two_lanes, static_cast<std::uint32_t>(a)) ^
          multiply_mod(shift_one_lane, static_cast<std::uint32_t>(b)) ^ static_cast<std::uint32_t>(c);
    p += 3 * lane_bytes;
    n -= 3 * lane_bytes;
  }
  return crc_hw(p, n, crc);
}
#endif

}  // namespace

std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t bytes_b) noexcept {
  // crc(A || B) = crc_a * x^(8 * |B|) + crc_b (mod P); the pre/post inversions cancel.
  return multiply_mod(shift_constant(bytes_b), crc_a) ^ crc_b;
}

std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (have_sse42) return ~crc_hw_lanes(p, bytes, crc);
#endif
  return ~crc_table(p, bytes, crc);
}

std::uint32_t detail::crc32c_portable(const void* data, std::size_t bytes, std::uint32_t crc) noexcept {
  return ~crc_table(static_cast<const unsigned char*>(data), bytes, ~crc);
}

}  // namespace tensormem::swap
