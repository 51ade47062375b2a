#include "tensormem/core/transformer_step.hpp"

#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace tensormem::core {
namespace {

// The product of a tensor's dimensions (bytes), or std::overflow_error naming the tensor
// and its shape when it needs more than 2^64 - 1 bytes.
std::uint64_t tensor_bytes(const char* tensor, const char* shape, std::initializer_list<std::uint64_t> factors) {
  std::uint64_t product = 1;
  for (const std::uint64_t f : factors) {
    if (f != 0 && product > std::numeric_limits<std::uint64_t>::max() / f) {
      throw std::overflow_error(std::string("transformer_config: ") + tensor + " (" + shape +
                                ") need more than 2^64 - 1 bytes");
    }
    product *= f;
  }
  return product;
}

}  // namespace

graph make_transformer_step(const transformer_config& c) {
  const std::pair<const char*, std::uint64_t> dimensions[] = {
      {"layers", c.layers},     {"hidden", c.hidden}, {"heads", c.heads},
      {"sequence", c.sequence}, {"batch", c.batch},   {"vocabulary", c.vocabulary},
      {"dtype_bytes", c.dtype_bytes}};
  for (const auto& [name, value] : dimensions) {
    if (value == 0) {
      throw std::invalid_argument(std::string("transformer_config: ") + name + " is 0; it must be at least 1");
    }
  }
  if (c.hidden % c.heads != 0) {
    throw std::invalid_argument("transformer_config: heads (" + std::to_string(c.heads) + ") must divide hidden (" +
                                std::to_string(c.hidden) + ")");
  }
  // Counted ahead, so that a size no graph holds is refused at once, and one whose arrays do
  // not fit in memory fails here rather than after minutes of building.
  const std::uint64_t tensor_count = transformer_tensors_fixed + transformer_tensors_per_layer * std::uint64_t{c.layers};
  if (tensor_count > graph::max_tensors) {
    throw std::length_error("transformer_config: " + std::to_string(c.layers) + " layers make " +
                            std::to_string(tensor_count) + " tensors, more than a graph holds (" +
                            std::to_string(graph::max_tensors) + ")");
  }
  graph g;
  g.reserve(tensor_count, transformer_ops_fixed + transformer_ops_per_layer * std::size_t{c.layers});
  const std::uint64_t d = c.dtype_bytes;
  const std::uint64_t h = c.hidden;
  // Every size below, checked once: [B, S] token ids, [B, S, H] activations (x3 for QKV, x4
  // for the MLP), [B, h, S, S] attention scores, [B, S, V] logits, and the weights.
  const std::uint64_t token_ids = tensor_bytes("the token ids", "batch x sequence x 4", {c.batch, c.sequence, 4});
  const std::uint64_t act = tensor_bytes("the activations", "batch x sequence x hidden x dtype_bytes",
                                         {c.batch, c.sequence, h, d});
  const std::uint64_t mlp_act = tensor_bytes("the MLP activations", "4 x batch x sequence x hidden x dtype_bytes",
                                             {4, c.batch, c.sequence, h, d});
  const std::uint64_t qkv_act = mlp_act / 4 * 3;
  const std::uint64_t scores = tensor_bytes("the attention scores", "batch x heads x sequence^2 x dtype_bytes",
                                            {c.batch, c.heads, c.sequence, c.sequence, d});
  const std::uint64_t logits_bytes = tensor_bytes("the logits", "batch x sequence x vocabulary x dtype_bytes",
                                                  {c.batch, c.sequence, c.vocabulary, d});
  const std::uint64_t embedding = tensor_bytes("the token embedding", "vocabulary x hidden x dtype_bytes",
                                               {c.vocabulary, h, d});
  const std::uint64_t positions = tensor_bytes("the position embedding", "sequence x hidden x dtype_bytes",
                                               {c.sequence, h, d});
  const std::uint64_t mlp_weight = tensor_bytes("the MLP weights", "4 x hidden^2 x dtype_bytes", {4, h, h, d});
  const std::uint64_t qkv_weight = mlp_weight / 4 * 3;
  const std::uint64_t square_weight = mlp_weight / 4;
  const std::uint64_t norm_weight = tensor_bytes("the layer norms", "2 x hidden x dtype_bytes", {2, h, d});
  auto weight = [&](const std::string& name, std::uint64_t bytes) {
    return g.add_tensor(name, bytes, tensor_role::weight);
  };
  auto tensor = [&](const std::string& name, std::uint64_t bytes) {
    return g.add_tensor(name, bytes);
  };

  const auto ids = g.add_tensor("tokens", token_ids, tensor_role::graph_input);
  const auto labels = g.add_tensor("labels", token_ids, tensor_role::graph_input);
  const auto wte = weight("wte", embedding);
  const auto wpe = weight("wpe", positions);
  const auto dwte = weight("wte.grad", embedding);
  const auto dwpe = weight("wpe.grad", positions);

  struct layer_tensors {
    std::uint32_t x, a1, qkv, probs, ctx, x2, a2, h1, g1;
    std::uint32_t w_qkv, w_o, w_1, w_2, ln1, ln2;
    std::uint32_t dw_qkv, dw_o, dw_1, dw_2, dln1, dln2;
  };
  std::vector<layer_tensors> saved;

  std::uint32_t x = tensor("embed.out", act);
  g.add_op("embed", {ids, wte, wpe}, {x});
  for (std::uint32_t l = 0; l < c.layers; ++l) {
    const std::string p = "l" + std::to_string(l) + ".";
    layer_tensors t{};
    t.x = x;
    t.w_qkv = weight(p + "w_qkv", qkv_weight);
    t.w_o = weight(p + "w_o", square_weight);
    t.w_1 = weight(p + "w_fc1", mlp_weight);
    t.w_2 = weight(p + "w_fc2", mlp_weight);
    t.ln1 = weight(p + "ln1", norm_weight);
    t.ln2 = weight(p + "ln2", norm_weight);
    t.dw_qkv = weight(p + "w_qkv.grad", qkv_weight);
    t.dw_o = weight(p + "w_o.grad", square_weight);
    t.dw_1 = weight(p + "w_fc1.grad", mlp_weight);
    t.dw_2 = weight(p + "w_fc2.grad", mlp_weight);
    t.dln1 = weight(p + "ln1.grad", norm_weight);
    t.dln2 = weight(p + "ln2.grad", norm_weight);

    t.a1 = tensor(p + "ln1.out", act);
    g.add_op(p + "ln1", {x, t.ln1}, {t.a1});
    t.qkv = tensor(p + "qkv", qkv_act);
    g.add_op(p + "qkv", {t.a1, t.w_qkv}, {t.qkv});
    const auto sc = tensor(p + "scores", scores);
    g.add_op(p + "scores", {t.qkv}, {sc});
    t.probs = tensor(p + "probs", scores);
    g.add_op(p + "softmax", {sc}, {t.probs});
    t.ctx = tensor(p + "ctx", act);
    g.add_op(p + "attn_v", {t.probs, t.qkv}, {t.ctx});
    const auto proj = tensor(p + "proj", act);
    g.add_op(p + "proj", {t.ctx, t.w_o}, {proj});
    t.x2 = tensor(p + "resid1", act);
    g.add_op(p + "add1", {x, proj}, {t.x2});
    t.a2 = tensor(p + "ln2.out", act);
    g.add_op(p + "ln2", {t.x2, t.ln2}, {t.a2});
    t.h1 = tensor(p + "fc1", mlp_act);
    g.add_op(p + "fc1", {t.a2, t.w_1}, {t.h1});
    t.g1 = tensor(p + "gelu", mlp_act);
    g.add_op(p + "gelu", {t.h1}, {t.g1});
    const auto h2 = tensor(p + "fc2", act);
    g.add_op(p + "fc2", {t.g1, t.w_2}, {h2});
    x = tensor(p + "resid2", act);
    g.add_op(p + "add2", {t.x2, h2}, {x});
    saved.push_back(t);
  }

  const auto lnf = weight("lnf", norm_weight);
  const auto dlnf = weight("lnf.grad", norm_weight);
  const auto af = tensor("lnf.out", act);
  g.add_op("lnf", {x, lnf}, {af});
  const auto logits = tensor("logits", logits_bytes);
  g.add_op("logits", {af, wte}, {logits});
  const auto loss = g.add_tensor("loss", 4, tensor_role::graph_output);
  const auto dlogits = tensor("logits.grad", logits_bytes);
  g.add_op("cross_entropy", {logits, labels}, {loss, dlogits});
  const auto daf = tensor("lnf.out.grad", act);
  g.add_op("logits.bwd", {dlogits, af, wte}, {daf, dwte});
  std::uint32_t dx = tensor("lnf.in.grad", act);
  g.add_op("lnf.bwd", {daf, x, lnf}, {dx, dlnf});

  for (std::uint32_t l = c.layers; l-- > 0;) {
    const layer_tensors& t = saved[l];
    const std::string p = "l" + std::to_string(l) + ".";
    const auto dg1 = tensor(p + "gelu.grad", mlp_act);
    g.add_op(p + "fc2.bwd", {dx, t.g1, t.w_2}, {dg1, t.dw_2});
    const auto dh1 = tensor(p + "fc1.grad", mlp_act);
    g.add_op(p + "gelu.bwd", {dg1, t.h1}, {dh1});
    const auto da2 = tensor(p + "ln2.out.grad", act);
    g.add_op(p + "fc1.bwd", {dh1, t.a2, t.w_1}, {da2, t.dw_1});
    const auto dx2 = tensor(p + "resid1.grad", act);
    g.add_op(p + "ln2.bwd", {da2, t.x2, dx, t.ln2}, {dx2, t.dln2});
    const auto dctx = tensor(p + "ctx.grad", act);
    g.add_op(p + "proj.bwd", {dx2, t.ctx, t.w_o}, {dctx, t.dw_o});
    const auto dprobs = tensor(p + "probs.grad", scores);
    const auto dv = tensor(p + "v.grad", act);
    g.add_op(p + "attn_v.bwd", {dctx, t.probs, t.qkv}, {dprobs, dv});
    const auto dsc = tensor(p + "scores.grad", scores);
    g.add_op(p + "softmax.bwd", {dprobs, t.probs}, {dsc});
    const auto dqkv = tensor(p + "qkv.grad", qkv_act);
    g.add_op(p + "scores.bwd", {dsc, t.qkv, dv}, {dqkv});
    const auto da1 = tensor(p + "ln1.out.grad", act);
    g.add_op(p + "qkv.bwd", {dqkv, t.a1, t.w_qkv}, {da1, t.dw_qkv});
    const auto dxl = tensor(p + "input.grad", act);
    g.add_op(p + "ln1.bwd", {da1, t.x, dx2, t.ln1}, {dxl, t.dln1});
    dx = dxl;
  }
  g.add_op("embed.bwd", {dx, ids}, {dwte, dwpe});
  return g;
}

}  // namespace tensormem::core
