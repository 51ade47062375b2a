#include "tensormem/trace/plan_svg.hpp"

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <ostream>
#include <system_error>

namespace tensormem::trace {

namespace {

std::string escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace

void write_plan_svg(std::ostream& out, std::span<const core::buffer> buffers,
                    std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                    std::uint64_t lower_bound) {
  constexpr double width = 1200;
  constexpr double height = 700;
  constexpr double margin = 40;
  std::uint64_t t0 = UINT64_MAX;
  std::uint64_t t1 = 0;
  for (const core::buffer& b : buffers) {
    t0 = std::min(t0, b.lower);
    t1 = std::max(t1, b.upper);
  }
  if (buffers.empty()) t0 = t1 = 0;
  const double span_t = t1 > t0 ? static_cast<double>(t1 - t0) : 1.0;
  const double top = static_cast<double>(std::max({arena_bytes, lower_bound, std::uint64_t{1}}));
  auto x_of = [&](std::uint64_t t) {
    return margin + (width - 2 * margin) * static_cast<double>(t - t0) / span_t;
  };
  auto y_of = [&](double bytes) { return height - margin - (height - 2 * margin) * bytes / top; };

  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\""
      << height << "\" viewBox=\"0 0 " << width << ' ' << height << "\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << margin << "\" y=\"24\" font-family=\"sans-serif\" font-size=\"14\">"
      << buffers.size() << " buffers, arena " << arena_bytes << " bytes, lower bound "
      << lower_bound << " bytes (time on x, offset on y)</text>\n";
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const core::buffer& b = buffers[i];
    const double x = x_of(b.lower);
    const double w = std::max(0.5, x_of(b.upper) - x);
    const double y = y_of(static_cast<double>(offsets[i] + b.bytes));
    const double h = std::max(0.5, y_of(static_cast<double>(offsets[i])) - y);
    const unsigned hue = static_cast<unsigned>((i * 137U) % 360U);
    out << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << h
        << "\" fill=\"hsl(" << hue << ",60%,65%)\" stroke=\"#333\" stroke-width=\"0.3\"><title>"
        << escape(b.id) << ": [" << b.lower << ',' << b.upper << ") offset " << offsets[i]
        << " size " << b.bytes << "</title></rect>\n";
  }
  const double lb_y = y_of(static_cast<double>(lower_bound));
  const double arena_y = y_of(static_cast<double>(arena_bytes));
  out << "<line x1=\"" << margin << "\" x2=\"" << width - margin << "\" y1=\"" << lb_y
      << "\" y2=\"" << lb_y << "\" stroke=\"red\" stroke-dasharray=\"6,4\"/>\n"
      << "<line x1=\"" << margin << "\" x2=\"" << width - margin << "\" y1=\"" << arena_y
      << "\" y2=\"" << arena_y << "\" stroke=\"black\"/>\n"
      << "</svg>\n";
}

void write_plan_svg(const std::string& path, std::span<const core::buffer> buffers,
                    std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                    std::uint64_t lower_bound) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw std::system_error(errno, std::generic_category(), "cannot write " + path);
  write_plan_svg(out, buffers, offsets, arena_bytes, lower_bound);
  out.flush();
  if (!out) throw std::system_error(errno, std::generic_category(), "cannot write " + path);
}

}  // namespace tensormem::trace
