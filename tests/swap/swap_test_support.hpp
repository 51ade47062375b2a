#pragma once
// Helpers shared by the swapper and file I/O tests: a scratch directory removed with its
// contents, reproducible tensor bytes, an engine wrapper, and a full disk or a file system
// without unnamed files in a child process.

#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tensormem/io/io_engine.hpp"
#include "tensormem/io/path_argument.hpp"

namespace tensormem::swap::testing {

/// A fresh directory under the system's temporary directory; `path` is empty when it could
/// not be made.
struct scratch_dir {
  std::filesystem::path path;
  scratch_dir() {
    std::string templ = (std::filesystem::temp_directory_path() / "tensormem-swaptest-XXXXXX").string();
    if (mkdtemp(templ.data()) != nullptr) path = templ;
  }
  /// With these permissions (std::filesystem::perms::all: for a child running as another user).
  explicit scratch_dir(std::filesystem::perms perms) : scratch_dir() {
    if (!path.empty()) std::filesystem::permissions(path, perms);
  }
  ~scratch_dir() {
    if (!path.empty()) std::filesystem::remove_all(path);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
};

/// The temporary files a replacement writes first (`<file>.tensormem-tmp.<pid>.<n>`) left in
/// `dir`, by name.
inline std::vector<std::string> temporary_files_in(const std::filesystem::path& dir) {
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.find(".tensormem-tmp.") != std::string::npos) left.push_back(name);
  }
  return left;
}

/// The next `count` names a replacement file beside `target` will try, learned from one made
/// (and removed) the same way.
inline std::vector<std::string> next_temporary_names(const std::string& target, int count) {
  std::string probe;
  const int fd = io::create_temporary_beside(target, probe, 0600);
  EXPECT_GE(fd, 0) << probe;
  EXPECT_EQ(io::name_temporary(fd, target, probe), 0) << probe;  // (an unnamed file is named now)
  if (fd >= 0) ::close(fd);
  std::filesystem::remove(probe);
  const std::size_t dot = probe.rfind('.') + 1;
  const unsigned long made = std::stoul(probe.substr(dot));
  std::vector<std::string> names;
  for (int k = 1; k <= count; ++k) names.push_back(probe.substr(0, dot) + std::to_string(made + static_cast<unsigned long>(k)));
  return names;
}

/// While it lives, replacement files are named from the start, as where the file system has
/// no O_TMPFILE (`io::detail::allow_unnamed_temporaries`).
class named_temporaries {
 public:
  named_temporaries() : was_(io::detail::allow_unnamed_temporaries(false)) {}
  explicit named_temporaries(bool named) : was_(io::detail::allow_unnamed_temporaries(!named)) {}
  ~named_temporaries() { io::detail::allow_unnamed_temporaries(was_); }
  named_temporaries(const named_temporaries&) = delete;
  named_temporaries& operator=(const named_temporaries&) = delete;

 private:
  bool was_;
};

/// `n` pseudo-random bytes determined by `seed`.
inline std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

/// 4096-aligned memory, as pinned tensors are.
struct aligned_buffer {
  std::byte* data;
  std::size_t size;
  explicit aligned_buffer(std::size_t n)
      : data(static_cast<std::byte*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))), size(n) {}
  ~aligned_buffer() { std::free(data); }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
};

/// A file's bytes (none where it cannot be read).
inline std::vector<std::byte> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  if (!c.empty()) std::memcpy(out.data(), c.data(), c.size());
  return out;
}

