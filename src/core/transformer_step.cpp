#include "tensormem/core/transformer_step.hpp"

#include <stdexcept>
#include <string>

namespace tensormem::core {

graph make_transformer_step(const transformer_config& c) {
  if (c.layers == 0 || c.hidden == 0 || c.heads == 0 || c.sequence == 0 || c.batch == 0 ||
      c.vocabulary == 0 || c.dtype_bytes == 0 || c.hidden % c.heads != 0) {
    throw std::invalid_argument("transformer_config: dimensions must be positive and heads "
                                "must divide hidden");
  }
  graph g;
  const std::uint64_t d = c.dtype_bytes;
  const std::uint64_t tokens = c.batch * c.sequence;
  const std::uint64_t act = tokens * c.hidden * d;            // [B, S, H]
  const std::uint64_t scores = c.batch * c.heads * c.sequence * c.sequence * d;  // [B, h, S, S]
  const std::uint64_t h = c.hidden;
  auto weight = [&](const std::string& name, std::uint64_t bytes) {
    return g.add_tensor(name, bytes, tensor_role::weight);
  };
  auto tensor = [&](const std::string& name, std::uint64_t bytes) {
    return g.add_tensor(name, bytes);
  };

  const auto ids = g.add_tensor("tokens", tokens * 4, tensor_role::graph_input);
  const auto labels = g.add_tensor("labels", tokens * 4, tensor_role::graph_input);
  const auto wte = weight("wte", c.vocabulary * h * d);
  const auto wpe = weight("wpe", c.sequence * h * d);
  const auto dwte = weight("wte.grad", c.vocabulary * h * d);
  const auto dwpe = weight("wpe.grad", c.sequence * h * d);

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
    t.w_qkv = weight(p + "w_qkv", 3 * h * h * d);
    t.w_o = weight(p + "w_o", h * h * d);
    t.w_1 = weight(p + "w_fc1", 4 * h * h * d);
    t.w_2 = weight(p + "w_fc2", 4 * h * h * d);
    t.ln1 = weight(p + "ln1", 2 * h * d);
    t.ln2 = weight(p + "ln2", 2 * h * d);
    t.dw_qkv = weight(p + "w_qkv.grad", 3 * h * h * d);
    t.dw_o = weight(p + "w_o.grad", h * h * d);
    t.dw_1 = weight(p + "w_fc1.grad", 4 * h * h * d);
    t.dw_2 = weight(p + "w_fc2.grad", 4 * h * h * d);
    t.dln1 = weight(p + "ln1.grad", 2 * h * d);
    t.dln2 = weight(p + "ln2.grad", 2 * h * d);

    t.a1 = tensor(p + "ln1.out", act);
    g.add_op(p + "ln1", {x, t.ln1}, {t.a1});
    t.qkv = tensor(p + "qkv", 3 * act);
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
    t.h1 = tensor(p + "fc1", 4 * act);
    g.add_op(p + "fc1", {t.a2, t.w_1}, {t.h1});
    t.g1 = tensor(p + "gelu", 4 * act);
    g.add_op(p + "gelu", {t.h1}, {t.g1});
    const auto h2 = tensor(p + "fc2", act);
    g.add_op(p + "fc2", {t.g1, t.w_2}, {h2});
    x = tensor(p + "resid2", act);
    g.add_op(p + "add2", {t.x2, h2}, {x});
    saved.push_back(t);
  }

  const auto lnf = weight("lnf", 2 * h * d);
  const auto dlnf = weight("lnf.grad", 2 * h * d);
  const auto af = tensor("lnf.out", act);
  g.add_op("lnf", {x, lnf}, {af});
  const auto logits = tensor("logits", tokens * c.vocabulary * d);
  g.add_op("logits", {af, wte}, {logits});
  const auto loss = g.add_tensor("loss", 4, tensor_role::graph_output);
  const auto dlogits = tensor("logits.grad", tokens * c.vocabulary * d);
  g.add_op("cross_entropy", {logits, labels}, {loss, dlogits});
  const auto daf = tensor("lnf.out.grad", act);
  g.add_op("logits.bwd", {dlogits, af, wte}, {daf, dwte});
  std::uint32_t dx = tensor("lnf.in.grad", act);
  g.add_op("lnf.bwd", {daf, x, lnf}, {dx, dlnf});

  for (std::uint32_t l = c.layers; l-- > 0;) {
    const layer_tensors& t = saved[l];
    const std::string p = "l" + std::to_string(l) + ".";
    const auto dg1 = tensor(p + "gelu.grad", 4 * act);
    g.add_op(p + "fc2.bwd", {dx, t.g1, t.w_2}, {dg1, t.dw_2});
    const auto dh1 = tensor(p + "fc1.grad", 4 * act);
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
    const auto dqkv = tensor(p + "qkv.grad", 3 * act);
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
