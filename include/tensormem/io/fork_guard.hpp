#pragma once
// Objects that run threads of their own, hold an io_uring ring or own files, in a child
// process forked after they were made.

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

namespace tensormem::io {

/// Thrown by every call on an object that runs threads of its own (a tensor swapper, an
/// async_file_io, an I/O engine, a swap space, a prefetch pipeline, an offloaded optimizer)
/// in a child process forked after the object was made. fork() copies the object's memory but
/// none of its threads, and its io_uring ring stays shared with the parent, so in the child
/// it could only hang, crash or disturb the parent's transfers. The child makes its own
/// objects instead (or the parent starts children with exec: posix_spawn, Python's "spawn").
class forked_child_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {

/// How many fork()s led from the process that first asked to this one: 0 there, 1 in its
/// children, 2 in theirs. Counted by a pthread_atfork handler registered by the first call,
/// so any object that records it at its construction sees every later fork(). A child made by
/// a raw clone() or vfork() runs no handler; it must exec (as posix_spawn's children do).
std::uint64_t forks_seen() noexcept;

/// Records the process an object is made in. `forked()` is one relaxed atomic load.
class fork_guard {
 public:
  fork_guard() noexcept;
  /// True in a child forked (at any depth) after this guard was made.
  bool forked() const noexcept { return forks_seen() != made_at_; }
  /// Throws forked_child_error naming `what` ("a tensor swapper") and both processes when
  /// `forked()`.
  void require_same_process(const char* what) const {
    if (forked()) fail(what);
  }

 private:
  [[noreturn]] void fail(const char* what) const;
  std::uint64_t made_at_;
  long pid_;
};

/// A member that is destroyed only in the process that made it. In a forked child, the
/// threads a std::thread names do not exist (destroying a joinable one ends the process), a
/// condition variable on which the parent's threads were waiting counts waiters that will
/// never leave (destroying it waits for them forever), and a container that one of the
/// parent's threads was changing at the fork may be half-changed (destroying it may free a
/// node twice): such members are left as they are, their memory and nothing else lost, and
/// the owner's destructor must not touch them. Costs one word beside the value.
template <class T>
class unless_forked {
 public:
  template <class... Args>
  explicit unless_forked(Args&&... args) {
    std::construct_at(&value_, std::forward<Args>(args)...);
  }
  ~unless_forked() {
    if (forks_seen() == made_at_) std::destroy_at(&value_);
  }
  unless_forked(const unless_forked&) = delete;
  unless_forked& operator=(const unless_forked&) = delete;

  T& operator*() noexcept { return value_; }
  const T& operator*() const noexcept { return value_; }
  T* operator->() noexcept { return &value_; }
  const T* operator->() const noexcept { return &value_; }

 private:
  std::uint64_t made_at_ = forks_seen();
  union {
    T value_;
  };
};

}  // namespace detail
}  // namespace tensormem::io
