#pragma once
// A child process under a memory-lock limit it cannot bypass, as a user without
// CAP_IPC_LOCK runs.

#include <grp.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <utility>

namespace tensormem::memory::testing {

/// Runs `body` in a child process that cannot bypass RLIMIT_MEMLOCK: the limit is lowered to
/// `limit_bytes` (1 MiB by default) and, when running as root, the child becomes user nobody
/// (dropping CAP_IPC_LOCK). The child's exit code is body's result; its message comes back
/// through a pipe.
inline std::pair<int, std::string> in_limited_child(int (*body)(std::string&), rlim_t limit_bytes = rlim_t{1} << 20) {
  int fds[2];
  if (pipe(fds) != 0) return {-1, "pipe failed"};
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    std::string message;
    int code = 0;
    rlimit limit{limit_bytes, limit_bytes};
    if (setrlimit(RLIMIT_MEMLOCK, &limit) != 0) {
      message = "setrlimit failed";
      code = 90;
    } else if (geteuid() == 0 && (setgroups(0, nullptr) != 0 || setgid(65534) != 0 ||
                                  setuid(65534) != 0)) {
      message = "could not drop root";
      code = 91;
    } else {
      code = body(message);
    }
    if (write(fds[1], message.data(), message.size()) < 0) code = 92;
    _exit(code);
  }
  close(fds[1]);
  std::string message;
  char buffer[512];
  ssize_t n = 0;
  while ((n = read(fds[0], buffer, sizeof buffer)) > 0) message.append(buffer, static_cast<std::size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 99, message};
}

}  // namespace tensormem::memory::testing
