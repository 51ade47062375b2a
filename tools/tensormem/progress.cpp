#include "progress.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

#include "report.hpp"

namespace tensormem::cli {

bool& quiet_flag() {
  static bool quiet = false;
  return quiet;
}

progress_line::progress_line() : enabled_(!quiet_flag() && isatty(STDERR_FILENO) != 0) {}

progress_line::~progress_line() { clear(); }

void progress_line::show(const std::string& text, bool force) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (!force && width_ > 0 && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  const std::string line = text.substr(0, 100);
  // Pad over the previous text when the new one is shorter.
  std::fprintf(stderr, "\r%-*s", static_cast<int>(std::max(line.size(), width_)), line.c_str());
  std::fflush(stderr);
  width_ = line.size();
}

void progress_line::clear() {
  if (!enabled_ || width_ == 0) return;
  std::fprintf(stderr, "\r%*s\r", static_cast<int>(width_), "");
  std::fflush(stderr);
  width_ = 0;
}

std::function<void(const core::plan_progress&)> plan_progress_printer(progress_line& line,
                                                                      std::size_t buffers) {
  return [&line, buffers](const core::plan_progress& p) {
    const std::string best = p.best_arena_bytes == 0
                                 ? std::string("no plan yet")
                                 : fmt::format("best {:.4f} x lower bound", ratio_of(p.best_arena_bytes, p.lower_bound));
    line.show(fmt::format("plan: {} buffers, {} {:.1f} s, {}", buffers, p.phase, p.seconds, best));
  };
}

}  // namespace tensormem::cli
