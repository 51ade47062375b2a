#include "tensormem/offload/prefetch_pipeline.hpp"
#include "tensormem/core/detail/thread_start.hpp"

#include <algorithm>
#include <stdexcept>

namespace tensormem::offload {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

prefetch_pipeline::prefetch_pipeline(swap_space& space, memory::pinned_pool& pool, std::vector<std::size_t> order,
                                     pipeline_options options)
    : space_(space), pool_(pool), options_(options) {
  std::uint64_t largest = 0;
  items_->reserve(order.size());
  written_->reserve(order.size());  // each position is written back once at most: the collector never allocates
  for (const std::size_t t : order) {
    largest = std::max(largest, space_.padded_bytes(t));  // throws for an unknown tensor
    items_->push_back({t, state::waiting, nullptr, {}, nullptr});
  }
  if (!items_->empty()) {
    // What one buffer costs the pool: its bytes rounded to the pool's granularity, plus the
    // slack it keeps to align to 4096 when its own alignment is smaller.
    const std::uint64_t bytes = std::max<std::uint64_t>(largest, 4096);
    const std::uint64_t grain = pool_.options().alignment;
    const std::uint64_t cost = (bytes + grain - 1) / grain * grain + (grain < 4096 ? 4096 - grain : 0);
    const std::uint64_t fit = options_.pinned_budget / cost;
    if (fit < 2 && items_->size() > 1) {
      throw std::invalid_argument("prefetch_pipeline: a pinned budget of " + std::to_string(options_.pinned_budget) +
                                  " bytes holds fewer than two staging buffers of " + std::to_string(cost) +
                                  " bytes; raise the budget or make the tensors smaller");
    }
    if (fit < 1) {
      throw std::invalid_argument("prefetch_pipeline: a pinned budget of " + std::to_string(options_.pinned_budget) +
                                  " bytes cannot hold a staging buffer of " + std::to_string(cost) + " bytes");
    }
    const std::size_t count = static_cast<std::size_t>(std::min<std::uint64_t>(fit, items_->size()));
    // Room first, so that a buffer taken from the pool is never lost to a failing push_back.
    buffers_.reserve(count);
    free_->reserve(count);
    try {
      for (std::size_t i = 0; i < count; ++i) buffers_.push_back(static_cast<std::byte*>(pool_.allocate(bytes, 4096)));
    } catch (...) {
      for (std::byte* b : buffers_) pool_.free(b);
      throw;
    }
    *free_ = buffers_;  // (within the room reserved: no allocation)
    stats_.buffers = buffers_.size();
    stats_.pinned_bytes = buffers_.size() * cost;
  }
  {
    const std::lock_guard lock(mutex_);
    pump();  // (a read that cannot be queued is kept for its acquire: nothing throws here)
  }
  stats_.collector_thread = options_.collector_thread;
  if (options_.collector_thread) {
    try {
      *collector_ = std::thread([this] { collect_writes(); });
    } catch (...) {
      // No thread (EAGAIN at a limit on threads, or no memory for its start): the caller's
      // calls collect the write-backs where they would wait for them.
      stats_.collector_thread = false;
    }
  }
}

template <class Done>
void prefetch_pipeline::wait_until(std::unique_lock<std::mutex>& lock, Done done) {
  while (!done()) {
    if (!stats_.collector_thread && !collecting_ && !writes_->empty()) {
      collect_oldest_write(lock);
    } else {
      changed_->wait(lock);
    }
  }
}

prefetch_pipeline::~prefetch_pipeline() {
  // In a forked child the collector does not exist and the lock may be a parent thread's:
  // nothing is waited for or given back.
  if (made_.forked()) return;
  {
    std::unique_lock lock(mutex_);
    wait_until(lock, [this] { return writes_->empty(); });
    stop_ = true;
  }
  changed_->notify_all();
  if (collector_->joinable()) collector_->join();
  end_reads_and_give_back_buffers();
}

// Reads still in flight (the caller stopped early) end before their buffers go back.
void prefetch_pipeline::end_reads_and_give_back_buffers() noexcept {
  for (item& it : *items_) {
    if (it.s == state::reading && !it.error) {
      try {
        space_.finish(it.io);
      } catch (const std::exception&) {  // nobody asked for this tensor any more
      }
    }
  }
  for (std::byte* b : buffers_) pool_.free(b);
}

void prefetch_pipeline::pump() {
  while (next_read_ < items_->size() && !free_->empty() &&
         (options_.max_ahead == 0 || next_read_ < next_acquire_ + options_.max_ahead)) {
    item& it = (*items_)[next_read_];
    it.buffer = free_->back();
    free_->pop_back();
    ++next_read_;
    try {
      it.io = space_.read(it.tensor, it.buffer);
    } catch (...) {
      it.error = std::current_exception();  // for whoever acquires this position
    }
    it.s = state::reading;
  }
}

std::byte* prefetch_pipeline::acquire(std::size_t i) {
  made_.require_same_process(who);
  std::unique_lock lock(mutex_);
  if (i != next_acquire_ || i >= items_->size()) {
    throw std::logic_error("prefetch_pipeline: position " + std::to_string(i) + " acquired out of order (next is " +
                           std::to_string(next_acquire_) + " of " + std::to_string(items_->size()) + ")");
  }
  item& it = (*items_)[i];
  const auto start = std::chrono::steady_clock::now();
  if (it.s == state::waiting) {
    if (writes_->empty() && free_->empty()) {
      throw std::logic_error("prefetch_pipeline: every staging buffer is held by the caller; release one before "
                             "acquiring position " + std::to_string(i));
    }
    wait_until(lock, [&] { return it.s != state::waiting; });
  }
  ++next_acquire_;
  pump();  // the caller is one position further: reads up to max_ahead past it start now
  swap_space::transfer io = std::move(it.io);
  std::exception_ptr failed = std::exchange(it.error, nullptr);
  lock.unlock();
  if (!failed) {
    try {
      space_.finish(io);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  lock.lock();
  const double waited = seconds_since(start);
  stats_.acquire_wait_seconds += waited;
  if (waited > 100e-6) ++stats_.acquires_waited;
  if (failed) {
    it.s = state::done;
    free_->push_back(it.buffer);
    it.buffer = nullptr;
    pump();
    changed_->notify_all();
    std::rethrow_exception(failed);
  }
  stats_.bytes_read += space_.padded_bytes(it.tensor);
  it.s = state::acquired;
  return it.buffer;
}

void prefetch_pipeline::release(std::size_t i, bool dirty) {
  made_.require_same_process(who);
  std::unique_lock lock(mutex_);
  if (i >= items_->size() || (*items_)[i].s != state::acquired) {
    throw std::logic_error("prefetch_pipeline: position " + std::to_string(i) + " is not acquired");
  }
  item& it = (*items_)[i];
  if (dirty) {
    // Its place in the queue first: once the write has started, nothing may fail before the
    // collector knows of it (its buffer must not go back while the write is in flight).
    writes_->push_back(i);
    try {
      it.io = space_.write(it.tensor, it.buffer);
    } catch (...) {
      writes_->pop_back();  // (the lock was held: the collector has not seen it)
      it.s = state::done;
      free_->push_back(it.buffer);
      it.buffer = nullptr;
      pump();
      if (!*write_error_) *write_error_ = std::current_exception();
      changed_->notify_all();
      return;  // reported by finish
    }
    it.s = state::writing;
  } else {
    it.s = state::done;
    free_->push_back(it.buffer);
    it.buffer = nullptr;
    pump();
  }
  changed_->notify_all();
}

// The background thread: waits for the oldest write-back, recycles its buffer, starts reads.
void prefetch_pipeline::collect_writes() {
  core::detail::prepare_thread_for_exceptions();
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_->wait(lock, [this] { return stop_ || !writes_->empty(); });
    if (writes_->empty()) return;  // stop_
    collect_oldest_write(lock);
  }
}

// Waits (the lock released) for the oldest write-back, then recycles its buffer and starts
// reads. One caller at a time: the collector thread, or else the caller that would wait.
void prefetch_pipeline::collect_oldest_write(std::unique_lock<std::mutex>& lock) {
  collecting_ = true;
  item& it = (*items_)[writes_->front()];
  swap_space::transfer io = std::move(it.io);
  lock.unlock();
  std::exception_ptr failed;
  try {
    space_.finish(io);
  } catch (...) {
    failed = std::current_exception();
  }
  lock.lock();
  collecting_ = false;
  if (failed) {
    if (!*write_error_) *write_error_ = failed;
  } else {
    written_->push_back(it.tensor);
    stats_.bytes_written += space_.padded_bytes(it.tensor);
  }
  it.s = state::done;
  free_->push_back(it.buffer);
  it.buffer = nullptr;
  writes_->pop_front();
  pump();
  changed_->notify_all();
}

void prefetch_pipeline::finish() {
  made_.require_same_process(who);
  std::unique_lock lock(mutex_);
  const auto start = std::chrono::steady_clock::now();
  wait_until(lock, [this] { return writes_->empty(); });
  stats_.finish_wait_seconds += seconds_since(start);
  if (*write_error_) std::rethrow_exception(std::exchange(*write_error_, nullptr));
}

std::vector<std::size_t> prefetch_pipeline::written() const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return *written_;
}

pipeline_stats prefetch_pipeline::stats() const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace tensormem::offload
