// io_uring engine: bounded queue depth, requests handed to the kernel one by one,
// completions reaped in batches, short transfers and -EAGAIN continued, requests io_uring
// cancelled moved by blocking calls, drained on teardown.

#include <liburing.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <string>
#include <system_error>
#include <utility>

#include "tensormem/io/fork_guard.hpp"
#include "tensormem/io/io_engine.hpp"
#include "segments.hpp"
#include "uring_faults.hpp"

namespace tensormem::io {

namespace {

// Results of io_uring_submit / io_uring_wait_cqe that mean "reap, then try again".
bool transient(int rc) noexcept { return rc == -EAGAIN || rc == -EBUSY || rc == -EINTR || rc == -ETIME; }

class uring_engine final : public io_engine {
 public:
  uring_engine(unsigned queue_depth, detail::uring_faults faults)
      : depth_(queue_depth == 0 ? 1 : queue_depth), faults_(std::move(faults)) {
    detail::check_queue_depth(depth_);
    const int rc = io_uring_queue_init(depth_, &ring_, 0);
    if (rc < 0) throw std::system_error(-rc, std::generic_category(), "io_uring_queue_init");
    if (const char* missing = missing_operation()) {
      io_uring_queue_exit(&ring_);
      throw std::system_error(EOPNOTSUPP, std::generic_category(),
                              std::string("io_uring of this kernel has no ") + missing + " (Linux 5.6 or later has it)");
    }
    slots_.resize(depth_);
    // A slot is in at most one of these at a time: reaping and failing never allocate.
    free_slots_->reserve(depth_);
    retry_->reserve(depth_);
    unsubmitted_->reserve(depth_);
    for (unsigned i = 0; i < depth_; ++i) free_slots_->push_back(i);
  }

  ~uring_engine() override {
    // The kernel may still write into our buffers: wait for what it holds. reap() ends
    // every wait, by a completion or by failing the ring (in_flight_ drops to 0). In a forked
    // child the ring's queues are the parent's (a shared mapping): reaping would take the
    // parent's completions, so the child only unmaps its view and closes its descriptor.
    if (!made_.forked()) {
      while (in_flight_ != 0) reap(1);
    }
    io_uring_queue_exit(&ring_);
  }

  // Strong guarantee: room for every completion is made first, so that reaping never
  // allocates (a completion taken from the ring and then lost to std::bad_alloc would leave
  // its request outstanding for ever), and a failed push takes back the ones before it.
  void submit(std::span<const io_request> requests) override {
    made_.require_same_process(who);
    detail::reserve_at_least(*ready_, outstanding_ + requests.size());
    std::size_t pushed = 0;
    try {
      for (const io_request& r : requests) {
        pending_->push_back({r, 0});
        ++pushed;
      }
    } catch (...) {
      for (; pushed != 0; --pushed) pending_->pop_back();
      throw;
    }
    outstanding_ += requests.size();
    pump();
  }

  std::vector<io_completion> wait(std::size_t min_completions) override {
    made_.require_same_process(who);
    min_completions = std::min(min_completions, outstanding_);
    while (ready_->size() < min_completions) {
      pump();
      if (ready_->size() >= min_completions) break;
      // Every outstanding request is pending, queued, in flight or ready; with nothing in
      // flight and nothing to submit the loop could not progress, so that is a failure.
      if (in_flight_ == 0 && unsubmitted_->empty() && pending_->empty() && retry_->empty()) break;
      reap(1);
    }
    reap(0);  // whatever else is ready, without blocking
    pump();
    std::vector<io_completion> out(ready_->begin(), ready_->end());
    ready_->clear();
    outstanding_ -= out.size();
    return out;
  }

  bool register_buffers(std::span<const std::span<std::byte>> regions) override {
    made_.require_same_process(who);
    if (outstanding_ != 0 || !registered_.empty() || regions.empty()) return false;
    std::vector<iovec> iov;
    for (const auto& r : regions) iov.push_back({r.data(), r.size()});
    if (io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size())) < 0) {
      return false;
    }
    registered_.assign(regions.begin(), regions.end());
    return true;
  }

  std::size_t outstanding() const noexcept override { return outstanding_; }
  engine_kind kind() const noexcept override { return engine_kind::uring; }
  unsigned queue_depth() const noexcept override { return depth_; }
  std::uint64_t synchronous_requests() const noexcept override {
    return synchronous_.load(std::memory_order_relaxed);
  }

 private:
  struct op {
    io_request request;
    std::size_t done = 0;  // bytes already transferred
    iovec iov[2]{};        // a vectored request's segments, kept until it completes
  };

