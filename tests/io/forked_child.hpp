#pragma once
// Runs a test's body in a child process made by fork(), as a user of the library would fork
// (a data-loader worker, a multiprocessing child), and checks what the child reports.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <string>

#include "tensormem/io/fork_guard.hpp"

namespace tensormem::io::testing {

/// Runs `body` in a forked child, which ends by _exit (no exit handlers, no leak check of
/// what the parent made) with body's result. Returns that result (0: the child's checks
/// passed), 97 for an exception out of body, or 128 + the signal that ended the child:
/// SIGALRM (142) when it ran past `seconds`, a hang in the child.
template <class Body>
int in_forked_child(Body&& body, unsigned seconds = 60) {
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
  while (waitpid(pid, &status, 0) < 0) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
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
