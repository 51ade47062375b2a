#include "tensormem/trace/plan_svg.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <ostream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "tensormem/core/planner.hpp"

#include "svg_support.hpp"
#include "write_file.hpp"

namespace tensormem::trace {

using detail::escape;
using detail::human;
using detail::tick_step;

namespace {

constexpr std::size_t outlined_up_to = 2'000;     // buffers drawn with an outline
constexpr std::size_t one_by_one_up_to = 20'000;  // above: their union, per pixel column

}  // namespace

std::string plan_problem(std::span<const core::buffer> buffers, std::span<const std::uint64_t> offsets,
                         std::uint64_t arena_bytes) {
  if (offsets.size() != buffers.size()) {
    throw std::invalid_argument("plan picture: " + std::to_string(offsets.size()) + " offsets for " +
                                std::to_string(buffers.size()) + " buffers");
  }
  return core::validate(buffers, offsets, arena_bytes);
}

namespace detail {
std::string picture_problem(std::span<const core::buffer> buffers, std::span<const std::uint64_t> offsets,
                            std::uint64_t arena_bytes, const known_problem& validated) {
  // (With one offset per buffer missing, plan_problem throws.)
  if (!validated || offsets.size() != buffers.size()) return plan_problem(buffers, offsets, arena_bytes);
  return *validated;
}
}  // namespace detail

std::string write_plan_svg(std::ostream& out, std::span<const core::buffer> buffers,
                           std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                           std::uint64_t lower_bound, const known_problem& validated) {
  const std::string problem = detail::picture_problem(buffers, offsets, arena_bytes, validated);
  constexpr double width = 1280;
  constexpr double height = 720;
  constexpr double left = 90;    // y tick labels
  constexpr double right = 250;  // line labels and the legend
  constexpr double top = 56;
  constexpr double bottom = 64;  // x tick labels and the axis title
  const double plot_w = width - left - right;
  const double plot_h = height - top - bottom;
  std::uint64_t t0 = UINT64_MAX;
  std::uint64_t t1 = 0;
  for (const core::buffer& b : buffers) {
    t0 = std::min(t0, b.lower);
    t1 = std::max(t1, b.upper);
  }
  if (buffers.empty()) t0 = t1 = 0;
  const double span_t = t1 > t0 ? static_cast<double>(t1 - t0) : 1.0;
  const double y_top = static_cast<double>(std::max({arena_bytes, lower_bound, std::uint64_t{1}}));
  auto x_of = [&](double t) { return left + plot_w * (t - static_cast<double>(t0)) / span_t; };
  auto y_of = [&](double bytes) { return top + plot_h - plot_h * bytes / y_top; };
  // As core::plan_result::ratio: 1 when nothing is ever alive and the arena is empty.
  const bool no_ratio = lower_bound == 0 && arena_bytes > 0;
  const double ratio = lower_bound > 0 ? static_cast<double>(arena_bytes) / static_cast<double>(lower_bound) : 1.0;

  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << width << ' ' << height << "\" font-family=\"sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << left << "\" y=\"26\" font-size=\"16\">" << buffers.size()
      << " buffers: arena " << escape(human(static_cast<double>(arena_bytes))) << ", lower bound "
      << escape(human(static_cast<double>(lower_bound))) << " (" << std::fixed;
  out.precision(4);
  if (no_ratio) out << "n/a";
  else out << ratio;
  out << " x)</text>\n";
  out.unsetf(std::ios::floatfield);
  out.precision(6);
  // A plan that does not validate is drawn as it is (to see what is wrong), and says so.
  if (!problem.empty()) {
    constexpr std::size_t shown = 160;
    out << "<text x=\"" << left << "\" y=\"46\" font-size=\"13\" fill=\"#c00\">not a valid plan: "
        << escape(problem.size() > shown ? problem.substr(0, shown) + "..." : problem) << "</text>\n";
  }

  // Buffers: one rectangle each (outlined while few), or above one_by_one_up_to the union of
  // the buffers in each pixel column (a 2-D difference array: O(buffers + pixels)), so
  // that a million buffers stay a readable picture and a small file.
  const bool aggregate = buffers.size() > one_by_one_up_to;
  if (!aggregate) {
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      const core::buffer& b = buffers[i];
      const double x = x_of(static_cast<double>(b.lower));
      const double w = std::max(0.5, x_of(static_cast<double>(b.upper)) - x);
      const double y = y_of(static_cast<double>(offsets[i] + b.bytes));
      const double h = std::max(0.5, y_of(static_cast<double>(offsets[i])) - y);
      const unsigned hue = static_cast<unsigned>((i * 137U) % 360U);
      out << "<rect class=\"buffer\" x=\"" << x << "\" y=\"" << y << "\" width=\"" << w
          << "\" height=\"" << h << "\" fill=\"hsl(" << hue << ",60%,65%)\"";
      if (buffers.size() <= outlined_up_to) out << " stroke=\"#333\" stroke-width=\"0.3\"";
      out << "><title>" << escape(b.id) << ": steps [" << b.lower << ", " << b.upper << "), offset "
          << offsets[i] << ", " << b.bytes << " bytes</title></rect>\n";
    }
  } else {
    const auto cols = static_cast<std::size_t>(plot_w);
    const auto rows = static_cast<std::size_t>(plot_h);
    std::vector<int> diff((cols + 1) * (rows + 1), 0);
    auto at = [&](std::size_t c, std::size_t r) -> int& { return diff[r * (cols + 1) + c]; };
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      const core::buffer& b = buffers[i];
      if (b.upper <= b.lower || b.bytes == 0) continue;
      auto col = [&](std::uint64_t t) {
        return std::min(cols, static_cast<std::size_t>(std::floor(x_of(static_cast<double>(t)) - left)));
      };
      auto row = [&](double bytes) {
        return std::min(rows, static_cast<std::size_t>(std::floor(y_of(bytes) - top)));
      };
      const std::size_t c0 = col(b.lower);
      const std::size_t c1 = std::max(c0 + 1, col(b.upper));
      const std::size_t r0 = row(static_cast<double>(offsets[i] + b.bytes));  // top edge
      const std::size_t r1 = std::max(r0 + 1, row(static_cast<double>(offsets[i])));
      at(std::min(c0, cols), r0) += 1;
      at(std::min(c1, cols), r0) -= 1;
      at(std::min(c0, cols), std::min(r1, rows)) -= 1;
      at(std::min(c1, cols), std::min(r1, rows)) += 1;
    }
    for (std::size_t r = 0; r <= rows; ++r) {  // prefix sums: coverage per pixel
      for (std::size_t c = 0; c <= cols; ++c) {
        int v = at(c, r);
        if (c > 0) v += at(c - 1, r);
        if (r > 0) v += at(c, r - 1);
        if (r > 0 && c > 0) v -= at(c - 1, r - 1);
        at(c, r) = v;
      }
    }
    out << "<g class=\"aggregate\" fill=\"hsl(210,45%,55%)\"><title>" << buffers.size()
        << " buffers, drawn as the union of those in each pixel column</title>\n";
    for (std::size_t c = 0; c < cols; ++c) {
      std::size_t r = 0;
      while (r < rows) {
        if (at(c, r) <= 0) {
          ++r;
          continue;
        }
        const std::size_t start = r;
        while (r < rows && at(c, r) > 0) ++r;
        out << "<rect x=\"" << left + static_cast<double>(c) << "\" y=\"" << top + static_cast<double>(start)
            << "\" width=\"1\" height=\"" << r - start << "\"/>\n";
      }
    }
    out << "</g>\n";
  }

  // Axes: time steps on x, bytes (binary units) on y, with ticks and titles.
  out << "<g stroke=\"#222\" stroke-width=\"1\">\n"
      << "<line x1=\"" << left << "\" y1=\"" << top + plot_h << "\" x2=\"" << left + plot_w << "\" y2=\""
      << top + plot_h << "\"/>\n"
      << "<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\"" << top + plot_h
      << "\"/>\n</g>\n<g font-size=\"12\" fill=\"#222\">\n";
  const double t_step = tick_step(span_t, 8, 10);
  for (double t = std::ceil(static_cast<double>(t0) / t_step) * t_step; t <= static_cast<double>(t1);
       t += t_step) {
    const double x = x_of(t);
    out << "<line class=\"xtick\" x1=\"" << x << "\" y1=\"" << top + plot_h << "\" x2=\"" << x
        << "\" y2=\"" << top + plot_h + 5 << "\" stroke=\"#222\"/>"
        << "<text x=\"" << x << "\" y=\"" << top + plot_h + 19 << "\" text-anchor=\"middle\">"
        << static_cast<std::uint64_t>(t) << "</text>\n";
  }
  const double y_step = detail::byte_tick_step(y_top, 6);
  for (double v = 0; v <= y_top * 1.0000001; v += y_step) {
    const double y = y_of(v);
    out << "<line class=\"ytick\" x1=\"" << left - 5 << "\" y1=\"" << y << "\" x2=\"" << left
        << "\" y2=\"" << y << "\" stroke=\"#222\"/>"
        << "<text x=\"" << left - 8 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">"
        << escape(human(v)) << "</text>\n";
  }
  out << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << height - 18
      << "\" text-anchor=\"middle\" font-size=\"13\">time step (a buffer lives over [first, last))</text>\n"
      << "<text transform=\"translate(20," << top + plot_h / 2
      << ") rotate(-90)\" text-anchor=\"middle\" font-size=\"13\">offset in the arena</text>\n</g>\n";

  // The lower bound and the arena, labelled at their right ends.
  const double lb_y = y_of(static_cast<double>(lower_bound));
  const double arena_y = y_of(static_cast<double>(arena_bytes));
  out << "<line class=\"lower-bound\" x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << lb_y
      << "\" y2=\"" << lb_y << "\" stroke=\"#c00\" stroke-width=\"1.5\" stroke-dasharray=\"6,4\"/>\n"
      << "<line class=\"arena\" x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << arena_y
      << "\" y2=\"" << arena_y << "\" stroke=\"black\" stroke-width=\"1.5\"/>\n"
      << "<g font-size=\"12\">\n"
      << "<text x=\"" << left + plot_w + 6 << "\" y=\"" << arena_y - 4 << "\">arena "
      << escape(human(static_cast<double>(arena_bytes))) << "</text>\n"
      << "<text x=\"" << left + plot_w + 6 << "\" y=\"" << lb_y + 14 << "\" fill=\"#c00\">lower bound "
      << escape(human(static_cast<double>(lower_bound))) << "</text>\n";

  // Legend.
  const double lx = left + plot_w + 20;
  const double ly = top + plot_h / 2;
  out << "<rect x=\"" << lx << "\" y=\"" << ly << "\" width=\"14\" height=\"10\" fill=\"hsl(210,45%,55%)\"/>"
      << "<text x=\"" << lx + 20 << "\" y=\"" << ly + 9 << "\">a buffer: lifetime x bytes</text>\n"
      << "<line x1=\"" << lx << "\" x2=\"" << lx + 14 << "\" y1=\"" << ly + 25 << "\" y2=\"" << ly + 25
      << "\" stroke=\"#c00\" stroke-dasharray=\"4,2\"/>"
      << "<text x=\"" << lx + 20 << "\" y=\"" << ly + 29 << "\">lower bound: most bytes</text>"
      << "<text x=\"" << lx + 20 << "\" y=\"" << ly + 43 << "\">alive at one time</text>\n"
      << "<line x1=\"" << lx << "\" x2=\"" << lx + 14 << "\" y1=\"" << ly + 60 << "\" y2=\"" << ly + 60
      << "\" stroke=\"black\"/>"
      << "<text x=\"" << lx + 20 << "\" y=\"" << ly + 64 << "\">arena: the plan's size</text>\n";
  if (aggregate) {
    out << "<text x=\"" << lx << "\" y=\"" << ly + 88 << "\">more than " << one_by_one_up_to
        << " buffers:</text><text x=\"" << lx << "\" y=\"" << ly + 102
        << "\">drawn as their union</text>\n";
  }
  out << "</g>\n</svg>\n";
  return problem;
}

std::string write_plan_svg(const std::string& path, std::span<const core::buffer> buffers,
                           std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                           std::uint64_t lower_bound, const known_problem& validated) {
  std::string problem;
  detail::write_file(path, [&](std::ostream& out) {
    problem = write_plan_svg(out, buffers, offsets, arena_bytes, lower_bound, validated);
  });
  return problem;
}

}  // namespace tensormem::trace
