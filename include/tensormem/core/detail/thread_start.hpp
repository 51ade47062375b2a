#pragma once
// What every thread the library starts does first.

#include <exception>
#include <string>
#include <system_error>

namespace tensormem::core::detail {

/// Makes the calling thread's exception-handling state now, while there is memory for it.
/// The C++ runtime makes it at a thread's first throw, and where the runtime was loaded after
/// the program started (a Python extension's libstdc++) that is an allocation of thread-local
/// storage: when it fails (memory exhausted, RLIMIT_AS), the C library ends the process
/// ("cannot allocate memory for thread-local data") instead of letting the std::bad_alloc be
/// thrown and handled. The library's threads throw and catch exactly then.
/// (std::uncaught_exceptions reads that state; it is declared pure, so its result is kept.)
inline void prepare_thread_for_exceptions() noexcept {
  [[maybe_unused]] const volatile int in_flight = std::uncaught_exceptions();
}

/// Rethrows the exception being handled, naming `who` and the likely cause where it is the
/// std::system_error std::thread throws when the system will not start a thread (EAGAIN).
[[noreturn]] inline void rethrow_naming_thread_start(const char* who) {
  try {
    throw;
  } catch (const std::system_error& e) {
    throw std::system_error(e.code(), std::string(who) + ": cannot start a thread (a limit on threads or "
                                                         "processes, or no address space left for its stack)");
  }
}

}  // namespace tensormem::core::detail
