#pragma once
// Runs a test's body in a child process made by fork(), as a user of the library would fork
// (a data-loader worker, a multiprocessing child), and checks what the child reports.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>

#include "tensormem/io/fork_guard.hpp"

namespace tensormem::io::testing {

#if defined(__SANITIZE_ADDRESS__)
/// True when the child `pid` is one thread asleep in a system call made from inside the
/// AddressSanitizer runtime. GCC 12's runtime takes no lock of its allocator across fork(), so a
/// child forked while another thread of the parent held one waits at its first allocation that
/// needs it, and a lone thread in an untimed futex is never woken. The pc of the sleeping call
/// (the last field of /proc/PID/syscall) is looked up in /proc/PID/maps.
inline bool asleep_in_sanitizer_runtime(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid);
  std::ifstream status(dir + "/status");
  bool sleeping = false;
  bool one_thread = false;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("State:", 0) == 0) sleeping = line.find("S (sleeping)") != std::string::npos;
    if (line.rfind("Threads:", 0) == 0) one_thread = std::strtoul(line.c_str() + 8, nullptr, 10) == 1;
  }
  if (!sleeping || !one_thread) return false;
  std::ifstream syscall(dir + "/syscall");
  std::string field;
  std::string last;
  while (syscall >> field) last = field;
  if (last.rfind("0x", 0) != 0) return false;  // "running", or not in a system call
  const std::uintptr_t pc = std::strtoull(last.c_str(), nullptr, 16);
  std::ifstream maps(dir + "/maps");
  for (std::string line; std::getline(maps, line);) {
    char* end = nullptr;
    const std::uintptr_t low = std::strtoull(line.c_str(), &end, 16);
    const std::uintptr_t high = std::strtoull(end + 1, nullptr, 16);
    if (pc >= low && pc < high) return line.find("libasan") != std::string::npos;
  }
  return false;
}
#endif

/// Runs `body` in a forked child, which ends by _exit (no exit handlers, no leak check of
/// what the parent made) with body's result. Returns that result (0: the child's checks
/// passed), 97 for an exception out of body, or 128 + the signal that ended the child:
/// SIGALRM (142) when it ran past `seconds`, a hang in the child.
///
/// Under AddressSanitizer a child found deadlocked inside the sanitizer's allocator (above) for
/// half a second is killed and the fork made again, up to 8 times, each said on stderr; 124 when
/// every child deadlocked there. A hang anywhere else still ends with the alarm.
template <class Body>
int in_forked_child(Body&& body, unsigned seconds = 60) {
  constexpr int forks = 8;
  for (int attempt = 1; attempt <= forks; ++attempt) {
    std::fflush(nullptr);  // nothing buffered is written twice
    const pid_t pid = fork();
    if (pid < 0) return 125;
    if (pid == 0) {
      ::signal(SIGALRM, SIG_DFL);
      ::alarm(seconds);
      int rc = 97;
      try {
        rc = body();
      } catch (...) {
      }
      _exit(rc);
    }
    int status = 0;
    pid_t waited = 0;
#if defined(__SANITIZE_ADDRESS__)
    int asleep = 0;  // consecutive looks, 5 ms apart, that found it asleep in the runtime
    while ((waited = waitpid(pid, &status, WNOHANG)) == 0 && asleep < 100) {
      ::usleep(5'000);
      asleep = asleep_in_sanitizer_runtime(pid) ? asleep + 1 : 0;
    }
    if (waited == 0) {
      ::kill(pid, SIGKILL);
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      std::fprintf(stderr, "in_forked_child: fork %d of %d: the child deadlocked inside AddressSanitizer's allocator "
                   "(a lock another thread held at the fork); forking again\n", attempt, forks);
      continue;
    }
#endif
    while (waited != pid) {
      waited = waitpid(pid, &status, 0);
      if (waited < 0 && errno != EINTR) return 125;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  return 124;
}

/// 0 when `call` throws forked_child_error whose message names `what` as made by another
/// process; 1 for another message, 2 for another exception, 3 when it returns.
template <class Call>
int refused_in_child(const char* what, Call&& call) {
  try {
    call();
  } catch (const forked_child_error& e) {
    const std::string m = e.what();
    return m.rfind(std::string(what) + " was made by process ", 0) == 0 &&
                   m.find("a child forked from it") != std::string::npos
               ? 0
               : 1;
  } catch (...) {
    return 2;
  }
  return 3;
}

}  // namespace tensormem::io::testing
