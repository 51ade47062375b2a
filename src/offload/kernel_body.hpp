#pragma once
// The update loops, written once over a small vector interface and compiled in one
// translation unit per instruction set (each with -ffp-contract=off, so the only fused
// multiply-adds are the explicit ones). Internal linkage: a loop compiled for AVX-512 must not
// be picked by the linker for another level.

#include <cmath>
#include <cstddef>

#include "tensormem/offload/optimizer_kernels.hpp"

namespace tensormem::offload {
namespace {

struct scalar_vec {
  using type = float;
  static constexpr std::size_t width = 1;
  static type load(const float* p) { return *p; }
  static void store(float* p, type v) { *p = v; }
  static type set1(float s) { return s; }
  static type mul(type a, type b) { return a * b; }
  static type add(type a, type b) { return a + b; }
  static type sub(type a, type b) { return a - b; }
  static type div(type a, type b) { return a / b; }
  static type fmadd(type a, type b, type c) { return std::fma(a, b, c); }
  static type sqrt(type a) { return std::sqrt(a); }
};

// PyTorch 1.13's CPU kernels, per operation of torch.optim's single-tensor loops:
//   mul_(s)            a * s
//   add_(t, alpha=s)   fma(t, s, a)
//   addcmul_(t, t, s)  fma(s * t, t, a)
//   sqrt() / s         sqrt(a) / s,  add_(eps): a + eps
//   addcdiv_(t, u, s)  a + (s * t) / u
// and PyTorch 2.x's first moment (adam_arithmetic::torch2), its CPU lerp:
//   lerp_(t, w)        fma(w, t - a, a) when |w| < 0.5, else fma(w - 1, t - a, t)
template <class V>
inline void adam_elements(float* param, const float* grad, float* master, float* m, float* v, std::size_t i,
                          const adam_scalars& s) {
  using T = typename V::type;
  T x = V::load(master != nullptr ? master + i : param + i);
  T g = V::load(grad + i);
  if (s.decoupled) {
    x = V::mul(x, V::set1(s.decay));
  } else {
    g = V::fmadd(x, V::set1(s.l2), g);
  }
  const T m0 = V::load(m + i);
  T mi = s.arithmetic == adam_arithmetic::torch2
             ? V::fmadd(V::set1(s.lerp_coefficient), V::sub(g, m0), s.lerp_from_end ? g : m0)
             : V::fmadd(g, V::set1(s.one_minus_beta1), V::mul(m0, V::set1(s.beta1)));
  T vi = V::fmadd(V::mul(V::set1(s.one_minus_beta2), g), g, V::mul(V::load(v + i), V::set1(s.beta2)));
  const T denom = V::add(V::div(V::sqrt(vi), V::set1(s.bias_correction2_sqrt)), V::set1(s.eps));
  x = V::add(x, V::div(V::mul(V::set1(s.neg_step_size), mi), denom));
  V::store(m + i, mi);
  V::store(v + i, vi);
  if (master != nullptr) V::store(master + i, x);
  V::store(param + i, x);
}

template <class V>
inline void sgd_elements(float* param, const float* grad, float* master, float* buf, std::size_t i,
                         const sgd_scalars& s) {
  using T = typename V::type;
  T x = V::load(master != nullptr ? master + i : param + i);
  T d = V::load(grad + i);
  if (s.weight_decay != 0) d = V::fmadd(x, V::set1(s.weight_decay), d);
  if (s.momentum != 0) {
    T b = s.first_step ? d : V::fmadd(d, V::set1(s.one_minus_dampening), V::mul(V::load(buf + i), V::set1(s.momentum)));
    V::store(buf + i, b);
    d = s.nesterov ? V::fmadd(b, V::set1(s.momentum), d) : b;
  }
  x = V::fmadd(d, V::set1(s.neg_lr), x);
  if (master != nullptr) V::store(master + i, x);
  V::store(param + i, x);
}

template <class V>
void adam_loop(float* param, const float* grad, float* master, float* m, float* v, std::size_t n,
               const adam_scalars& s) {
  std::size_t i = 0;
  for (; i + V::width <= n; i += V::width) adam_elements<V>(param, grad, master, m, v, i, s);
  for (; i < n; ++i) adam_elements<scalar_vec>(param, grad, master, m, v, i, s);
}

template <class V>
void sgd_loop(float* param, const float* grad, float* master, float* buf, std::size_t n, const sgd_scalars& s) {
  std::size_t i = 0;
  for (; i + V::width <= n; i += V::width) sgd_elements<V>(param, grad, master, buf, i, s);
  for (; i < n; ++i) sgd_elements<scalar_vec>(param, grad, master, buf, i, s);
}

}  // namespace
}  // namespace tensormem::offload
