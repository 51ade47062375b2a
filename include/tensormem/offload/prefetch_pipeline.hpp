#pragma once
// A prefetching pipeline over a swap space: given the order in which tensors will be needed,
// it keeps reads in flight ahead of the caller within a pinned-memory budget, and writes back
// what the caller releases dirty, recycling the staging buffers when the writes complete.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "tensormem/io/fork_guard.hpp"
#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/offload/swap_space.hpp"

namespace tensormem::offload {

struct pipeline_options {
  /// Bytes of staging buffers the pipeline may hold (reading, held by the caller, writing).
  std::uint64_t pinned_budget = std::uint64_t{256} << 20;
  /// Most positions read ahead of the caller (0: as many as the budget allows): once position
  /// i is acquired, the reads of positions up to i + max_ahead are started (buffers allowing).
  unsigned max_ahead = 0;
  /// False: no thread of the pipeline's own; its calls collect the write-backs where they
  /// would wait for them, as where the thread cannot be started.
  bool collector_thread = true;
};

struct pipeline_stats {
  std::uint64_t buffers = 0;              ///< staging buffers
  std::uint64_t pinned_bytes = 0;         ///< their bytes (never above the budget)
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  double acquire_wait_seconds = 0;        ///< the caller blocked in acquire (reads not yet in)
  double finish_wait_seconds = 0;         ///< the caller blocked in finish (write-backs)
  std::uint64_t acquires_waited = 0;      ///< acquires that blocked (over 0.1 ms)
  /// False where the collector thread could not be started (a limit on threads): the caller's
  /// calls collected the write-backs themselves.
  bool collector_thread = true;
};

/// `acquire(i)` hands out the i-th tensor of the order (in order), blocking only while its
/// read is in flight; `release(i, dirty)` gives it back, queuing its write-back (to the
/// uncommitted generation) when dirty. The buffers are allocated from `pool` once, as many
/// tensors of the largest size as the budget holds (at least two; fewer is an error), so the
/// pipeline never holds more pinned memory than the budget: when every buffer is busy, reads
/// wait (back-pressure). A background thread collects write-backs and starts the next reads,
/// so I/O progresses while the caller computes; where that thread cannot be started (a limit
/// on threads, EAGAIN), `acquire`, `finish` and the destructor collect them where they would
/// wait (the transfers themselves still move on the swap space's threads), and
/// `stats().collector_thread` says so. Commits nothing: the caller commits what
/// `written()` lists once `finish` succeeded. In a child forked after the pipeline was made,
/// every call but `buffer_count` throws io::forked_child_error, and the destructor waits for
/// nothing.
class prefetch_pipeline {
 public:
  prefetch_pipeline(swap_space& space, memory::pinned_pool& pool, std::vector<std::size_t> order,
                    pipeline_options options = {});
  /// Waits for every transfer in flight (errors are dropped: call finish to see them).
  ~prefetch_pipeline();
  prefetch_pipeline(const prefetch_pipeline&) = delete;
  prefetch_pipeline& operator=(const prefetch_pipeline&) = delete;

  /// The buffer of the tensor at position `i` of the order, once read (padded_bytes long).
  /// Positions are acquired in order. Throws offload_error when the read failed.
  std::byte* acquire(std::size_t i);
  /// Gives position `i` back; `dirty` queues its buffer's write-back first.
  void release(std::size_t i, bool dirty);
  /// Waits for every write-back; throws offload_error (the first failed tensor) if any failed.
  void finish();
  /// Tensors whose write-back finished successfully, in completion order.
  std::vector<std::size_t> written() const;
  pipeline_stats stats() const;
  std::size_t buffer_count() const noexcept { return buffers_.size(); }

 private:
  enum class state { waiting, reading, acquired, writing, done };
  struct item {
    std::size_t tensor = 0;
    state s = state::waiting;
    std::byte* buffer = nullptr;
    swap_space::transfer io;
    std::exception_ptr error;  // the read could not be queued
  };

  void pump();  // starts reads while buffers are free; under mutex_
  void collect_writes();
  void collect_oldest_write(std::unique_lock<std::mutex>& lock);
  // Waits under `lock` until `done()`; without a collector thread, collects write-backs meanwhile.
  template <class Done>
  void wait_until(std::unique_lock<std::mutex>& lock, Done done);
  void end_reads_and_give_back_buffers() noexcept;

  static constexpr const char* who = "a prefetch pipeline";
  io::detail::fork_guard made_;
  swap_space& space_;
  memory::pinned_pool& pool_;
  pipeline_options options_;
  // What the collector thread or the callers change under the lock is left as it is in a
  // forked child, like the collector itself.
  io::detail::unless_forked<std::vector<item>> items_;
  std::vector<std::byte*> buffers_;
  io::detail::unless_forked<std::vector<std::byte*>> free_;
  mutable std::mutex mutex_;
  io::detail::unless_forked<std::condition_variable> changed_;
  io::detail::unless_forked<std::deque<std::size_t>> writes_;  // positions with write-backs in flight, oldest first
  std::size_t next_read_ = 0;
  std::size_t next_acquire_ = 0;
  io::detail::unless_forked<std::vector<std::size_t>> written_;
  io::detail::unless_forked<std::exception_ptr> write_error_;
  bool stop_ = false;
  bool collecting_ = false;  // a caller collects a write-back (no collector thread)
  pipeline_stats stats_;
  io::detail::unless_forked<std::thread> collector_;
};

}  // namespace tensormem::offload
