// The update loops for AVX2 + FMA (this file is compiled with -mavx2 -mfma).
#include <immintrin.h>

#include "kernel_body.hpp"
#include "kernels_isa.hpp"

namespace tensormem::offload::detail {
namespace {

struct avx2_vec {
  using type = __m256;
  static constexpr std::size_t width = 8;
  static type load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, type v) { _mm256_storeu_ps(p, v); }
  static type set1(float s) { return _mm256_set1_ps(s); }
  static type mul(type a, type b) { return _mm256_mul_ps(a, b); }
  static type add(type a, type b) { return _mm256_add_ps(a, b); }
  static type sub(type a, type b) { return _mm256_sub_ps(a, b); }
  static type div(type a, type b) { return _mm256_div_ps(a, b); }
  static type fmadd(type a, type b, type c) { return _mm256_fmadd_ps(a, b, c); }
  static type sqrt(type a) { return _mm256_sqrt_ps(a); }
};

}  // namespace

void adam_avx2(float* param, const float* grad, float* master, float* m, float* v, std::size_t n,
               const adam_scalars& s) noexcept {
  adam_loop<avx2_vec>(param, grad, master, m, v, n, s);
}

void sgd_avx2(float* param, const float* grad, float* master, float* buf, std::size_t n,
              const sgd_scalars& s) noexcept {
  sgd_loop<avx2_vec>(param, grad, master, buf, n, s);
}

}  // namespace tensormem::offload::detail
