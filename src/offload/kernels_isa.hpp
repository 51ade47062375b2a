#pragma once
// The per-instruction-set loops, each in its own translation unit.

#include <cstddef>

#include "tensormem/offload/optimizer_kernels.hpp"

namespace tensormem::offload::detail {

void adam_avx2(float* param, const float* grad, float* master, float* m, float* v, std::size_t n,
               const adam_scalars& s) noexcept;
void sgd_avx2(float* param, const float* grad, float* master, float* buf, std::size_t n,
              const sgd_scalars& s) noexcept;
void adam_avx512(float* param, const float* grad, float* master, float* m, float* v, std::size_t n,
                 const adam_scalars& s) noexcept;
void sgd_avx512(float* param, const float* grad, float* master, float* buf, std::size_t n,
                const sgd_scalars& s) noexcept;

}  // namespace tensormem::offload::detail
