// Thread-pool engine: pread/pwrite on worker threads, for systems without io_uring.

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "segments.hpp"
#include "tensormem/io/fork_guard.hpp"
#include "tensormem/io/io_engine.hpp"
#include "tensormem/core/detail/thread_start.hpp"

namespace tensormem::io {

namespace {

class thread_engine final : public io_engine {
 public:
  thread_engine(unsigned queue_depth, unsigned threads)
      : depth_(queue_depth == 0 ? 1 : queue_depth) {
    threads = std::clamp(threads, 1U, depth_);
    try {
      for (unsigned t = 0; t < threads; ++t) workers_->emplace_back([this] { work(); });
    } catch (...) {
      // Fewer threads than asked (a limit on threads) still move every request: those that
      // started are kept. None at all is an error.
      if (workers_->empty()) core::detail::rethrow_naming_thread_start("a thread-pool I/O engine");
    }
  }

  unsigned workers() const noexcept override { return static_cast<unsigned>(workers_->size()); }

  // In a forked child the workers do not exist and the lock may be held by one of the
  // parent's: nothing is waited for (the owner's requests were the parent's).
  ~thread_engine() override {
    if (!made_.forked()) stop();
  }

  void submit(std::span<const io_request> requests) override {
    made_.require_same_process(who);
    {
      // Room for every completion first, so that a worker never allocates (on its thread a
      // std::bad_alloc would end the process); a deque's insert at its end is all or nothing.
      const std::lock_guard lock(mutex_);
      detail::reserve_at_least(*done_, outstanding_ + requests.size());
      queue_->insert(queue_->end(), requests.begin(), requests.end());
    }
    outstanding_ += requests.size();
    work_ready_->notify_all();
  }

  std::vector<io_completion> wait(std::size_t min_completions) override {
    made_.require_same_process(who);
    min_completions = std::min(min_completions, outstanding_);
    std::unique_lock lock(mutex_);
    done_ready_->wait(lock, [&] { return done_->size() >= min_completions; });
    std::vector<io_completion> out(done_->begin(), done_->end());
    done_->clear();
    lock.unlock();
    outstanding_ -= out.size();
    return out;
  }

  bool register_buffers(std::span<const std::span<std::byte>> /*regions*/) override {
    made_.require_same_process(who);
    return false;  // pread and pwrite map nothing ahead
  }

  std::size_t outstanding() const noexcept override { return outstanding_; }
  engine_kind kind() const noexcept override { return engine_kind::threads; }
  unsigned queue_depth() const noexcept override { return depth_; }

 private:
  void work() {
    core::detail::prepare_thread_for_exceptions();
    std::unique_lock lock(mutex_);
    while (true) {
      work_ready_->wait(lock, [&] { return (!queue_->empty() && busy_ < depth_) || (stopping_ && queue_->empty()); });
      if (queue_->empty()) return;  // stopping, nothing left
      const io_request r = queue_->front();
      queue_->pop_front();
      ++busy_;
      lock.unlock();
      const std::int64_t result = detail::transfer_synchronously(r, 0);
      lock.lock();
      --busy_;
      done_->push_back({r.user_data, result, r.total()});
      done_ready_->notify_all();
      work_ready_->notify_one();
    }
  }

  void stop() noexcept {
    {
      const std::lock_guard lock(mutex_);
      stopping_ = true;  // workers finish the queue first
    }
    work_ready_->notify_all();
    for (auto& w : *workers_) w.join();
  }

  static constexpr const char* who = "a thread-pool I/O engine";
  detail::fork_guard made_;
  unsigned depth_;
  detail::unless_forked<std::vector<std::thread>> workers_;
  std::mutex mutex_;
  detail::unless_forked<std::condition_variable> work_ready_;
  detail::unless_forked<std::condition_variable> done_ready_;
  // Changed by the workers under the lock: a fork may copy them half-changed, so a child leaves them.
  detail::unless_forked<std::deque<io_request>> queue_;
  detail::unless_forked<std::vector<io_completion>> done_;
  unsigned busy_ = 0;
  bool stopping_ = false;
  std::size_t outstanding_ = 0;
};

}  // namespace

std::unique_ptr<io_engine> make_thread_engine(unsigned queue_depth, unsigned threads) {
  detail::check_queue_depth(queue_depth);
  return std::make_unique<thread_engine>(queue_depth, threads);
}

std::unique_ptr<io_engine> make_engine(engine_kind preferred, unsigned queue_depth,
                                       std::string& fallback_reason) {
  fallback_reason.clear();
  if (preferred == engine_kind::uring) {
    try {
      return make_uring_engine(queue_depth);
    } catch (const std::system_error& e) {
      fallback_reason = std::string("io_uring unavailable (") + e.what() + "); using threads";
    }
  }
  const unsigned asked = std::clamp(queue_depth, 1U, 8U);
  auto engine = make_thread_engine(queue_depth, asked);
  if (engine->workers() < asked) {
    detail::append_reason(fallback_reason, "the thread-pool I/O engine started " + std::to_string(engine->workers()) +
                                               " of its " + std::to_string(asked) + " threads (a limit on threads)");
  }
  return engine;
}

std::string_view to_string(engine_kind kind) noexcept {
  return kind == engine_kind::uring ? "uring" : "threads";
}

namespace detail {
void append_reason(std::string& reasons, std::string_view reason) {
  reasons.reserve(reasons.size() + 2 + reason.size());  // (all or nothing: the appends then allocate nothing)
  if (!reasons.empty()) reasons += "; ";
  reasons += reason;
}

bool submit_or_refuse(io_engine& engine, std::span<const io_request> requests) noexcept {
  try {
    engine.submit(requests);
    return true;
  } catch (...) {  // std::bad_alloc, nothing taken
    return false;
  }
}

std::vector<io_completion> wait_or_pause(io_engine& engine) noexcept {
  try {
    return engine.wait(1);
  } catch (...) {  // std::bad_alloc, the completions kept by the engine
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return {};
  }
}
}  // namespace detail

}  // namespace tensormem::io
