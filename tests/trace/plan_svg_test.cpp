// The plan picture: buffers, axes with ticks in time steps and binary units, the lower bound
// and the arena labelled, a legend; above 20,000 buffers their union per pixel column.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tensormem/core/planner.hpp"
#include "tensormem/memory/host_resource.hpp"
#include "tensormem/trace/arena_svg.hpp"
#include "tensormem/trace/plan_svg.hpp"
#include "tensormem/trace/trace_io.hpp"
#include "../../src/trace/svg_support.hpp"

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

// A plan that does not validate is drawn as given (to see what is wrong) and says so, in the
// picture and to the caller; a valid one carries no such line.
TEST(plan_svg, a_plan_that_does_not_validate_says_what_is_wrong) {
  const std::vector<core::buffer> buffers = {{"a", 0, 10, 1 << 20, {}}, {"b<x>", 5, 20, 2 << 20, {}}};
  std::ostringstream valid;
  EXPECT_EQ(write_plan_svg(valid, buffers, std::vector<std::uint64_t>{0, 1 << 20}, 3 << 20, 3 << 20), "");
  EXPECT_EQ(valid.str().find("not a valid plan"), std::string::npos);
  for (const auto& [offsets, arena] : {std::pair{std::vector<std::uint64_t>{0, 1 << 19}, std::uint64_t{3} << 20},
                                       std::pair{std::vector<std::uint64_t>{0, 1 << 20}, std::uint64_t{2} << 20}}) {
    std::ostringstream svg;
    std::ostringstream html;
    const std::string problem = write_plan_svg(svg, buffers, offsets, arena, 3 << 20);
    EXPECT_EQ(problem, core::validate(buffers, offsets, arena));
    ASSERT_FALSE(problem.empty());
    EXPECT_NE(svg.str().find("fill=\"#c00\">not a valid plan: "), std::string::npos);
    EXPECT_NE(svg.str().find("b&lt;x&gt;"), std::string::npos);
    EXPECT_EQ(count(svg.str(), "class=\"buffer\""), 2U);  // drawn all the same
    EXPECT_EQ(write_plan_html(html, buffers, offsets, arena, 3 << 20, "t"), problem);
    EXPECT_NE(html.str().find("invalid:\""), std::string::npos);
    EXPECT_EQ(html.str().find("invalid:\"\","), std::string::npos);  // the message is there, escaped
    EXPECT_NE(html.str().find("\"not a valid plan: \" + P.invalid"), std::string::npos);
  }
  std::ostringstream html;
  EXPECT_EQ(write_plan_html(html, buffers, std::vector<std::uint64_t>{0, 1 << 20}, 3 << 20, 3 << 20, "t"), "");
  EXPECT_NE(html.str().find("invalid:\"\","), std::string::npos);
  std::ostringstream unused;
  EXPECT_THROW(write_plan_svg(unused, buffers, std::vector<std::uint64_t>{0}, 3 << 20, 3 << 20),
               std::invalid_argument);
  EXPECT_THROW(write_plan_html(unused, buffers, std::vector<std::uint64_t>{0, 1, 2}, 3 << 20, 3 << 20, "t"),
               std::invalid_argument);
}


