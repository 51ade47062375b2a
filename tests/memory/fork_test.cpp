// Memory objects across fork(): no lock inherited held by a thread the child does not have,
// and no claim that memory is locked where it is not.

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "tensormem/memory/detail/fork_safe_mutex.hpp"
#include "tensormem/memory/errors.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"
#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/memory/statistics_adaptor.hpp"

namespace tensormem::memory {
namespace {

// How a child ended: its exit code, or 100 + the signal that ended it (SIGALRM: it hung).
int wait_for(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
}

// Runs `body` in a child process that an alarm ends after `seconds` (exit 100 + SIGALRM).
template <class Body>
int in_child(Body body, unsigned seconds = 20) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(seconds);
    _exit(body());
  }
  return wait_for(pid);
}

// Forks `count` children, each running `child` under an alarm of 5 s (a hang ends it);
// how many did not exit 0.
template <class Child>
int children_that_fail(int count, Child child) {
  int bad = 0;
  for (int i = 0; i < count; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(5);
      _exit(child());
    }
    if (wait_for(pid) != 0) ++bad;
  }
  return bad;
}

TEST(fork_safe_mutex, a_child_never_inherits_it_held_by_a_thread_it_does_not_have) {
  // The whole scene in a child, so that a hang ends with its alarm, not the test run's.
  const int code = in_child([] {
    detail::fork_safe_mutex m;
    std::atomic<bool> stop{false};
    std::atomic<long> held{0};
    std::thread holder([&] {
      while (!stop.load()) {
        const std::lock_guard lock(m);
        held.fetch_add(1);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
    while (held.load() == 0) std::this_thread::yield();
    const int bad = children_that_fail(20, [&] {
      m.lock();  // with a plain std::mutex, held by the holder at the fork: waits for ever
      m.unlock();
      return 0;
    });
    stop = true;
    holder.join();
    return bad;
  });
  EXPECT_EQ(code, 0) << "children that could not take the mutex (or 114: the scene hung)";
}

TEST(fork_safe_mutex, nested_mutexes_are_taken_outer_first_before_a_fork) {
  // A thread holds `outer` (made later) and then takes `inner` (made earlier), as a pool holds
  // its lock and then its resource's. The fork handler takes the newest first: were it the
  // other way round it would hold `inner` and wait for `outer`, whose holder waits for
  // `inner`: the fork would never return.
  const int code = in_child([] {
    detail::fork_safe_mutex inner;
    detail::fork_safe_mutex outer;
    std::atomic<bool> stop{false};
    std::atomic<long> rounds{0};
    std::thread nester([&] {
      while (!stop.load()) {
        const std::lock_guard a(outer);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        const std::lock_guard b(inner);
        rounds.fetch_add(1);
      }
    });
    while (rounds.load() == 0) std::this_thread::yield();
    const int bad = children_that_fail(50, [&] {
      const std::lock_guard a(outer);
      const std::lock_guard b(inner);
      return 0;
    });
    stop = true;
    nester.join();
    return bad;
  });
  EXPECT_EQ(code, 0) << "114: the forks deadlocked";
}

TEST(fork_safe_mutex, a_mutex_destroyed_leaves_the_others_listed) {
  detail::fork_safe_mutex first;
  {
    detail::fork_safe_mutex middle;
    detail::fork_safe_mutex last;
  }
  detail::fork_safe_mutex after;
  const std::uint64_t before = detail::forks_seen();
  const int code = in_child([&] {
    first.lock();
    after.lock();
    return detail::forks_seen() == before + 1 ? 0 : 1;
  });
  EXPECT_EQ(code, 0);
  EXPECT_EQ(detail::forks_seen(), before);
}

// A pool used by another thread (allocations and frees, slabs made and released) while the
// main thread forks: every child frees a buffer from before the fork, finds the pool whole,
// and is refused a new allocation, its memory being unlocked there.
TEST(pinned_pool_fork, a_child_forked_while_a_thread_is_inside_the_pool_finds_it_whole) {
  const int code = in_child([] {
    pinned_pool pool(pool_options{.slab_bytes = 1 << 20});
    std::atomic<bool> stop{false};
    std::atomic<long> rounds{0};
    std::thread user([&] {
      std::vector<void*> held;
      while (!stop.load()) {
        const auto round = static_cast<std::size_t>(rounds.load());
        held.push_back(pool.allocate(4096 + 4096 * (round % 7)));
        if (round % 50 == 0) held.push_back(pool.allocate(2 << 20));  // a slab of its own
        if (held.size() > 16) {
          for (void* p : held) pool.free(p);
          held.clear();
          pool.trim();
        }
        rounds.fetch_add(1);  // (no pause: the slabs' system calls are made outside the lock)
      }
      for (void* p : held) pool.free(p);
    });
    while (rounds.load() < 10) std::this_thread::yield();
    int bad = 0;
    for (int i = 0; i < 60; ++i) {
      auto* mine = static_cast<unsigned char*>(pool.allocate(8192));
      std::memset(mine, 0x5a, 8192);
      const pid_t pid = fork();
      if (pid == 0) {
        alarm(2);  // (an alarm is not inherited: each child sets its own)
        if (mine[8191] != 0x5a) _exit(2);
        mine[0] = 1;  // still memory of this process's own (a copy)
        if (!pool.owns(mine) || !pool.free(mine)) _exit(3);
        try {
          pool.allocate(4096);
          _exit(4);
        } catch (const forked_child_error&) {
        }
        const pool_stats s = pool.stats();
        if (s.locked_bytes != 0 || s.registered_bytes != 0) _exit(5);
        pool.trim();
        _exit(0);
      }
      if (wait_for(pid) != 0) ++bad;
      if (mine[0] != 0x5a || !pool.free(mine)) ++bad;  // the child's writes and free stay there
    }
    stop = true;
    user.join();
    const pool_stats s = pool.stats();
    return bad + (s.allocations == 0 && s.locked_bytes == s.slab_bytes ? 0 : 100);
  }, 60);
  EXPECT_EQ(code, 0) << "children that failed (114: the scene hung on a lock)";
}

TEST(pinned_pool_fork, the_parent_keeps_allocating_after_forks) {
  pinned_pool pool(pool_options{.slab_bytes = 1 << 20});
  void* before = pool.allocate(4096);
  EXPECT_EQ(in_child([&] { return pool.free(before) ? 0 : 1; }), 0);
  EXPECT_TRUE(pool.owns(before));
  void* after = pool.allocate(4096);
  EXPECT_NE(after, before);
  EXPECT_EQ(pool.stats().locked_bytes, std::uint64_t{1} << 20);
  EXPECT_TRUE(pool.free(before));
  EXPECT_TRUE(pool.free(after));
}

TEST(pinned_host_resource_fork, a_child_is_refused_allocations_and_may_free_what_it_inherited) {
  pinned_host_resource resource;
  statistics_adaptor counted(resource);
  void* p = counted.allocate(1 << 16, 4096);
  const int code = in_child([&] {
    for (auto call : {+[](pinned_host_resource& r) { return r.allocate(4096, 4096); },
                      +[](pinned_host_resource& r) { return r.allocate_locked(4096, 4096); }}) {
      try {
        call(resource);
        return 1;
      } catch (const forked_child_error& e) {
        if (std::strstr(e.what(), "a child forked from it") == nullptr) return 2;
      }
    }
    if (resource.stats().locked_bytes != 0) return 3;
    counted.deallocate(p, 1 << 16, 4096);
    if (counted.counters().current_allocations != 0 || resource.stats().mappings != 0) return 4;
    return 0;
  });
  EXPECT_EQ(code, 0);
  EXPECT_EQ(resource.stats().locked_bytes, std::uint64_t{1} << 16);
  counted.deallocate(p, 1 << 16, 4096);
  EXPECT_EQ(resource.stats().mappings, 0U);
}

}  // namespace
}  // namespace tensormem::memory
