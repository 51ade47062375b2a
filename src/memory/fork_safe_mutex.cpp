#include "tensormem/memory/detail/fork_safe_mutex.hpp"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "tensormem/memory/errors.hpp"

namespace tensormem::memory::detail {

namespace {
std::atomic<std::uint64_t> forks{0};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
}  // namespace

// The list of live mutexes and its lock. Never destroyed: a mutex in an object with static
// storage may outlive any other static.
struct fork_registry {
  std::mutex lock;
  fork_safe_mutex* newest = nullptr;

  static fork_registry& get() noexcept {
    static fork_registry* const registry = [] {
      auto* r = new fork_registry;
      // Fails only without memory for the handler: then forks are neither counted nor
      // waited for, as before this existed.
      static_cast<void>(::pthread_atfork(&before_fork, &after_fork_in_parent, &after_fork_in_child));
      return r;
    }();
    return *registry;
  }

  // Every listed mutex, newest first, with the list's own lock first of all: no mutex is
  // made or destroyed meanwhile, and none is held by another thread across the fork.
  static void before_fork() noexcept {
    fork_registry& r = get();
    r.lock.lock();
    for (fork_safe_mutex* m = r.newest; m != nullptr; m = m->older_) m->mutex_.lock();
  }
  static void unlock_all() noexcept {
    fork_registry& r = get();
    for (fork_safe_mutex* m = r.newest; m != nullptr; m = m->older_) m->mutex_.unlock();
    r.lock.unlock();
  }
  static void after_fork_in_parent() noexcept { unlock_all(); }
  // In the child the forking thread, the only one there, owns every lock taken before the
  // fork: it releases them (as glibc's own handlers release malloc's).
  static void after_fork_in_child() noexcept {
    forks.fetch_add(1, std::memory_order_relaxed);
    unlock_all();
  }
};

std::uint64_t forks_seen() noexcept {
  static_cast<void>(fork_registry::get());  // the handler that counts is registered
  return forks.load(std::memory_order_relaxed);
}

fork_record::fork_record() noexcept : made_at_(forks_seen()), pid_(static_cast<long>(::getpid())) {}

void fork_record::fail(const char* what) const {
  throw forked_child_error(std::string(what) + " was made by process " + std::to_string(pid_) +
                           " and cannot allocate in process " + std::to_string(static_cast<long>(::getpid())) +
                           ", a child forked from it: fork() does not pass memory locks on to a child, so its "
                           "memory is not locked here (nor registered with CUDA); make a new one in this process. "
                           "What it handed out before the fork can still be used and freed here.");
}

fork_safe_mutex::fork_safe_mutex() noexcept {
  fork_registry& r = fork_registry::get();
  const std::lock_guard guard(r.lock);
  older_ = r.newest;
  if (older_ != nullptr) older_->newer_ = this;
  r.newest = this;
}

fork_safe_mutex::~fork_safe_mutex() {
  fork_registry& r = fork_registry::get();
  const std::lock_guard guard(r.lock);
  if (newer_ != nullptr) newer_->older_ = older_;
  else r.newest = older_;
  if (older_ != nullptr) older_->newer_ = newer_;
}

}  // namespace tensormem::memory::detail
