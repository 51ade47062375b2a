#include "svg_support.hpp"

#include <cstdio>
#include <string_view>

#include "tensormem/trace/trace_io.hpp"

namespace tensormem::trace::detail {

std::string escape(const std::string& s) {
  std::string out;
  // XML takes neither control characters nor bytes that are not UTF-8: each such byte is
  // drawn as U+FFFD, the replacement character.
  for_each_text_run(s, [&](std::string_view run) {
    for (const char c : run) {
      switch (c) {
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '&': out += "&amp;"; break;
        case '"': out += "&quot;"; break;
        default: out += c;
      }
    }
  }, [&](unsigned char) { out += "\xEF\xBF\xBD"; });
  return out;
}

std::string human(double bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  char text[32];
  std::snprintf(text, sizeof text, bytes >= 100 || u == 0 ? "%.0f %s" : "%.3g %s", bytes, units[u]);
  return text;
}

double tick_step(double range, double ticks, double base) {
  if (range <= 0) return 1;
  const double raw = range / ticks;
  double power = 1;
  while (power * base <= raw) power *= base;
  while (power > raw) power /= base;
  for (const double m : {1.0, 2.0, 5.0, 10.0}) {
    if (power * m >= raw) return power * m;
  }
  return power * base;
}

double byte_tick_step(double top, double ticks) {
  double unit = 1;
  while (unit * 1024 <= top && unit < 1152921504606846976.0) unit *= 1024;
  double step = tick_step(top / unit, ticks, 10);
  if (step < 1) {
    step = 1;
    while (step / 2 >= top / unit / ticks) step /= 2;
  }
  return step * unit;
}

}  // namespace tensormem::trace::detail
