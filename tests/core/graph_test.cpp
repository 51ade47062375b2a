// Graph lifetimes (reference-count walk) and the built-in transformer step.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/graph.hpp"
#include "tensormem/core/replay.hpp"
#include "tensormem/core/transformer_step.hpp"

namespace tensormem::core {
namespace {

const buffer& buffer_of(const graph_lifetimes& l, std::uint32_t tensor) {
  const auto it = std::find(l.tensor_of.begin(), l.tensor_of.end(), tensor);
  EXPECT_NE(it, l.tensor_of.end());
  return l.buffers[static_cast<std::size_t>(it - l.tensor_of.begin())];
}

TEST(graph, reference_count_walk) {
  graph g;
  const auto in = g.add_tensor("in", 100, tensor_role::graph_input);
  const auto w = g.add_tensor("w", 1000, tensor_role::weight);
  const auto w2 = g.add_tensor("w2", 10, tensor_role::weight);
  const auto a = g.add_tensor("a", 200);
  const auto b = g.add_tensor("b", 300);
  const auto c = g.add_tensor("c", 400);
  const auto dead = g.add_tensor("dead", 50);
  const auto out = g.add_tensor("out", 8, tensor_role::graph_output);
  g.add_op("op0", {in, w}, {a});
  g.add_op("op1", {a}, {b, dead});
  g.add_op("op2", {a, b, w2}, {c});
  g.add_op("op3", {c}, {out});
  const graph_lifetimes l = derive_lifetimes(g, 256);
  EXPECT_EQ(l.steps, 4U);
  EXPECT_EQ(l.weight_bytes, 1024U + 256U);
  ASSERT_EQ(l.weight_offsets.size(), 2U);
  EXPECT_EQ(l.weight_offsets[1], 1024U);
  EXPECT_EQ(buffer_of(l, in).lower, 0U);
  EXPECT_EQ(buffer_of(l, in).upper, 4U);
  EXPECT_EQ(buffer_of(l, a).lower, 0U);
  EXPECT_EQ(buffer_of(l, a).upper, 3U);  // last consumer op2 -> freed after step 2
  EXPECT_EQ(buffer_of(l, b).lower, 1U);
  EXPECT_EQ(buffer_of(l, b).upper, 3U);
  EXPECT_EQ(buffer_of(l, dead).upper, 2U);  // nobody consumes it
  EXPECT_EQ(buffer_of(l, c).lower, 2U);
  // op2's output is allocated while its inputs are alive: c conflicts with a and b.
  EXPECT_TRUE(lifetimes_overlap(buffer_of(l, c), buffer_of(l, a)));
  EXPECT_EQ(buffer_of(l, out).lower, 0U);
  EXPECT_EQ(buffer_of(l, out).upper, 4U);
  EXPECT_EQ(lower_bound(l.buffers), 100U + 200 + 300 + 400 + 8);
}

TEST(graph, malformed_graphs_are_rejected) {
  graph g;
  const auto a = g.add_tensor("a", 1);
  EXPECT_THROW(g.add_op("bad", {a}, {7}), std::invalid_argument);
  EXPECT_THROW(g.add_op("bad", {a + 1}, {}), std::invalid_argument);  // one past the last tensor
  EXPECT_TRUE(g.ops().empty());
  const auto b = g.add_tensor("b", 1);
  g.add_op("uses_a", {a}, {b});
  try {
    derive_lifetimes(g);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'uses_a' consumes 'a'"), std::string::npos);
  }
  graph twice;
  const auto x = twice.add_tensor("x", 1);
  twice.add_op("p1", {}, {x});
  twice.add_op("p2", {}, {x});
  EXPECT_THROW(derive_lifetimes(twice), std::invalid_argument);
  graph writes_input;
  const auto i = writes_input.add_tensor("i", 1, tensor_role::graph_input);
  writes_input.add_op("w", {}, {i});
  EXPECT_THROW(derive_lifetimes(writes_input), std::invalid_argument);
}

// Tensors no op touches: an activation takes no memory, a graph input lives for the whole run,
// and a graph output that nothing produces is refused by name.
TEST(graph, tensors_no_op_touches) {
  graph g;
  const auto in = g.add_tensor("in", 16, tensor_role::graph_input);
  const auto unused_input = g.add_tensor("unused_input", 32, tensor_role::graph_input);
  const auto idle = g.add_tensor("idle", 64);
  const auto out = g.add_tensor("out", 8, tensor_role::graph_output);
  g.add_op("op", {in}, {out});
  const graph_lifetimes l = derive_lifetimes(g);
  EXPECT_EQ(l.buffers.size(), 3U);
  EXPECT_EQ(std::find(l.tensor_of.begin(), l.tensor_of.end(), idle), l.tensor_of.end());
  EXPECT_EQ(buffer_of(l, unused_input).lower, 0U);
  EXPECT_EQ(buffer_of(l, unused_input).upper, 1U);
  graph orphan;
  orphan.add_tensor("o", 8, tensor_role::graph_output);
  try {
    derive_lifetimes(orphan);
    ADD_FAILURE() << "an output nothing produces was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("output 'o' is never produced"), std::string::npos) << e.what();
  }
}

TEST(transformer_step, activations_live_until_backward) {
  transformer_config cfg;
  cfg.layers = 2;
  cfg.batch = 2;
  cfg.sequence = 128;
  const graph g = make_transformer_step(cfg);
  const graph_lifetimes l = derive_lifetimes(g);
  // Find op indices by name.
  auto op_index = [&](const std::string& name) {
    for (std::size_t i = 0; i < g.ops().size(); ++i)
      if (g.ops()[i].name == name) return i;
    ADD_FAILURE() << "no op " << name;
    return std::size_t{0};
  };
  const std::size_t softmax = op_index("l0.softmax");
  const std::size_t softmax_bwd = op_index("l0.softmax.bwd");
  EXPECT_LT(softmax, softmax_bwd);
  bool found = false;
  for (std::size_t k = 0; k < l.buffers.size(); ++k) {
    if (g.tensors()[l.tensor_of[k]].name == "l0.probs") {
      found = true;
      EXPECT_EQ(l.buffers[k].lower, softmax);
      EXPECT_EQ(l.buffers[k].upper, softmax_bwd + 1);
      EXPECT_EQ(l.buffers[k].bytes, 2U * 12 * 128 * 128 * 2);
    }
  }
  EXPECT_TRUE(found);
  // An online plan exists and sits between the lower bound and no reuse at all.
  best_fit_allocator a;
  const auto r = replay(l.buffers, a);
  std::uint64_t total = 0;
  for (const auto& b : l.buffers) total += b.bytes;
  EXPECT_GE(r.high_water, lower_bound(l.buffers, 256));
  EXPECT_LT(r.high_water, total);
  EXPECT_THROW(make_transformer_step({2, 768, 5, 128, 1, 100, 2}), std::invalid_argument);
}

TEST(graph, a_transformer_config_error_names_the_dimension) {
  auto message = [](const transformer_config& c) -> std::string {
    try {
      make_transformer_step(c);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(message({2, 768, 5, 128, 1, 100, 2}), "transformer_config: heads (5) must divide hidden (768)");
  const char* names[] = {"layers", "hidden", "heads", "sequence", "batch", "vocabulary", "dtype_bytes"};
  for (std::size_t i = 0; i < std::size(names); ++i) {
    transformer_config c{2, 64, 4, 16, 2, 100, 2};
    std::uint64_t* fields[] = {nullptr, &c.hidden, &c.heads, &c.sequence,
                               &c.batch, &c.vocabulary, &c.dtype_bytes};
    if (i == 0) {
      c.layers = 0;
    } else {
      *fields[i] = 0;
    }
    EXPECT_EQ(message(c), std::string("transformer_config: ") + names[i] + " is 0; it must be at least 1");
  }
}

TEST(graph, weight_alignment_and_weight_region_are_checked) {
  graph g;
  const auto in = g.add_tensor("in", 8, tensor_role::graph_input);
  const auto w = g.add_tensor("w", 1000, tensor_role::weight);
  const auto out = g.add_tensor("out", 8);
  g.add_op("mm", {in, w}, {out});
  for (const std::uint64_t alignment : {std::uint64_t{0}, std::uint64_t{3}, std::uint64_t{768}}) {
    try {
      derive_lifetimes(g, alignment);
      ADD_FAILURE() << "alignment " << alignment << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("alignment " + std::to_string(alignment) + " is not a power of two"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(derive_lifetimes(g, 1).weight_bytes, 1000U);
  EXPECT_EQ(derive_lifetimes(g, std::uint64_t{1} << 63).weight_bytes, std::uint64_t{1} << 63);

  // The region may end exactly at 2^64 - 1 bytes, never past it, and a weight whose padded
  // size does not fit in 64 bits is refused rather than counted unpadded.
  constexpr std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
  graph edge;
  edge.add_tensor("w0", max - 1000, tensor_role::weight);
  edge.add_tensor("w1", 1000, tensor_role::weight);
  EXPECT_EQ(derive_lifetimes(edge, 1).weight_bytes, max);
  EXPECT_THROW(derive_lifetimes(edge, 2), std::overflow_error);  // w0 padded: max - 999 + 1000
  edge.add_tensor("w2", 1, tensor_role::weight);
  try {
    derive_lifetimes(edge, 1);
    ADD_FAILURE() << "a weight region past 2^64 - 1 bytes was accepted";
  } catch (const std::overflow_error& e) {
    EXPECT_NE(std::string(e.what()).find("weight 'w2' of 1 bytes"), std::string::npos) << e.what();
  }
  graph unpaddable;
  unpaddable.add_tensor("huge", max, tensor_role::weight);
  EXPECT_EQ(derive_lifetimes(unpaddable, 1).weight_bytes, max);
  EXPECT_THROW(derive_lifetimes(unpaddable, 256), std::overflow_error);
}

// The sizes of the built-in model are products of its dimensions: a product past 2^64 - 1 is
// refused naming the tensor, never wrapped around to a small (or zero) size.
TEST(transformer_step, sizes_past_two_to_the_64_are_refused) {
  auto expect_overflow = [](const transformer_config& c, const std::string& named) {
    try {
      make_transformer_step(c);
      ADD_FAILURE() << named << " was accepted";
    } catch (const std::overflow_error& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
  };
  constexpr std::uint64_t two_to_40 = std::uint64_t{1} << 40;
  expect_overflow({1, two_to_40, 1, two_to_40, 1, 1, 1}, "the activations (batch x sequence x hidden");
  // Scores of exactly 2^63 bytes fit; twice that does not.
  const transformer_config largest{1, 1, 1, std::uint64_t{1} << 31, 1, 1, 2};
  const graph g = make_transformer_step(largest);
  bool saw_scores = false;
  for (const graph_tensor& t : g.tensors()) {
    if (t.name == "l0.scores") {
      saw_scores = true;
      EXPECT_EQ(t.bytes, std::uint64_t{1} << 63);
    }
  }
  EXPECT_TRUE(saw_scores);
  expect_overflow({1, 1, 1, std::uint64_t{1} << 31, 1, 1, 4}, "the attention scores");
  // Activations of exactly 2^64 - 1 bytes (3 x 5 x 17 x 257 x 641 x 65537 x 6700417) fit; the
  // MLP's, four times as many, are the first that do not.
  expect_overflow({1, 641 * 65537, 1, 17 * 257, 15, 1, 6700417}, "the MLP activations");
  expect_overflow({1, 1, 1, 4, 1, std::uint64_t{1} << 62, 1}, "the logits");
  expect_overflow({1, std::uint64_t{1} << 32, 1, 1, 1, 1, 1}, "the MLP weights");
  expect_overflow({1, 1, 1, 1, std::uint64_t{1} << 62, 1, 1}, "the token ids");
  expect_overflow({1, 4, 1, 1, 1, std::uint64_t{1} << 62, 1}, "the token embedding");
}

// A graph's tensor indices are 32-bit: the tensor past the limit is refused, not given
// index 0 again (a static_cast of the size did that at 2^32 tensors). The limit is the
// caller's to lower, and reserve respects it.
TEST(graph, the_tensor_past_the_limit_is_refused_and_changes_nothing) {
  EXPECT_EQ(graph().tensor_limit(), graph::max_tensors);
  EXPECT_EQ(graph::max_tensors, std::uint64_t{std::numeric_limits<std::uint32_t>::max()});
  EXPECT_THROW(graph(graph::max_tensors + 1), std::invalid_argument);
  EXPECT_EQ(graph(graph::max_tensors).tensor_limit(), graph::max_tensors);
  graph g(3);
  EXPECT_EQ(g.add_tensor("a", 1), 0U);
  EXPECT_EQ(g.add_tensor("b", 2), 1U);
  EXPECT_EQ(g.add_tensor("c", 3), 2U);
  try {
    g.add_tensor("d", 4);
    ADD_FAILURE() << "a fourth tensor was accepted";
  } catch (const std::length_error& e) {
    EXPECT_NE(std::string(e.what()).find("'d'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("3"), std::string::npos) << e.what();
  }
  ASSERT_EQ(g.tensors().size(), 3U);
  EXPECT_EQ(g.tensors()[0].name, "a");
  EXPECT_THROW(g.reserve(4, 0), std::length_error);
  g.reserve(3, 10);
  g.add_op("op", {0, 1}, {2});
  EXPECT_EQ(g.ops().size(), 1U);
}

// The builder's count ahead is its real count, and too many layers for 32-bit indices are
// refused before anything is built (at once: 10^9 layers used to build until memory ran out).
TEST(transformer_step, its_size_is_known_ahead_and_too_many_layers_are_refused_at_once) {
  for (const std::uint32_t layers : {1U, 2U, 7U}) {
    const graph g = make_transformer_step({layers, 64, 4, 16, 2, 100, 2});
    EXPECT_EQ(g.tensors().size(), transformer_tensors_fixed + transformer_tensors_per_layer * layers);
    EXPECT_EQ(g.ops().size(), transformer_ops_fixed + transformer_ops_per_layer * layers);
  }
  const auto most = static_cast<std::uint32_t>((graph::max_tensors - transformer_tensors_fixed) /
                                               transformer_tensors_per_layer);
  for (const std::uint32_t layers : {most + 1U, 1000000000U, std::numeric_limits<std::uint32_t>::max()}) {
    try {
      make_transformer_step({layers, 64, 4, 16, 2, 100, 2});
      ADD_FAILURE() << layers << " layers were accepted";
    } catch (const std::length_error& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(layers) + " layers"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace tensormem::core
