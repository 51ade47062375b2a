#pragma once
// A small operator graph and the reference-count walk that turns it into buffer lifetimes.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tensormem/core/lifetime.hpp"

namespace tensormem::core {

enum class tensor_role : std::uint8_t {
  activation,    ///< produced by one op, freed after its last consumer ran
  weight,        ///< parameters and their gradients: a separate bump region, never freed
  graph_input,   ///< alive for the whole run
  graph_output,  ///< alive for the whole run
};

struct graph_tensor {
  std::string name;
  std::uint64_t bytes = 0;
  tensor_role role = tensor_role::activation;
};

struct graph_op {
  std::string name;
  std::vector<std::uint32_t> inputs;   ///< tensor indices
  std::vector<std::uint32_t> outputs;  ///< tensor indices
};

/// Operators in execution order (a topological order) over tensors of known sizes.
class graph {
 public:
  /// The most tensors a graph holds: indices are 32-bit (0 to 2^32 - 2).
  static constexpr std::size_t max_tensors = 0xffffffffU;

  graph() = default;
  /// A graph that holds at most `tensor_limit` tensors (a bound on the memory of a graph
  /// built from input the caller does not control); std::invalid_argument above max_tensors.
  explicit graph(std::size_t tensor_limit);

  /// Adds a tensor and returns its index. Names are for reports; they need not be unique.
  /// Throws std::length_error, changing nothing, when the graph holds its limit already.
  std::uint32_t add_tensor(std::string name, std::uint64_t bytes,
                           tensor_role role = tensor_role::activation);
  /// Room for that many tensors and ops in all, made now (a graph of known size then fails
  /// for want of memory here, at once, rather than part-way). std::length_error for more
  /// tensors than the limit.
  void reserve(std::size_t tensors, std::size_t ops);
  std::size_t tensor_limit() const noexcept { return tensor_limit_; }
  /// Appends an op that runs after every op added before it. Throws std::invalid_argument
  /// for an unknown tensor index.
  void add_op(std::string name, std::vector<std::uint32_t> inputs,
              std::vector<std::uint32_t> outputs);

  const std::vector<graph_tensor>& tensors() const noexcept { return tensors_; }
  const std::vector<graph_op>& ops() const noexcept { return ops_; }

 private:
  std::vector<graph_tensor> tensors_;
  std::vector<graph_op> ops_;
  std::size_t tensor_limit_ = max_tensors;
};

/// The memory of a graph run: lifetimes of activations, inputs and outputs, and the bump
/// region of weights.
struct graph_lifetimes {
  std::vector<buffer> buffers;               ///< one per non-weight tensor; id = tensor name#index
  std::vector<std::uint32_t> tensor_of;      ///< tensor index of each buffer
  std::vector<std::uint64_t> weight_offsets; ///< offset of each weight in its region
  std::vector<std::uint32_t> weights;        ///< tensor index of each weight
  std::uint64_t weight_bytes = 0;            ///< size of the weight region
  std::uint64_t steps = 0;                   ///< number of ops
};

/// The walk of InfiniTensor's `dataMalloc`. Step i runs op i: its outputs are allocated at
/// step i, before the use counts of its inputs drop; an activation is freed after its last
/// consumer (lifetime [producer, last consumer + 1)); one nobody consumes lives [i, i + 1).
/// Graph inputs and outputs live [0, steps). Weights are placed one after another in their
/// own region, each rounded up to `weight_alignment`. Throws std::invalid_argument when an
/// activation is consumed before it is produced, produced twice or never produced, when a
/// graph input is produced by an op, or when `weight_alignment` is not a power of two;
/// std::overflow_error when the weight region would hold more than 2^64 - 1 bytes.
graph_lifetimes derive_lifetimes(const graph& g, std::uint64_t weight_alignment = 256);

}  // namespace tensormem::core