// A validation the caller has made already is what the pictures show and return, and the plan
// is not validated again: a made-up message on a valid plan is drawn, and an invalid plan said
// to be valid draws no red line. The check of one offset per buffer still runs.
TEST(plan_svg, a_validation_made_by_the_caller_is_shown_and_not_made_again) {
  const std::vector<core::buffer> buffers = {{"a", 0, 10, 1 << 20, {}}, {"b", 5, 20, 2 << 20, {}}};
  const std::vector<std::uint64_t> valid = {0, 1 << 20};
  const std::vector<std::uint64_t> overlapping = {0, 1 << 19};
  ASSERT_EQ(core::validate(buffers, valid, 3 << 20), "");
  ASSERT_NE(core::validate(buffers, overlapping, 3 << 20), "");
  std::ostringstream svg;
  std::ostringstream html;
  EXPECT_EQ(write_plan_svg(svg, buffers, valid, 3 << 20, 3 << 20, std::string("told")), "told");
  EXPECT_NE(svg.str().find("fill=\"#c00\">not a valid plan: told<"), std::string::npos);
  EXPECT_EQ(write_plan_html(html, buffers, valid, 3 << 20, 3 << 20, "t", std::string("told")), "told");
  EXPECT_NE(html.str().find("invalid:\"told\","), std::string::npos);
  std::ostringstream trusted_svg;
  std::ostringstream trusted_html;
  EXPECT_EQ(write_plan_svg(trusted_svg, buffers, overlapping, 3 << 20, 3 << 20, std::string()), "");
  EXPECT_EQ(trusted_svg.str().find("not a valid plan"), std::string::npos);
  EXPECT_EQ(write_plan_html(trusted_html, buffers, overlapping, 3 << 20, 3 << 20, "t", std::string()), "");
  EXPECT_NE(trusted_html.str().find("invalid:\"\","), std::string::npos);
  std::ostringstream unused;
  EXPECT_THROW(write_plan_svg(unused, buffers, std::vector<std::uint64_t>{0}, 3 << 20, 3 << 20, std::string()),
               std::invalid_argument);
  EXPECT_THROW(
      write_plan_html(unused, buffers, std::vector<std::uint64_t>{0, 1, 2}, 3 << 20, 3 << 20, "t", std::string()),
      std::invalid_argument);
}
// Ids given through the API (not read from a trace) may hold any bytes: the picture stays
// well-formed XML, each byte that is not text drawn as U+FFFD.
TEST(plan_svg, ids_that_are_not_text_are_drawn_as_replacement_characters) {
  const std::vector<core::buffer> buffers = {{"a\x01<b>\xFF\xC3", 0, 10, 64, {}}, {"caf\xC3\xA9", 0, 10, 64, {}}};
  std::ostringstream out;
  const std::vector<std::uint64_t> offsets = {0, 64};
  write_plan_svg(out, buffers, offsets, 128, 128);
  const std::string svg = out.str();
  std::istringstream lines(svg);
  for (std::string line; std::getline(lines, line);) {
    ASSERT_EQ(first_non_text_byte(line), line.size()) << line;
  }
  EXPECT_NE(svg.find("<title>a\xEF\xBF\xBD&lt;b&gt;\xEF\xBF\xBD\xEF\xBF\xBD: steps"), std::string::npos);
  EXPECT_NE(svg.find("<title>caf\xC3\xA9: steps"), std::string::npos);
}

