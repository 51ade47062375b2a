#pragma once
// Element-wise optimizer updates on fp32 arrays (AdamW, Adam, SGD with momentum), vectorized
// with AVX-512 or AVX2 + FMA when the processor has them (chosen at run time), with a scalar
// fallback. Every level performs the same IEEE operations in the same order (explicit fused
// multiply-adds where PyTorch's CPU kernels fuse), so the levels agree bit for bit.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tensormem::offload {

enum class simd_level { scalar, avx2, avx512 };

/// The widest level this processor supports (AVX-512F, else AVX2 with FMA, else scalar).
simd_level best_simd_level() noexcept;
/// True when the processor can run `level`.
bool simd_supported(simd_level level) noexcept;
std::string_view to_string(simd_level level) noexcept;

/// Which PyTorch's arithmetic the first moment follows. PyTorch 1.x:
/// `exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)`; PyTorch 2.x:
/// `exp_avg.lerp_(grad, 1 - beta1)`. Both mean the same average and round differently.
enum class adam_arithmetic { torch1, torch2 };

/// The scalars of one Adam/AdamW update, rounded to fp32 as PyTorch rounds Python numbers
/// when it multiplies fp32 tensors by them (computed in double first, as Python does).
struct adam_scalars {
  float decay = 1;                 ///< AdamW: 1 - lr * weight_decay
  float l2 = 0;                    ///< Adam: weight_decay added to the gradient times the parameter
  float beta1 = 0.9F, one_minus_beta1 = 0.1F;
  float beta2 = 0.999F, one_minus_beta2 = 0.001F;
  float neg_step_size = 0;         ///< -lr / (1 - beta1^step)
  float bias_correction2_sqrt = 1; ///< sqrt(1 - beta2^step)
  float eps = 1e-8F;
  bool decoupled = true;           ///< AdamW (true) or Adam with L2 weight decay (false)
  adam_arithmetic arithmetic = adam_arithmetic::torch1;
  /// torch2: lerp's coefficient and base, as PyTorch picks them from the weight 1 - beta1
  /// (below 0.5: the weight, from exp_avg; else the weight - 1, from grad).
  float lerp_coefficient = 0.1F;
  bool lerp_from_end = false;
};
/// `step` is the parameter's step count after this update (1 for the first).
adam_scalars make_adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                               bool decoupled, std::uint64_t step,
                               adam_arithmetic arithmetic = adam_arithmetic::torch1) noexcept;

struct sgd_scalars {
  float neg_lr = 0;
  float weight_decay = 0;
  float momentum = 0;
  float one_minus_dampening = 1;
  bool nesterov = false;
  bool first_step = true;  ///< the momentum buffer starts as a copy of the gradient
};
sgd_scalars make_sgd_scalars(double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                             std::uint64_t step) noexcept;

/// One Adam/AdamW step on `n` elements. With `master` (an fp32 master copy of the
/// parameters) the update runs on the master copy and `param` receives the result;
/// otherwise it runs on `param`. `m`, `v`: the first and second moments, updated in place.
void adam_update(float* param, const float* grad, float* master, float* m, float* v, std::size_t n,
                 const adam_scalars& s, simd_level level) noexcept;
/// One SGD step; `buf` is the momentum buffer (unused, may be null, when momentum is 0).
void sgd_update(float* param, const float* grad, float* master, float* buf, std::size_t n, const sgd_scalars& s,
                simd_level level) noexcept;

}  // namespace tensormem::offload