/// A gate that engines wait at: closed until `open`.
class gate {
 public:
  void open() {
    {
      const std::lock_guard lock(mutex_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void pass() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [this] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = false;
};

/// For tests of code that must not block on something: unless destroyed within `limit`, it
/// names `what` and aborts the process, so that such a test fails instead of hanging until the
/// test runner's own limit.
class hang_guard {
 public:
  hang_guard(std::string what, std::chrono::seconds limit)
      : what_(std::move(what)), thread_([this, limit] {
          std::unique_lock lock(mutex_);
          if (!cv_.wait_for(lock, limit, [this] { return done_; })) {
            std::fprintf(stderr, "FAILED: still blocked after %lld s: %s\n", static_cast<long long>(limit.count()),
                         what_.c_str());
            std::abort();
          }
        }) {}
  ~hang_guard() {
    {
      const std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  hang_guard(const hang_guard&) = delete;
  hang_guard& operator=(const hang_guard&) = delete;

 private:
  std::string what_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

/// An engine that hands everything to another; tests override what they observe or bend.
class forwarding_engine : public io::io_engine {
 public:
  explicit forwarding_engine(std::unique_ptr<io::io_engine> inner) : inner_(std::move(inner)) {}
  void submit(std::span<const io::io_request> requests) override { inner_->submit(requests); }
  std::vector<io::io_completion> wait(std::size_t min_completions) override { return inner_->wait(min_completions); }
  std::size_t outstanding() const noexcept override { return inner_->outstanding(); }
  io::engine_kind kind() const noexcept override { return inner_->kind(); }
  unsigned queue_depth() const noexcept override { return inner_->queue_depth(); }

 protected:
  std::unique_ptr<io::io_engine> inner_;
};

/// Runs `body` in a child process with a tmpfs of `size` (mount option, e.g. "size=4m")
/// mounted over `dir` in a private mount namespace (root only), so that a full disk can be
/// tested. Returns 0 when `body` returned true, 1 when false, 77 when no tmpfs could be
/// mounted here (the caller skips). Call it through EXPECT_FULL_DISK_CHILD below.
template <class Body>
int in_small_tmpfs(const std::filesystem::path& dir, const char* size, Body body) {
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    if (unshare(CLONE_NEWNS) != 0 || mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        mount("tmpfs", dir.c_str(), "tmpfs", 0, size) != 0) {
      _exit(77);
    }
    const bool ok = body();
    umount(dir.c_str());
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

/// An engine whose first submission waits at a gate, having said it got there.
class held_submit_engine final : public forwarding_engine {
 public:
  held_submit_engine(std::unique_ptr<io::io_engine> inner, std::shared_ptr<gate> arrived,
                     std::shared_ptr<gate> go)
      : forwarding_engine(std::move(inner)), arrived_(std::move(arrived)), go_(std::move(go)) {}
  void submit(std::span<const io::io_request> requests) override {
    if (first_) {
      first_ = false;
      arrived_->open();
      go_->pass();
    }
    inner_->submit(requests);
  }

 private:
  std::shared_ptr<gate> arrived_;
  std::shared_ptr<gate> go_;
  bool first_ = true;
};

/// The system call convention seccomp filters here are written for (0: none for this machine).
#if defined(__x86_64__)
inline constexpr std::uint32_t native_audit_arch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
inline constexpr std::uint32_t native_audit_arch = AUDIT_ARCH_AARCH64;
#else
inline constexpr std::uint32_t native_audit_arch = 0;
#endif

/// Runs `body` in a child process under the seccomp filter `program` (in every thread the
/// child starts afterwards). `works` runs first under the filter and says whether it does what
/// it is meant to. Returns 0 when `body` returned true, 1 when false, 77 when the filter could
/// not be installed or does not work here (the caller skips).
template <class Works, class Body>
int under_seccomp_filter(std::span<sock_filter> program, Works works, Body body) {
  const sock_fprog filter{static_cast<unsigned short>(program.size()), program.data()};
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &filter) != 0 ||
        !works()) {
      _exit(77);
    }
    _exit(body() ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

/// Runs `body` in a child process where each system call of `failing` (number, errno) fails
/// with its errno (a seccomp filter), in its every thread started after the filter (a
/// swapper's, made in `body`). Returns 0 when `body` returned true, 1 when false, 77 when no
/// filter could be installed here (the caller skips).
template <class Body>
int with_failing_syscalls(const std::vector<std::pair<long, int>>& failing, Body body) {
  constexpr std::uint32_t arch = native_audit_arch;
  if (arch == 0) return 77;
  std::vector<sock_filter> program = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, arch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
  };
  for (const auto& [nr, error] : failing) {
    program.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<std::uint32_t>(nr), 0, 1));
    program.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | static_cast<std::uint32_t>(error)));
  }
  program.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  return under_seccomp_filter(program, [] { return true; }, body);
}

/// `with_failing_syscalls` for the one system call `nr`, failing with `error`.
template <class Body>
int with_failing_syscall(long nr, int error, Body body) {
  return with_failing_syscalls({{nr, error}}, body);
}

/// Runs `body` in a child process where every open with O_TMPFILE fails with `refusal`:
/// EOPNOTSUPP, as on a file system that has no unnamed files, or EISDIR, as on a kernel that
/// does not know the flag (a seccomp filter on open and openat). Returns 0 when `body`
/// returned true, 1 when false, 77 when the filter could not be installed here (the caller
/// skips).
template <class Body>
int without_unnamed_files(const std::filesystem::path& dir, Body body, int refusal = EOPNOTSUPP) {
  constexpr std::uint32_t arch = native_audit_arch;
  if (arch == 0) return 77;
  constexpr std::uint32_t tmpfile_bit = 020000000;  // the kernel's __O_TMPFILE
  static_assert((O_TMPFILE & tmpfile_bit) != 0);
  const auto arg_low = [](unsigned i) { return static_cast<std::uint32_t>(offsetof(seccomp_data, args) + 8 * i); };
  sock_filter program[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, arch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_openat, 0, 2),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, arg_low(2)),  // openat's flags (the low half)
      BPF_JUMP(BPF_JMP | BPF_JA, 2, 0, 0),
#if defined(SYS_open)
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_open, 0, 3),
#else
      BPF_JUMP(BPF_JMP | BPF_JA, 3, 0, 0),
#endif
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, arg_low(1)),  // open's flags
      BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, tmpfile_bit, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | static_cast<std::uint32_t>(refusal)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  // The filter works: an unnamed file is refused as such a file system refuses it.
  return under_seccomp_filter(program, [&] {
    const int probe = open(dir.c_str(), O_TMPFILE | O_RDWR, 0600);
    return probe < 0 && errno == refusal;
  }, body);
}