// Nothing ever alive and an empty arena: 1.0000 x, as the planner reports it, not 0.
TEST(plan_svg, an_empty_plan_is_at_its_lower_bound) {
  std::ostringstream empty;
  write_plan_svg(empty, std::vector<core::buffer>{}, std::vector<std::uint64_t>{}, 0, 0);
  EXPECT_NE(empty.str().find("0 buffers: arena 0 B, lower bound 0 B (1.0000 x)"), std::string::npos) << empty.str();
  EXPECT_EQ(empty.str().find("nan"), std::string::npos) << "a time axis of no length divided by";
  const std::vector<core::buffer> zero_bytes = {{"z", 0, 3, 0, {}}};
  std::ostringstream zero;
  write_plan_svg(zero, zero_bytes, std::vector<std::uint64_t>{0}, 0, 0);
  EXPECT_NE(zero.str().find("(1.0000 x)"), std::string::npos);
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

// The union per pixel column against a naive fill of every buffer's pixels. The plot is 940 x 600
// pixels over 940 * `steps` time steps and 600 KiB of arena, so that a column is `steps` steps
// and a row 1 KiB, and every expected pixel is exact. With one step a column and whole KiB every
// edge falls on a pixel boundary; with ten steps a column and offsets and sizes in quarters of a
// KiB, a buffer's edges are rounded down to whole pixels (rows counted from the top), and one
// narrower or lower than a pixel is drawn one pixel wide or high. Buffers overlap (the plan is
// drawn as given), one of zero bytes spans all time mid-height (it sets the time axis and is not
// drawn), and some reach the plot's right and top edges. The plot's size and its place (90 pixels
// from the left, 56 from the top) are write_plan_svg's layout.
TEST(plan_svg, the_aggregate_is_the_union_of_the_buffers_pixels) {
  constexpr std::uint64_t cols = 940;
  constexpr std::uint64_t rows = 600;
  for (const std::uint64_t steps : {std::uint64_t{1}, std::uint64_t{10}}) {
    const std::uint64_t quantum = steps == 1 ? 1024 : 256;  // of a buffer's size
    std::mt19937_64 rng(17 + steps);
    std::vector<core::buffer> buffers = {{"all time, empty", 0, cols * steps, 0, {}}};
    std::vector<std::uint64_t> offsets = {300 * 1024};
    while (buffers.size() <= 20'000) {
      const std::uint64_t lower = rng() % (cols * steps);
      const std::uint64_t upper = std::min<std::uint64_t>(cols * steps, lower + 1 + rng() % (12 * steps));
      const std::uint64_t offset = (rng() % rows) * 1024 + (steps == 1 ? 0 : quantum * (rng() % 4));
      const std::uint64_t bytes = std::min<std::uint64_t>(rows * 1024 - offset, quantum * (1 + rng() % 24));
      buffers.push_back({"b" + std::to_string(buffers.size()), lower, upper, bytes, {}});
      offsets.push_back(offset);
    }
    std::vector<std::vector<bool>> covered(cols, std::vector<bool>(rows, false));  // [column][row from the top]
    for (std::size_t i = 1; i < buffers.size(); ++i) {
      const std::uint64_t top_row = (rows * 1024 - offsets[i] - buffers[i].bytes) / 1024;
      const std::uint64_t bottom_row = std::max(top_row + 1, (rows * 1024 - offsets[i]) / 1024);
      const std::uint64_t first_col = buffers[i].lower / steps;
      const std::uint64_t end_col = std::max(first_col + 1, buffers[i].upper / steps);
      for (std::uint64_t c = first_col; c < end_col; ++c) {
        for (std::uint64_t r = top_row; r < bottom_row; ++r) covered[c][r] = true;
      }
    }
    std::ostringstream expected;
    for (std::size_t c = 0; c < cols; ++c) {
      for (std::size_t r = 0; r < rows;) {
        if (!covered[c][r]) {
          ++r;
          continue;
        }
        const std::size_t start = r;
        while (r < rows && covered[c][r]) ++r;
        expected << "<rect x=\"" << 90 + c << "\" y=\"" << 56 + start << "\" width=\"1\" height=\"" << r - start
                 << "\"/>\n";
      }
    }
    std::ostringstream out;
    write_plan_svg(out, buffers, offsets, rows * 1024, 1);
    const std::string svg = out.str();
    const std::size_t group = svg.find("<g class=\"aggregate\"");
    ASSERT_NE(group, std::string::npos);
    const std::size_t first = svg.find("<rect", group);
    const std::size_t end = svg.find("</g>", group);
    ASSERT_LT(first, end);
    // (Compared by hand: gtest's diff of two strings of some 20,000 lines each would need
    // gigabytes.) The first rectangle that differs is shown.
    const std::string got = svg.substr(first, end - first);
    const std::string want = expected.str();
    const auto at = static_cast<std::size_t>(std::mismatch(got.begin(), got.end(), want.begin(), want.end()).first -
                                             got.begin());
    const std::size_t line_end = at == 0 ? std::string::npos : got.rfind('\n', at - 1);
    const std::size_t from = line_end == std::string::npos ? 0 : line_end + 1;  // the line that differs
    EXPECT_TRUE(got == want) << steps << " steps a column: " << got.size() << " bytes drawn, " << want.size()
                             << " expected; first difference at '" << got.substr(from, 60) << "', expected '"
                             << want.substr(from, 60) << "'";
  }
}

// Binary units and round tick steps at their edges: the unit changes at 1024, two formats meet
// at 100, the units end at EiB; a step of exactly a round number, an axis of exactly one unit,
// and fractions of a unit halved down to the tick spacing exactly.
TEST(svg_support, units_and_tick_steps_at_their_edges) {
  using detail::byte_tick_step;
  using detail::human;
  using detail::tick_step;
  EXPECT_EQ(human(0), "0 B");
  EXPECT_EQ(human(5), "5 B");
  EXPECT_EQ(human(1023), "1023 B");
  EXPECT_EQ(human(1024), "1 KiB");
  EXPECT_EQ(human(1536), "1.5 KiB");
  EXPECT_EQ(human(99.5 * 1024), "99.5 KiB");
  EXPECT_EQ(human(1023.0 * 1024), "1023 KiB");
  EXPECT_EQ(human(std::ldexp(1.0, 60)), "1 EiB");
  EXPECT_EQ(human(std::ldexp(1.0, 70)), "1024 EiB");
  EXPECT_EQ(tick_step(0, 8, 10), 1.0);
  EXPECT_EQ(tick_step(100, 8, 10), 20.0);
  EXPECT_EQ(tick_step(80, 8, 10), 10.0);
  EXPECT_EQ(byte_tick_step(1024, 6), 256.0);
  EXPECT_EQ(byte_tick_step(1536, 6), 256.0);
  EXPECT_EQ(byte_tick_step(6.0 * 1024 * 1024, 6), 1024.0 * 1024);
  EXPECT_EQ(byte_tick_step(std::ldexp(1.0, 70), 6), 200 * std::ldexp(1.0, 60));
}

// Up to 2,000 buffers are outlined, up to 20,000 drawn one by one; one more, and they are not.
TEST(plan_svg, outlines_and_aggregation_start_one_buffer_past_their_limits) {
  auto drawn = [](std::size_t n) {
    std::vector<core::buffer> buffers;
    std::vector<std::uint64_t> offsets;
    for (std::size_t i = 0; i < n; ++i) {
      buffers.push_back({"t" + std::to_string(i), i, i + 1, 256, {}});
      offsets.push_back(0);
    }
    std::ostringstream out;
    write_plan_svg(out, buffers, offsets, 256, 256);
    return std::pair{count(out.str(), "class=\"buffer\""), count(out.str(), "stroke-width=\"0.3\"")};
  };
  EXPECT_EQ(drawn(2'000), (std::pair<std::size_t, std::size_t>{2'000, 2'000}));
  EXPECT_EQ(drawn(2'001), (std::pair<std::size_t, std::size_t>{2'001, 0}));
  EXPECT_EQ(drawn(20'000), (std::pair<std::size_t, std::size_t>{20'000, 0}));
  EXPECT_EQ(drawn(20'001), (std::pair<std::size_t, std::size_t>{0, 0}));
}

// The page carries the plan as data; ids that look like markup or code stay text.
TEST(plan_html, data_arrays_and_escaped_ids) {
  const std::vector<core::buffer> buffers = {{"x</script><b>", 0, 10, 4096, {}},
                                             {"quote\"back\\slash\ttab", 3, 7, 1 << 20, {}},
                                             {"<!--<script>", 8, 9, 16, {}}};
  const std::vector<std::uint64_t> offsets = {1 << 20, 0, 0};
  std::ostringstream out;
  write_plan_html(out, buffers, offsets, (1 << 20) + 4096, 1 << 20, "t</title>.csv");
  const std::string html = out.str();
  EXPECT_TRUE(html.starts_with("<!DOCTYPE html>"));
  EXPECT_TRUE(html.ends_with("</html>\n"));
  EXPECT_EQ(count(html, "</script>"), 1U) << "an id closed the script element";
  // "<!--" then "<script" inside a script element makes the parser swallow the page.
  EXPECT_EQ(count(html, "<script"), 1U) << "an id opened a script";
  EXPECT_EQ(count(html, "<!--"), 0U) << "an id opened a comment";
  EXPECT_NE(html.find(R"(ids:["x\u003c/script\u003e\u003cb\u003e","quote\"back\\slash\u0009tab",)"
                      R"("\u003c!--\u003cscript\u003e"])"),
            std::string::npos);
  EXPECT_NE(html.find(R"(title:"t\u003c/title\u003e.csv")"), std::string::npos);
  EXPECT_NE(html.find("lower:[0,3,8],"), std::string::npos);
  EXPECT_NE(html.find("upper:[10,7,9],"), std::string::npos);
  EXPECT_NE(html.find("offset:[1048576,0,0],"), std::string::npos);
  EXPECT_NE(html.find("bytes:[4096,1048576,16],"), std::string::npos);
  EXPECT_NE(html.find("arena:1052672,"), std::string::npos);
  EXPECT_EQ(html.find("http"), std::string::npos) << "the page must not reach the network";
}

// The arena map: one bar per snapshot, a rectangle per tensor with padding, the used and
// free bytes and the largest hole per bar, an axis in binary units; blocks outside refused.
TEST(arena_svg, bars_tensors_holes_and_axis) {
  const std::vector<arena_snapshot> rows = {
      {"before", {{"w<1>", 0, 1000, 1024}, {"b", 3072, 1024, 1024}}},  // holes 2048 and 4096
      {"after", {{"w<1>", 0, 1000, 1024}, {"b", 1024, 1024, 1024}}}};  // one hole of 6144
  std::ostringstream out;
  write_arena_svg(out, rows, 8192);
  const std::string svg = out.str();
  EXPECT_EQ(count(svg, "class=\"row-label\""), 2U);
  EXPECT_EQ(count(svg, "class=\"tensor\""), 4U);
  EXPECT_NE(svg.find("w&lt;1&gt;: offset 0, 1000 bytes (1024 reserved)"), std::string::npos);
  EXPECT_NE(svg.find("before: 2 tensors, used 2 KiB, free 6 KiB, largest hole 4 KiB"), std::string::npos);
  EXPECT_NE(svg.find("after: 2 tensors, used 2 KiB, free 6 KiB, largest hole 6 KiB"), std::string::npos);
  EXPECT_EQ(count(svg, "hsl("), 6U) << "padded tensors get a pale padding rectangle";
  for (const char* label : {">0 B</text>", ">4 KiB</text>", ">8 KiB</text>", "offset in the arena"}) {
    EXPECT_NE(svg.find(label), std::string::npos) << label;
  }
  const std::vector<arena_snapshot> outside = {{"bad", {{"x", 8000, 100, 256}}}};
  std::ostringstream ignored;
  EXPECT_THROW(write_arena_svg(ignored, outside, 8192), std::invalid_argument);
}

// Blocks are drawn up to the capacity's last byte, and an empty one at the capacity itself; a
// block one byte past it, or holding more bytes than it reserves, is refused.
TEST(arena_svg, blocks_reach_the_capacity_and_none_passes_it) {
  const std::vector<arena_snapshot> inside = {{"full", {{"a", 0, 8192, 8192}}},
                                              {"end", {{"a", 0, 4096, 4096}, {"z", 8192, 0, 0}}}};
  std::ostringstream out;
  EXPECT_NO_THROW(write_arena_svg(out, inside, 8192));
  EXPECT_NE(out.str().find("full: 1 tensors, used 8 KiB, free 0 B, largest hole 0 B"), std::string::npos);
  EXPECT_NE(out.str().find("end: 2 tensors, used 4 KiB, free 4 KiB, largest hole 4 KiB"), std::string::npos);
  for (const arena_block& past : {arena_block{"x", 7936, 256, 512}, arena_block{"x", 8193, 0, 0},
                                  arena_block{"x", 0, 300, 256}}) {
    const std::vector<arena_snapshot> rows = {{"bad", {past}}};
    std::ostringstream ignored;
    EXPECT_THROW(write_arena_svg(ignored, rows, 8192), std::invalid_argument) << past.offset << " " << past.bytes;
  }
}

// A snapshot of a real arena: ids as names (or the caller's names), reserved = aligned size.
TEST(arena_svg, snapshot_of_an_arena) {
  memory::host_resource host;
  arena::contiguous_arena a(host, 4096, {.alignment = 256});
  const auto x = a.allocate(100);
  const auto y = a.allocate(300);
  static_cast<void>(a.allocate(512));  // a whole number of alignments reserves only itself
  const arena_snapshot s = snapshot(a, "now");
  ASSERT_EQ(s.blocks.size(), 3U);
  EXPECT_EQ(s.blocks[2].reserved, 512U);
  EXPECT_EQ(s.blocks[0].name, std::to_string(x.id));
  EXPECT_EQ(s.blocks[0].reserved, 256U);
  EXPECT_EQ(s.blocks[1].offset, y.offset);
  EXPECT_EQ(s.blocks[1].reserved, 512U);
  const arena_snapshot named = snapshot(a, "now", [](std::uint64_t id) { return "t" + std::to_string(id); });
  EXPECT_EQ(named.blocks[1].name, "t" + std::to_string(y.id));
}

}  // namespace
}  // namespace tensormem::trace
