#include "tensormem/offload/optimizer_kernels.hpp"

#include <cmath>

#include "kernel_body.hpp"
#include "kernels_isa.hpp"

namespace tensormem::offload {

bool simd_supported(simd_level level) noexcept {
  switch (level) {
    case simd_level::scalar:
      return true;
    case simd_level::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case simd_level::avx512:
      return __builtin_cpu_supports("avx512f");
  }
  return false;
}

simd_level best_simd_level() noexcept {
  if (simd_supported(simd_level::avx512)) return simd_level::avx512;
  if (simd_supported(simd_level::avx2)) return simd_level::avx2;
  return simd_level::scalar;
}

std::string_view to_string(simd_level level) noexcept {
  switch (level) {
    case simd_level::scalar:
      return "scalar";
    case simd_level::avx2:
      return "avx2";
    case simd_level::avx512:
      return "avx512";
  }
  return "?";
}

adam_scalars make_adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                               bool decoupled, std::uint64_t step, adam_arithmetic arithmetic) noexcept {
  adam_scalars s;
  s.arithmetic = arithmetic;
  const auto t = static_cast<double>(step);
  s.decoupled = decoupled;
  s.decay = static_cast<float>(1 - lr * weight_decay);
  s.l2 = static_cast<float>(weight_decay);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1 - beta1);
  s.lerp_from_end = !(std::fabs(s.one_minus_beta1) < 0.5F);
  s.lerp_coefficient = s.lerp_from_end ? s.one_minus_beta1 - 1 : s.one_minus_beta1;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1 - beta2);
  s.neg_step_size = static_cast<float>(-(lr / (1 - std::pow(beta1, t))));
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(beta2, t)));
  s.eps = static_cast<float>(eps);
  return s;
}

sgd_scalars make_sgd_scalars(double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                             std::uint64_t step) noexcept {
  sgd_scalars s;
  s.neg_lr = static_cast<float>(-lr);
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum);
  s.one_minus_dampening = static_cast<float>(1 - dampening);
  s.nesterov = nesterov;
  s.first_step = step <= 1;
  return s;
}

void adam_update(float* param, const float* grad, float* master, float* m, float* v, std::size_t n,
                 const adam_scalars& s, simd_level level) noexcept {
  switch (level) {
    case simd_level::avx512:
      return detail::adam_avx512(param, grad, master, m, v, n, s);
    case simd_level::avx2:
      return detail::adam_avx2(param, grad, master, m, v, n, s);
    case simd_level::scalar:
      break;
  }
  adam_loop<scalar_vec>(param, grad, master, m, v, n, s);
}

void sgd_update(float* param, const float* grad, float* master, float* buf, std::size_t n, const sgd_scalars& s,
                simd_level level) noexcept {
  switch (level) {
    case simd_level::avx512:
      return detail::sgd_avx512(param, grad, master, buf, n, s);
    case simd_level::avx2:
      return detail::sgd_avx2(param, grad, master, buf, n, s);
    case simd_level::scalar:
      break;
  }
  sgd_loop<scalar_vec>(param, grad, master, buf, n, s);
}

}  // namespace tensormem::offload
