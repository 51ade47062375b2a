// The plan picture: buffers, axes with ticks in time steps and binary units, the lower bound
// and the arena labelled, a legend; above 20,000 buffers their union per pixel column.

#include <gtest/gtest.h>

#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tensormem/trace/plan_svg.hpp"

namespace tensormem::trace {
namespace {

std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TEST(plan_svg, axes_labels_and_legend) {
  const std::vector<core::buffer> buffers = {{"a", 0, 10, 1 << 20, {}}, {"b", 5, 20, 2 << 20, {}}, {"c", 12, 30, 1 << 20, {}}};
  const std::vector<std::uint64_t> offsets = {0, 1 << 20, 0};
  std::ostringstream out;
  write_plan_svg(out, buffers, offsets, 3 << 20, 3 << 20);
  const std::string svg = out.str();
  EXPECT_EQ(count(svg, "<svg "), 1U);
  EXPECT_TRUE(svg.ends_with("</svg>\n"));
  EXPECT_EQ(count(svg, "class=\"buffer\""), 3U);
  EXPECT_NE(svg.find("b: steps [5, 20), offset 1048576, 2097152 bytes"), std::string::npos);
  EXPECT_GE(count(svg, "class=\"xtick\""), 3U);
  EXPECT_GE(count(svg, "class=\"ytick\""), 3U);
  for (const char* label : {">0</text>", ">30</text>", ">1 MiB</text>", ">3 MiB</text>", "time step",
                            "offset in the arena", "lower bound 3 MiB", "arena 3 MiB",
                            "lower bound: most bytes", "1.0000 x"}) {
    EXPECT_NE(svg.find(label), std::string::npos) << label;
  }
  EXPECT_EQ(count(svg, "class=\"lower-bound\""), 1U);
  EXPECT_EQ(count(svg, "class=\"arena\""), 1U);
}

// 100,000 buffers stacked without overlap: drawn as their union, a file of bounded size.
TEST(plan_svg, many_buffers_are_aggregated) {
  std::mt19937_64 rng(5);
  std::vector<core::buffer> buffers;
  std::vector<std::uint64_t> offsets;
  std::uint64_t stack = 0;
  for (int i = 0; i < 100'000; ++i) {
    const std::uint64_t lower = rng() % 5000;
    buffers.push_back({"t" + std::to_string(i), lower, lower + 1 + rng() % 200, 256 + rng() % 4096, {}});
    offsets.push_back(stack);
    stack += buffers.back().bytes;
  }
  std::ostringstream out;
  write_plan_svg(out, buffers, offsets, stack, stack / 2);
  const std::string svg = out.str();
  EXPECT_EQ(count(svg, "class=\"buffer\""), 0U);
  EXPECT_EQ(count(svg, "class=\"aggregate\""), 1U);
  EXPECT_NE(svg.find("drawn as their union"), std::string::npos);
  EXPECT_LT(svg.size(), std::size_t{4} << 20);
  EXPECT_GT(count(svg, "<rect x="), 100U);  // something is drawn
}

}  // namespace
}  // namespace tensormem::trace
