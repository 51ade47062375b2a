// The update loops for AVX-512F (this file is compiled with -mavx512f).
#include <immintrin.h>

#include "kernel_body.hpp"
#include "kernels_isa.hpp"

namespace tensormem::offload::detail {
namespace {

struct avx512_vec {
  using type = __m512;
  static constexpr std::size_t width = 16;
  static type load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, type v) { _mm512_storeu_ps(p, v); }
  static type set1(float s) { return _mm512_set1_ps(s); }
  static type mul(type a, type b) { return _mm512_mul_ps(a, b); }
  static type add(type a, type b) { return _mm512_add_ps(a, b); }
  static type sub(type a, type b) { return _mm512_sub_ps(a, b); }
  static type div(type a, type b) { return _mm512_div_ps(a, b); }
  static type fmadd(type a, type b, type c) { return _mm512_fmadd_ps(a, b, c); }
  static type sqrt(type a) { return _mm512_sqrt_ps(a); }
};

}  // namespace

void adam_avx512(float* param, const float* grad, float* master, float* m, float* v, std::size_t n,
               const adam_scalars& s) noexcept {
  adam_loop<avx512_vec>(param, grad, master, m, v, n, s);
}

void sgd_avx512(float* param, const float* grad, float* master, float* buf, std::size_t n,
              const sgd_scalars& s) noexcept {
  sgd_loop<avx512_vec>(param, grad, master, buf, n, s);
}

}  // namespace tensormem::offload::detail
