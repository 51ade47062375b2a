#pragma once
// The plan command's handling of SIGINT and SIGTERM (tools/tensormem/cmd_plan.cpp).

#include <array>
#include <atomic>
#include <csignal>
#include <cstddef>

namespace tensormem::cli {

// While the planner runs, SIGINT (Ctrl-C) and SIGTERM stop its search instead of the
// process: the best plan found by then is validated, written and printed as usual, and the
// command exits with 128 + the signal's number. The handler is reset by its first signal, so a
// second one ends the process at once. A signal the tool was started with ignored (a
// background job's SIGINT) stays ignored; the old handlers are back once the plan returns.
class stop_on_signals {
 public:
  stop_on_signals() {
    stop_.store(false);
    signal_ = 0;
    for (std::size_t k = 0; k < signals.size(); ++k) {
      struct sigaction now {};
      if (sigaction(signals[k], nullptr, &now) != 0 || now.sa_handler == SIG_IGN) continue;
      now = {};
      now.sa_handler = &on_signal;
      sigemptyset(&now.sa_mask);
      now.sa_flags = static_cast<int>(SA_RESETHAND | SA_RESTART);
      installed_[k] = sigaction(signals[k], &now, &old_[k]) == 0;
    }
  }
  ~stop_on_signals() {
    for (std::size_t k = 0; k < signals.size(); ++k) {
      if (installed_[k]) sigaction(signals[k], &old_[k], nullptr);
    }
  }
  stop_on_signals(const stop_on_signals&) = delete;
  stop_on_signals& operator=(const stop_on_signals&) = delete;
  static const std::atomic<bool>* flag() noexcept { return &stop_; }
  /// The signal that stopped the plan, 0 if none came.
  static int signal() noexcept { return signal_; }

 private:
  static_assert(std::atomic<bool>::is_always_lock_free, "set from a signal handler");
  static void on_signal(int sig) {
    signal_ = sig;
    stop_.store(true);
  }
  static constexpr std::array<int, 2> signals = {SIGINT, SIGTERM};
  static inline std::atomic<bool> stop_{false};
  static inline volatile std::sig_atomic_t signal_ = 0;
  std::array<struct sigaction, 2> old_{};
  std::array<bool, 2> installed_{};
};

}  // namespace tensormem::cli
