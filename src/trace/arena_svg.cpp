#include "tensormem/trace/arena_svg.hpp"

#include <algorithm>
#include <functional>
#include <ostream>
#include <stdexcept>
#include <string>

#include "svg_support.hpp"
#include "write_file.hpp"

namespace tensormem::trace {

using detail::escape;
using detail::human;

arena_snapshot snapshot(const arena::contiguous_arena& arena, std::string label,
                        const std::function<std::string(std::uint64_t)>& name_of) {
  arena_snapshot s{std::move(label), {}};
  const std::uint64_t alignment = arena.options().alignment;
  for (const arena::tensor_block& b : arena.blocks()) {
    // What the arena reserves: the size rounded up to its alignment (within its capacity).
    s.blocks.push_back({name_of ? name_of(b.id) : std::to_string(b.id), b.offset, b.bytes, (b.bytes + alignment - 1) / alignment * alignment});
  }
  return s;
}

void write_arena_svg(std::ostream& out, std::span<const arena_snapshot> snapshots, std::uint64_t capacity) {
  for (const arena_snapshot& s : snapshots) {
    for (const arena_block& b : s.blocks) {
      if (b.offset > capacity || b.reserved > capacity - b.offset || b.bytes > b.reserved) {
        throw std::invalid_argument("arena picture: tensor '" + b.name + "' at " + std::to_string(b.offset) +
                                    " (" + std::to_string(b.reserved) + " bytes reserved) lies outside " +
                                    std::to_string(capacity) + " bytes");
      }
    }
  }
  constexpr double width = 1280;
  constexpr double left = 20;
  constexpr double right = 20;
  constexpr double top = 50;
  constexpr double row_h = 70;  // label line, bar, gap
  constexpr double bar_h = 34;
  const double plot_w = width - left - right;
  const double height = top + row_h * static_cast<double>(snapshots.size()) + 50;
  const double cap = static_cast<double>(std::max<std::uint64_t>(capacity, 1));
  auto x_of = [&](double bytes) { return left + plot_w * bytes / cap; };

  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << width << ' ' << height << "\" font-family=\"sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << left << "\" y=\"26\" font-size=\"16\">contiguous arena of "
      << escape(human(cap)) << " (" << capacity << " bytes): tensors by offset, free space white</text>\n";
  double y = top;
  for (const arena_snapshot& s : snapshots) {
    std::uint64_t used = 0;
    std::uint64_t largest_hole = 0;
    std::uint64_t cursor = 0;
    std::vector<const arena_block*> by_offset;
    for (const arena_block& b : s.blocks) by_offset.push_back(&b);
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
    for (const arena_block* b : by_offset) {
      used += b->reserved;
      if (b->offset > cursor) largest_hole = std::max(largest_hole, b->offset - cursor);
      cursor = std::max(cursor, b->offset + b->reserved);
    }
    largest_hole = std::max(largest_hole, capacity - std::min(cursor, capacity));
    out << "<text class=\"row-label\" x=\"" << left << "\" y=\"" << y + 14 << "\" font-size=\"13\">"
        << escape(s.label) << ": " << s.blocks.size() << " tensors, used " << escape(human(static_cast<double>(used)))
        << ", free " << escape(human(static_cast<double>(capacity - used))) << ", largest hole "
        << escape(human(static_cast<double>(largest_hole))) << "</text>\n"
        << "<rect x=\"" << left << "\" y=\"" << y + 20 << "\" width=\"" << plot_w << "\" height=\"" << bar_h
        << "\" fill=\"white\" stroke=\"#444\"/>\n";
    for (const arena_block* b : by_offset) {
      const auto hue = static_cast<unsigned>((std::hash<std::string>{}(b->name) * 137U) % 360U);
      const double x = x_of(static_cast<double>(b->offset));
      const double w_bytes = std::max(0.5, x_of(static_cast<double>(b->offset + b->bytes)) - x);
      const double w_reserved = std::max(0.5, x_of(static_cast<double>(b->offset + b->reserved)) - x);
      out << "<g class=\"tensor\"><title>" << escape(b->name) << ": offset " << b->offset << ", " << b->bytes
          << " bytes (" << b->reserved << " reserved)</title>";
      if (w_reserved > w_bytes) {
        out << "<rect x=\"" << x << "\" y=\"" << y + 20 << "\" width=\"" << w_reserved << "\" height=\"" << bar_h
            << "\" fill=\"hsl(" << hue << ",40%,85%)\"/>";
      }
      out << "<rect x=\"" << x << "\" y=\"" << y + 20 << "\" width=\"" << w_bytes << "\" height=\"" << bar_h
          << "\" fill=\"hsl(" << hue << ",60%,62%)\" stroke=\"#333\" stroke-width=\"0.3\"/>";
      // The name inside the rectangle when it fits (about 7 px a character).
      if (w_bytes > 7.0 * static_cast<double>(b->name.size()) + 6) {
        out << "<text x=\"" << x + w_bytes / 2 << "\" y=\"" << y + 20 + bar_h / 2 + 4
            << "\" text-anchor=\"middle\" font-size=\"11\">" << escape(b->name) << "</text>";
      }
      out << "</g>\n";
    }
    y += row_h;
  }
  // Offsets axis under the last bar.
  out << "<g font-size=\"12\" fill=\"#222\">\n<line x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << y
      << "\" y2=\"" << y << "\" stroke=\"#222\"/>\n";
  const double step = detail::byte_tick_step(cap, 8);
  for (double v = 0; v <= cap * 1.0000001; v += step) {
    out << "<line class=\"xtick\" x1=\"" << x_of(v) << "\" x2=\"" << x_of(v) << "\" y1=\"" << y << "\" y2=\""
        << y + 5 << "\" stroke=\"#222\"/><text x=\"" << x_of(v) << "\" y=\"" << y + 18
        << "\" text-anchor=\"middle\">" << escape(human(v)) << "</text>\n";
  }
  out << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << y + 38
      << "\" text-anchor=\"middle\" font-size=\"13\">offset in the arena (pale: alignment padding)</text>\n</g>\n</svg>\n";
}

void write_arena_svg(const std::string& path, std::span<const arena_snapshot> snapshots, std::uint64_t capacity) {
  detail::write_file(path, [&](std::ostream& out) { write_arena_svg(out, snapshots, capacity); });
}

}  // namespace tensormem::trace
