#pragma once
// A mutex that no forked child inherits locked, and the memory layer's count of forks.

#include <cstdint>
#include <mutex>

namespace tensormem::memory::detail {

/// How many fork()s led from the process that first made a fork_safe_mutex (or asked) to
/// this one: 0 there, 1 in its children, 2 in theirs. Counted by the memory layer's
/// pthread_atfork handler, so an object that records it when made sees every later fork().
std::uint64_t forks_seen() noexcept;

/// Records the process a memory object (a pinned resource or pool) is made in. In a child
/// forked after that, none of the object's memory is locked (fork() does not pass memory
/// locks on, and a CUDA registration belongs to the parent's context): the object refuses
/// new allocations there, and what it handed out before the fork can still be used and freed.
class fork_record {
 public:
  fork_record() noexcept;
  /// True in a child forked (at any depth) after this record was made. One atomic load.
  bool forked() const noexcept { return forks_seen() != made_at_; }
  /// Throws memory::forked_child_error naming `what` ("pinned_pool") and both processes
  /// when `forked()`.
  void refuse_allocation_in_child(const char* what) const {
    if (forked()) fail(what);
  }

 private:
  [[noreturn]] void fail(const char* what) const;
  std::uint64_t made_at_;
  long pid_;
};

/// A std::mutex (BasicLockable and Lockable) that fork() never leaves locked in the child.
/// Every live one is listed; a pthread_atfork handler locks them all before the fork (the
/// newest first) and unlocks them in both processes after it, as glibc does with malloc's
/// locks. Without it, a child forked while another thread held the mutex inherits it held by
/// a thread that does not exist there: the child's first lock waits for ever, and the state
/// it guards may be half-changed. With it, fork() waits for such a thread to leave its
/// critical section, and the child finds the guarded state whole.
///
/// The order: a mutex made later is locked first. An object that locks another's mutex
/// inside its own critical section must be made after that other object (a pool after the
/// resource it owns, an adaptor after its upstream), which is how they nest here; a thread
/// that forks must hold none of them. Making and destroying one takes the list's lock (not
/// on any allocation path: the objects that hold one are long-lived).
class fork_safe_mutex {
 public:
  fork_safe_mutex() noexcept;
  ~fork_safe_mutex();
  fork_safe_mutex(const fork_safe_mutex&) = delete;
  fork_safe_mutex& operator=(const fork_safe_mutex&) = delete;

  void lock() { mutex_.lock(); }
  bool try_lock() noexcept { return mutex_.try_lock(); }
  void unlock() noexcept { mutex_.unlock(); }

 private:
  friend struct fork_registry;
  std::mutex mutex_;
  fork_safe_mutex* older_ = nullptr;  // the list, newest first
  fork_safe_mutex* newer_ = nullptr;
};

}  // namespace tensormem::memory::detail
