#include "tensormem/core/graph.hpp"

#include <limits>
#include <stdexcept>
#include <string>

#include "tensormem/core/align.hpp"
#include "tensormem/core/allocation.hpp"

namespace tensormem::core {

graph::graph(std::size_t tensor_limit) : tensor_limit_(tensor_limit) {
  if (tensor_limit > max_tensors) {
    throw std::invalid_argument("graph: a limit of " + std::to_string(tensor_limit) +
                                " tensors is more than 32-bit indices allow (" + std::to_string(max_tensors) + ")");
  }
}

std::uint32_t graph::add_tensor(std::string name, std::uint64_t bytes, tensor_role role) {
  if (tensors_.size() >= tensor_limit_) {
    throw std::length_error("graph: tensor '" + name + "' would be one more than the " +
                            std::to_string(tensor_limit_) + " this graph holds");
  }
  tensors_.push_back({std::move(name), bytes, role});
  return static_cast<std::uint32_t>(tensors_.size() - 1);
}

void graph::reserve(std::size_t tensors, std::size_t ops) {
  if (tensors > tensor_limit_) {
    throw std::length_error("graph: room for " + std::to_string(tensors) + " tensors asked, more than the " +
                            std::to_string(tensor_limit_) + " this graph holds");
  }
  tensors_.reserve(tensors);
  ops_.reserve(ops);
}

void graph::add_op(std::string name, std::vector<std::uint32_t> inputs,
                   std::vector<std::uint32_t> outputs) {
  for (const auto* list : {&inputs, &outputs}) {
    for (const std::uint32_t t : *list) {
      if (t >= tensors_.size()) {
        throw std::invalid_argument("graph: op '" + name + "' names unknown tensor " +
                                    std::to_string(t));
      }
    }
  }
  ops_.push_back({std::move(name), std::move(inputs), std::move(outputs)});
}

graph_lifetimes derive_lifetimes(const graph& g, std::uint64_t weight_alignment) {
  check_alignment_argument("derive_lifetimes", weight_alignment);
  constexpr std::uint64_t unset = std::numeric_limits<std::uint64_t>::max();
  const auto& tensors = g.tensors();
  const auto& ops = g.ops();
  const std::uint64_t steps = ops.size();
  std::vector<std::uint64_t> produced(tensors.size(), unset);
  std::vector<std::uint64_t> last_use(tensors.size(), unset);

  for (std::uint64_t step = 0; step < steps; ++step) {
    const graph_op& op = ops[step];
    for (const std::uint32_t t : op.inputs) {
      const graph_tensor& x = tensors[t];
      if (x.role == tensor_role::activation && produced[t] == unset) {
        throw std::invalid_argument("graph: op '" + op.name + "' consumes '" + x.name +
                                    "' before any op produces it");
      }
      last_use[t] = step;
    }
    for (const std::uint32_t t : op.outputs) {
      const graph_tensor& x = tensors[t];
      if (x.role == tensor_role::graph_input) {
        throw std::invalid_argument("graph: op '" + op.name + "' writes graph input '" +
                                    x.name + "'");
      }
      if (x.role == tensor_role::weight) continue;  // gradients accumulate in place
      if (produced[t] != unset) {
        throw std::invalid_argument("graph: op '" + op.name + "' produces '" + x.name +
                                    "' a second time");
      }
      produced[t] = step;
    }
  }

  graph_lifetimes out;
  out.steps = steps;
  for (std::uint32_t t = 0; t < tensors.size(); ++t) {
    const graph_tensor& x = tensors[t];
    if (x.role == tensor_role::weight) {
      out.weights.push_back(t);
      out.weight_offsets.push_back(out.weight_bytes);
      const auto padded = align_up(x.bytes, weight_alignment);
      if (!padded || *padded > std::numeric_limits<std::uint64_t>::max() - out.weight_bytes) {
        throw std::overflow_error("derive_lifetimes: weight '" + x.name + "' of " + std::to_string(x.bytes) +
                                  " bytes takes the weight region past 2^64 - 1 bytes");
      }
      out.weight_bytes += *padded;
      continue;
    }
    buffer b;
    b.id = x.name + "#" + std::to_string(t);
    b.bytes = x.bytes;
    if (x.role == tensor_role::activation) {
      if (produced[t] == unset) {
        if (last_use[t] == unset) continue;  // declared but unused: no memory
        throw std::invalid_argument("graph: activation '" + x.name + "' is never produced");
      }
      b.lower = produced[t];
      b.upper = (last_use[t] == unset || last_use[t] < produced[t]) ? produced[t] + 1
                                                                    : last_use[t] + 1;
    } else {
      if (x.role == tensor_role::graph_output && produced[t] == unset && last_use[t] == unset) {
        throw std::invalid_argument("graph: output '" + x.name + "' is never produced");
      }
      b.lower = 0;
      b.upper = steps == 0 ? 1 : steps;
    }
    out.buffers.push_back(std::move(b));
    out.tensor_of.push_back(t);
  }
  return out;
}

}  // namespace tensormem::core
