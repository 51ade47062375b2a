#pragma once
// Waits that answer Ctrl-C: the GIL released in short slices, signals handled between them.

#include <pybind11/pybind11.h>

#include <chrono>
#include <system_error>

namespace tensormem::python {

/// How often a wait looks for signals: Ctrl-C interrupts it within this.
inline constexpr std::chrono::milliseconds signal_check_interval{50};

/// Waits for `attempt(deadline)` to return true, in slices of signal_check_interval with the
/// GIL released, handling signals between slices (on the main thread): Ctrl-C raises
/// KeyboardInterrupt, and so does whatever a Python signal handler raises. After the signals,
/// `between()` runs with the GIL (the caller's own Python calls); what it throws ends the
/// wait too. `attempt` must leave things as they were when it returns false, so that the
/// wait can be taken up again.
template <class Attempt, class Between>
void wait_answering_signals(Attempt attempt, Between between) {
  for (;;) {
    bool done = false;
    {
      pybind11::gil_scoped_release release;
      done = attempt(std::chrono::steady_clock::now() + signal_check_interval);
    }
    if (done) return;
    if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
    between();
  }
}

template <class Attempt>
void wait_answering_signals(Attempt attempt) {
  wait_answering_signals(attempt, [] {});
}

/// Returns `call()`, made with the GIL released, where a signal may interrupt the open() of a
/// pipe that waits for its other end (std::system_error EINTR; a stream resumes its own
/// interrupted reads and writes). As Python's own calls do (PEP 475), the signal handlers then
/// run and the call is made again, unless a handler raised: Ctrl-C is a KeyboardInterrupt,
/// not an InterruptedError. `call` must change nothing when it fails so.
template <class Call>
auto call_resuming_after_signals(Call call) {
  for (;;) {
    try {
      pybind11::gil_scoped_release release;
      return call();
    } catch (const std::system_error& e) {
      if (e.code() != std::errc::interrupted) throw;
    }
    if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
  }
}

}  // namespace tensormem::python
