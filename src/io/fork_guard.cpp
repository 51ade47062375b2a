#include "tensormem/io/fork_guard.hpp"

#include <pthread.h>
#include <unistd.h>

#include <atomic>

namespace tensormem::io::detail {

namespace {

std::atomic<std::uint64_t> forks{0};

// Runs in the child, where only async-signal-safe work is allowed: a lock-free increment.
void count_fork_in_child() noexcept { forks.fetch_add(1, std::memory_order_relaxed); }

static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

}  // namespace

std::uint64_t forks_seen() noexcept {
  // pthread_atfork fails only without memory for the handler; then no fork is counted, and
  // objects behave as they did before this check existed.
  static const bool registered = ::pthread_atfork(nullptr, nullptr, &count_fork_in_child) == 0;
  static_cast<void>(registered);
  return forks.load(std::memory_order_relaxed);
}

fork_guard::fork_guard() noexcept : made_at_(forks_seen()), pid_(static_cast<long>(::getpid())) {}

void fork_guard::fail(const char* what) const {
  throw forked_child_error(std::string(what) + " was made by process " + std::to_string(pid_) +
                           " and cannot be used in process " + std::to_string(static_cast<long>(::getpid())) +
                           ", a child forked from it: fork() copies the object but not its threads, and an "
                           "io_uring ring it drives stays the parent's; make a new one in this process, or start "
                           "children by exec (Python's multiprocessing 'spawn' or 'forkserver'). Dropping it here "
                           "frees nothing the parent uses and deletes no file.");
}

}  // namespace tensormem::io::detail