  // Moves pending requests into free slots and hands each to the kernel as soon as it is
  // prepared, as fio does by default. Submitting many at once lets the block layer plug and
  // merge adjacent requests (the slots of a pack file, the blocks of a tensor) into a few
  // large ones, and fewer, larger requests in flight served this machine's disk at
  // 1.6-2.1 GB/s where the same bytes as 64 KiB requests ran at 1.9-2.5 (docs/BENCHMARKS.md).
  void pump() {
    if (broken_ != 0) {
      fail_unsubmitted();
      return;
    }
    while (!pending_->empty() && !free_slots_->empty()) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      const unsigned slot = free_slots_->back();
      free_slots_->pop_back();
      slots_[slot] = pending_->front();
      pending_->pop_front();
      prepare(sqe, slot);
      unsubmitted_->push_back(slot);
      submit_queued();
    }
    submit_queued();  // what a transient refusal left
  }

  // Hands the queued entries to the kernel. A transient refusal leaves them queued for the
  // next call (after a reap has freed room); any other error means the ring cannot take
  // requests: they, and every later one, complete with that error.
  void submit_queued() {
    if (broken_ != 0) {
      fail_unsubmitted();
      return;
    }
    if (unsubmitted_->empty()) return;
    const int rc = faults_.submit ? faults_.submit(&ring_) : io_uring_submit(&ring_);
    if (rc > 0) {
      const auto taken = std::min<std::size_t>(static_cast<std::size_t>(rc), unsubmitted_->size());
      in_flight_ += static_cast<unsigned>(taken);
      unsubmitted_->erase(unsubmitted_->begin(), unsubmitted_->begin() + static_cast<std::ptrdiff_t>(taken));
      return;
    }
    if (rc == 0 || transient(rc)) return;
    broken_ = rc;
    fail_unsubmitted();
  }

  // Completes every request the kernel does not hold with the ring's error.
  void fail_unsubmitted() {
    for (const unsigned slot : *unsubmitted_) complete(slot, broken_);
    unsubmitted_->clear();
    while (!pending_->empty()) {
      ready_->push_back({pending_->front().request.user_data, broken_, pending_->front().request.total()});
      pending_->pop_front();
    }
  }

  void prepare(io_uring_sqe* sqe, unsigned slot) {
    op& o = slots_[slot];
    const auto offset = static_cast<__u64>(o.request.offset + o.done);
    const unsigned segments = detail::remaining_segments(o.request, o.done, o.iov);
    if (segments == 2) {  // header and data: one vectored request (the iovecs live in the slot)
      if (o.request.write) io_uring_prep_writev(sqe, o.request.fd, o.iov, 2, offset);
      else io_uring_prep_readv(sqe, o.request.fd, o.iov, 2, offset);
      io_uring_sqe_set_data64(sqe, slot);
      return;
    }
    auto* buffer = static_cast<char*>(o.iov[0].iov_base);
    const auto remaining = static_cast<unsigned>(std::min<std::size_t>(o.iov[0].iov_len, 1U << 30));
    const int fixed = registered_index(buffer, remaining);
    if (fixed >= 0) {
      if (o.request.write) io_uring_prep_write_fixed(sqe, o.request.fd, buffer, remaining, offset, fixed);
      else io_uring_prep_read_fixed(sqe, o.request.fd, buffer, remaining, offset, fixed);
    } else if (o.request.write) {
      io_uring_prep_write(sqe, o.request.fd, buffer, remaining, offset);
    } else {
      io_uring_prep_read(sqe, o.request.fd, buffer, remaining, offset);
    }
    io_uring_sqe_set_data64(sqe, slot);
  }

  // The first operation the engine uses that the kernel's io_uring lacks, or null. Kernels
  // before 5.6 set rings up but have neither plain reads and writes nor the probe that says so:
  // every request would fail with EINVAL, where the thread engine would move it.
  const char* missing_operation() {
    static constexpr std::pair<int, const char*> used[] = {
        {IORING_OP_READ, "IORING_OP_READ"},           {IORING_OP_WRITE, "IORING_OP_WRITE"},
        {IORING_OP_READV, "IORING_OP_READV"},         {IORING_OP_WRITEV, "IORING_OP_WRITEV"},
        {IORING_OP_READ_FIXED, "IORING_OP_READ_FIXED"}, {IORING_OP_WRITE_FIXED, "IORING_OP_WRITE_FIXED"}};
    io_uring_probe* probe = faults_.supported ? nullptr : io_uring_get_probe_ring(&ring_);
    if (!faults_.supported && probe == nullptr) return "operation probe (IORING_REGISTER_PROBE)";
    const char* missing = nullptr;
    for (const auto& [opcode, name] : used) {
      const bool has = faults_.supported ? faults_.supported(opcode) : io_uring_opcode_supported(probe, opcode) != 0;
      if (!has) {
        missing = name;
        break;
      }
    }
    if (probe != nullptr) io_uring_free_probe(probe);
    return missing;
  }

  // Index of the registered region holding [p, p + n), or -1.
  int registered_index(const char* p, std::size_t n) const noexcept {
    const auto* b = reinterpret_cast<const std::byte*>(p);
    for (std::size_t i = 0; i < registered_.size(); ++i) {
      const auto& r = registered_[i];
      if (b >= r.data() && b + n <= r.data() + r.size()) return static_cast<int>(i);
    }
    return -1;
  }

  // Reaps completions; blocks for at least `min` of them. A wait error that is not
  // transient means the ring is unusable: every request it holds is reported failed with
  // that error (their buffers may still be written by the kernel until the ring is torn
  // down, which is why the error is reported instead of waited out forever).
  void reap(unsigned min) {
    if (broken_ != 0) {  // every request was reported already; the ring is not read again
      fail_unsubmitted();
      return;
    }
    io_uring_cqe* cqe = nullptr;
    if (min > 0 && in_flight_ > 0) {
      const int rc = faults_.wait ? faults_.wait(&ring_, &cqe) : io_uring_wait_cqe(&ring_, &cqe);
      if (rc < 0 && !transient(rc)) {
        broken_ = rc;
        for (unsigned slot = 0; slot < depth_; ++slot) {
          if (held_by_kernel(slot)) complete(slot, rc);
        }
        in_flight_ = 0;
        retry_->clear();
        fail_unsubmitted();
        return;
      }
    }
    unsigned head = 0;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      finish(static_cast<unsigned>(io_uring_cqe_get_data64(cqe)), faults_.result ? faults_.result(cqe->res) : cqe->res);
    }
    io_uring_cq_advance(&ring_, seen);
    in_flight_ -= seen;
    bool resubmit = false;
    std::size_t kept = 0;
    for (const unsigned slot : *retry_) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) {  // cannot happen (a slot frees an entry); kept for the next reap
        (*retry_)[kept++] = slot;
        continue;
      }
      prepare(sqe, slot);
      unsubmitted_->push_back(slot);
      resubmit = true;
    }
    retry_->resize(kept);
    if (resubmit) submit_queued();
  }

  void finish(unsigned slot, int res) {
    op& o = slots_[slot];
    if (res == -EAGAIN || res == -EINTR) {
      retry_->push_back(slot);
      return;
    }
    if (res == -ECANCELED) {
      // Nothing here cancels a request: io_uring does when it cannot start a kernel worker
      // for one (a buffered write, say) under the user's limit on threads. Moved here
      // instead, by blocking calls, and counted (a pread or pwrite of the same bytes at the
      // same offset is safe to repeat, whatever the kernel had done).
      synchronous_.fetch_add(1, std::memory_order_relaxed);
      complete(slot, detail::transfer_synchronously(o.request, o.done));
      return;
    }
    if (res > 0) {
      o.done += static_cast<std::size_t>(res);
      if (o.done < o.request.total()) {  // short transfer: continue where it stopped
        retry_->push_back(slot);
        return;
      }
    }
    complete(slot, res < 0 ? res : static_cast<std::int64_t>(o.done));
  }

  void complete(unsigned slot, std::int64_t result) {
    const op& o = slots_[slot];
    ready_->push_back({o.request.user_data, result, o.request.total()});
    free_slots_->push_back(slot);
  }

  // A slot the kernel holds: neither free, nor queued, nor waiting for a retry.
  bool held_by_kernel(unsigned slot) const {
    return std::find(free_slots_->begin(), free_slots_->end(), slot) == free_slots_->end() &&
           std::find(unsubmitted_->begin(), unsubmitted_->end(), slot) == unsubmitted_->end();
  }

  static constexpr const char* who = "an io_uring engine";
  detail::fork_guard made_;
  unsigned depth_;
  io_uring ring_{};
  std::vector<op> slots_;
  // Changed by whichever thread submits or waits; left as they are in a forked child (a
  // thread of the parent may have been changing them at the fork).
  detail::unless_forked<std::vector<unsigned>> free_slots_;
  detail::unless_forked<std::vector<unsigned>> retry_;
  detail::unless_forked<std::vector<unsigned>> unsubmitted_;  // prepared in the submission queue, not yet taken
  detail::unless_forked<std::deque<op>> pending_;
  detail::unless_forked<std::vector<io_completion>> ready_;
  unsigned in_flight_ = 0;
  std::size_t outstanding_ = 0;
  std::vector<std::span<std::byte>> registered_;
  detail::uring_faults faults_;
  int broken_ = 0;  // the error that made the ring unusable, or 0
  std::atomic<std::uint64_t> synchronous_{0};  // requests io_uring cancelled, moved by blocking calls
};

}  // namespace

std::unique_ptr<io_engine> make_uring_engine(unsigned queue_depth) {
  return std::make_unique<uring_engine>(queue_depth, detail::uring_faults{});
}

namespace detail {
std::unique_ptr<io_engine> make_uring_engine(unsigned queue_depth, uring_faults faults) {
  return std::make_unique<uring_engine>(queue_depth, std::move(faults));
}
}  // namespace detail

}  // namespace tensormem::io