/// Tasks (threads) whose real user is `uid`, from /proc.
inline std::size_t tasks_of_user(uid_t uid) {
  std::size_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream status(entry.path() / "status");
    std::string line;
    long real = -1;
    std::size_t threads = 0;
    while (std::getline(status, line)) {
      if (line.starts_with("Uid:")) real = std::stol(line.substr(4));
      if (line.starts_with("Threads:")) threads = std::stoul(line.substr(8));
    }
    if (real == static_cast<long>(uid)) n += threads;
  }
  return n;
}

/// Runs `body` in a child process that may start only `threads` more threads. RLIMIT_NPROC
/// counts every task of its user and root ignores it, so a child of root drops root first,
/// to a user id of its own (no account, no other task: one shared with other processes, such
/// as nobody's, let a task of theirs that ended meanwhile leave room for one more thread).
/// Returns body's result (0 for success), 99 when the child died (an exception escaping a
/// thread's owner, std::terminate), 98 when it still ran after 60 s (it is killed), 77 when
/// it could not set itself up.
template <class Body>
int with_thread_limit(std::size_t threads, Body body) {
  const auto alone = static_cast<uid_t>(1'500'000'000U + static_cast<unsigned>(getpid()) % 1'000'000U);
  const pid_t child = fork();
  if (child < 0) return 77;
  if (child == 0) {
    const bool dropped = geteuid() == 0;
    if (dropped && (setgroups(0, nullptr) != 0 || setgid(alone) != 0 || setuid(alone) != 0)) _exit(77);
    const std::size_t mine = tasks_of_user(getuid());  // this child included
    const rlim_t most = static_cast<rlim_t>(mine + threads);
    const rlimit limit{most, most};
    if (setrlimit(RLIMIT_NPROC, &limit) != 0) _exit(77);
    _exit(body());
  }
  int status = 0;
  for (int waited_ms = 0; waitpid(child, &status, WNOHANG) == 0; waited_ms += 10) {
    if (waited_ms >= 60'000) {  // a deadlock: a condition variable destroyed under its waiters
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return 98;
    }
    usleep(10'000);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 99;
}

/// Hands no completion back until its gate opens: transfers that cannot end before a test
/// says so.
class gated_engine final : public forwarding_engine {
 public:
  gated_engine(std::unique_ptr<io::io_engine> inner, std::shared_ptr<gate> g)
      : forwarding_engine(std::move(inner)), gate_(std::move(g)) {}
  std::vector<io::io_completion> wait(std::size_t min_completions) override {
    gate_->pass();
    return inner_->wait(min_completions);
  }

 private:
  std::shared_ptr<gate> gate_;
};

}  // namespace tensormem::swap::testing

/// Skips when the child could not mount its tmpfs, else expects it to have succeeded.
#define EXPECT_FULL_DISK_CHILD(status)                                                        \
  do {                                                                                         \
    const int full_disk_status = (status);                                                     \
    if (full_disk_status == 77) GTEST_SKIP() << "cannot mount a tmpfs in a namespace here (needs root)"; \
    EXPECT_EQ(full_disk_status, 0);                                                            \
  } while (false)
