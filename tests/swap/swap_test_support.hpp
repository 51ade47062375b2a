#pragma once
// Helpers shared by the swapper and file I/O tests: a scratch directory removed with its
// contents, reproducible tensor bytes, an engine wrapper, and a full disk in a child process.

#include <stdlib.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tensormem/io/io_engine.hpp"

namespace tensormem::swap::testing {

/// A fresh directory under the system's temporary directory; `path` is empty when it could
/// not be made.
struct scratch_dir {
  std::filesystem::path path;
  scratch_dir() {
    std::string templ = (std::filesystem::temp_directory_path() / "tensormem-swaptest-XXXXXX").string();
    if (mkdtemp(templ.data()) != nullptr) path = templ;
  }
  ~scratch_dir() {
    if (!path.empty()) std::filesystem::remove_all(path);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
};

/// `n` pseudo-random bytes determined by `seed`.
inline std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

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

}  // namespace tensormem::swap::testing

/// Skips when the child could not mount its tmpfs, else expects it to have succeeded.
#define EXPECT_FULL_DISK_CHILD(status)                                                        \
  do {                                                                                         \
    const int full_disk_status = (status);                                                     \
    if (full_disk_status == 77) GTEST_SKIP() << "cannot mount a tmpfs in a namespace here (needs root)"; \
    EXPECT_EQ(full_disk_status, 0);                                                            \
  } while (false)
