#pragma once
// The built-in model of `tensormem demo`: one training step of a GPT-style transformer.

#include <cstddef>
#include <cstdint>

#include "tensormem/core/graph.hpp"

namespace tensormem::core {

/// Shape of the model. Defaults: GPT-2 small (12 layers, hidden 768, 12 heads, vocabulary
/// 50257) at batch 8, sequence 1024, 2-byte (fp16/bf16) activations and weights.
struct transformer_config {
  std::uint32_t layers = 12;
  std::uint64_t hidden = 768;
  std::uint64_t heads = 12;
  std::uint64_t sequence = 1024;
  std::uint64_t batch = 8;
  std::uint64_t vocabulary = 50257;
  std::uint64_t dtype_bytes = 2;
};

/// Builds forward, loss and backward of one step, op by op: embedding; per layer layer norm,
/// QKV projection, attention scores, softmax, attention-weighted values, output projection,
/// residual add, layer norm, MLP up-projection, GeLU, down-projection, residual add; final
/// layer norm, logits and cross-entropy; then the backward ops in reverse, each consuming the
/// forward activations it needs, so those stay alive until the backward pass reaches them.
/// Weights and weight gradients are `tensor_role::weight`; tokens and labels are graph inputs,
/// the loss is the graph output. Throws std::invalid_argument for a zero dimension or heads
/// not dividing hidden; std::length_error, at once, for more layers than a graph's 32-bit
/// tensor indices allow; std::bad_alloc, before any op is built, when the graph's arrays of
/// tensors and ops cannot be had; std::overflow_error (naming the tensor and its shape) when
/// a tensor would need more than 2^64 - 1 bytes.
graph make_transformer_step(const transformer_config& config);
/// Its size: fixed + per_layer x layers tensors (std::length_error above graph::max_tensors,
/// before anything is built) and ops.
inline constexpr std::uint64_t transformer_tensors_fixed = 15;
inline constexpr std::uint64_t transformer_tensors_per_layer = 35;
inline constexpr std::size_t transformer_ops_fixed = 7;
inline constexpr std::size_t transformer_ops_per_layer = 22;

}  // namespace tensormem::core
