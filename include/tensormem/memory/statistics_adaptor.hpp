#pragma once
// Wrappers that watch another resource: statistics, outstanding allocations, trace logging.

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "tensormem/memory/detail/fork_safe_mutex.hpp"
#include "tensormem/memory/memory_resource.hpp"

namespace tensormem::memory {

struct resource_counters {
  std::uint64_t current_bytes = 0;
  std::uint64_t peak_bytes = 0;
  std::uint64_t total_bytes = 0;
  std::uint64_t current_allocations = 0;
  std::uint64_t peak_allocations = 0;
  std::uint64_t total_allocations = 0;
  std::uint64_t total_deallocations = 0;
};

/// Counts bytes and calls (current, peak, total) of the allocations made through it. Thread
/// safety: that of the upstream (its own counters are guarded by a mutex).
class statistics_adaptor final : public memory_resource {
 public:
  explicit statistics_adaptor(memory_resource& upstream) : upstream_(upstream) {}
  resource_counters counters() const;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  memory_kind do_kind() const noexcept override { return upstream_.kind(); }
  bool do_thread_safe() const noexcept override { return upstream_.thread_safe(); }

  memory_resource& upstream_;
  mutable detail::fork_safe_mutex mutex_;
  resource_counters c_;
};

/// Remembers every outstanding allocation (pointer, bytes, sequence number) for leak reports.
/// Thread safety: that of the upstream.
class tracking_adaptor final : public memory_resource {
 public:
  explicit tracking_adaptor(memory_resource& upstream) : upstream_(upstream) {}
  std::size_t outstanding() const;
  std::size_t outstanding_bytes() const;
  /// One line per outstanding allocation, oldest first: "#seq ptr bytes".
  std::string leak_report() const;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  memory_kind do_kind() const noexcept override { return upstream_.kind(); }
  bool do_thread_safe() const noexcept override { return upstream_.thread_safe(); }

  struct record {
    std::size_t bytes;
    std::uint64_t sequence;
  };
  memory_resource& upstream_;
  mutable detail::fork_safe_mutex mutex_;
  std::unordered_map<void*, record> live_;
  std::uint64_t sequence_ = 0;
};

/// Logs every allocation as one buffer of a lifetime trace (`id,lower,upper,size`, the format
/// `tensormem plan` and `tensormem replay` read). Time is the sequence number of allocate and
/// deallocate calls, so lifetimes are half-open [allocation, deallocation). A buffer's line is
/// written when it is freed; `flush()` (and the destructor) writes the ones still live with
/// upper = now + 1. Thread safety: that of the upstream.
class trace_log_adaptor final : public memory_resource {
 public:
  trace_log_adaptor(memory_resource& upstream, std::ostream& out);
  ~trace_log_adaptor() override;
  void flush();

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  memory_kind do_kind() const noexcept override { return upstream_.kind(); }
  bool do_thread_safe() const noexcept override { return upstream_.thread_safe(); }

  struct open_buffer {
    std::uint64_t id;
    std::uint64_t lower;
    std::size_t bytes;
  };
  memory_resource& upstream_;
  std::ostream& out_;
  detail::fork_safe_mutex mutex_;
  std::unordered_map<void*, open_buffer> live_;
  std::uint64_t clock_ = 0;
  std::uint64_t next_id_ = 0;
};

}  // namespace tensormem::memory
