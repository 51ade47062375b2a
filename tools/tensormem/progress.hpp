#pragma once
// A progress line on the terminal for commands that run longer than a moment.

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

#include "tensormem/core/planner.hpp"

namespace tensormem::cli {

/// Set by the top-level `--quiet` flag: no progress line whatever stderr is.
bool& quiet_flag();

/// One line on stderr, rewritten in place (carriage return). Shown only when stderr is a
/// terminal and `--quiet` was not given, so pipes, files and CI logs get nothing; updates at
/// most ten times a second (the first and forced ones at once); the line is erased by
/// `clear()` or the destructor, so the report that follows starts on a clean line.
class progress_line {
 public:
  progress_line();
  ~progress_line();
  progress_line(const progress_line&) = delete;
  progress_line& operator=(const progress_line&) = delete;

  bool enabled() const noexcept { return enabled_; }
  /// Shows `text` (cut to 100 columns) unless the last update was under 0.1 s ago.
  void show(const std::string& text, bool force = false);
  void clear();

 private:
  bool enabled_;
  std::size_t width_ = 0;  // columns of the line on screen, 0 when none
  std::chrono::steady_clock::time_point last_{};
};

/// A planner progress callback that shows the phase, the time and the best plan so far.
std::function<void(const core::plan_progress&)> plan_progress_printer(progress_line& line,
                                                                      std::size_t buffers);

}  // namespace tensormem::cli
