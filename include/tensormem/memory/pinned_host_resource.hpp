#pragma once
// Page-locked host memory: mmap + mlock, one mapping per allocation.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_set>

#include "tensormem/memory/detail/fork_safe_mutex.hpp"
#include "tensormem/memory/memory_resource.hpp"

namespace tensormem::memory {

struct pinned_options {
  /// When locking fails (RLIMIT_MEMLOCK), hand out the memory unlocked instead of throwing
  /// lock_limit_error. Every such fallback is counted in `pinned_stats::unlocked_fallbacks`.
  bool allow_unlocked_fallback = false;
  /// Also register every mapping with CUDA (cudaHostRegister), so that copies between it
  /// and a device are direct and asynchronous: CUDA copies memory it does not know of
  /// through its own staging buffers, locked or not. Needs a usable CUDA device: the
  /// constructor throws device_unavailable, saying why, when there is none.
  bool register_with_cuda = false;
};

struct pinned_stats {
  std::uint64_t mappings = 0;            ///< live mappings
  std::uint64_t mapped_bytes = 0;        ///< bytes mapped (page-rounded), locked or not
  std::uint64_t locked_bytes = 0;        ///< bytes currently locked
  std::uint64_t system_calls = 0;        ///< mmap + mlock + munmap calls made so far
  std::uint64_t unlocked_fallbacks = 0;  ///< allocations handed out unlocked
  std::uint64_t registered_bytes = 0;    ///< bytes currently registered with CUDA
};

/// Page-locked host memory, suitable for O_DIRECT I/O; for fast device copies set
/// `register_with_cuda` (locked memory CUDA does not know of copies no faster than pageable
/// memory: docs/BENCHMARKS.md, "Host memory and the device"). Each
/// allocation is its own anonymous mapping, populated (MAP_POPULATE) and locked (mlock);
/// sizes round up to whole pages and pointers are page-aligned at least (4096 bytes, or the
/// requested alignment if larger). One allocation costs several system calls: use
/// pinned_pool for many small ones. Thread-safe. In a child forked after it was made,
/// `allocate` throws forked_child_error (none of its memory is locked there); deallocating
/// still works, without a CUDA call.
///
/// When mlock fails (RLIMIT_MEMLOCK reached without CAP_IPC_LOCK), allocate throws
/// lock_limit_error naming the bytes asked, the limit and how to raise it, unless
/// `allow_unlocked_fallback` is set.
class pinned_host_resource final : public memory_resource {
 public:
  explicit pinned_host_resource(pinned_options options = {});
  /// As `allocate`, but never unlocked: where locking is refused it throws lock_limit_error
  /// even with `allow_unlocked_fallback` (a caller that can do with less asks for less).
  /// Freed by `deallocate`.
  void* allocate_locked(std::size_t bytes, std::size_t alignment);
  pinned_stats stats() const noexcept;
  static std::size_t page_bytes() noexcept;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void* map_and_lock(std::size_t bytes, std::size_t alignment, bool may_fall_back);
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  memory_kind do_kind() const noexcept override { return memory_kind::pinned_host; }
  bool do_thread_safe() const noexcept override { return true; }

  pinned_options options_;
  detail::fork_record made_;
  std::atomic<std::uint64_t> mappings_{0};
  std::atomic<std::uint64_t> mapped_bytes_{0};
  std::atomic<std::uint64_t> locked_bytes_{0};
  std::atomic<std::uint64_t> system_calls_{0};
  std::atomic<std::uint64_t> unlocked_fallbacks_{0};
  std::atomic<std::uint64_t> registered_bytes_{0};
  // Mappings handed out unlocked (fallback only; usually empty).
  detail::fork_safe_mutex unlocked_mutex_;
  std::unordered_set<void*> unlocked_;
  std::atomic<std::uint64_t> unlocked_live_{0};
};

/// RLIMIT_MEMLOCK's soft limit in bytes (SIZE_MAX when unlimited).
std::size_t memlock_limit_bytes() noexcept;
/// The memory this process can have, in bytes: the machine's physical memory, or the limit
/// of the process's memory cgroup (a container's, v1 or v2, the lowest over its ancestors)
/// where that is lower; SIZE_MAX when neither can be read. Read once, on the first call. No
/// request for more locked memory than this can succeed, and a process that touches more is
/// ended by the kernel's out-of-memory killer, not refused.
std::size_t physical_memory_bytes() noexcept;
/// What `count` items of about `bytes_each` bytes would need, where that is more than
/// `memory` bytes.
struct memory_shortfall {
  std::uint64_t need_bytes;    ///< count x bytes_each, UINT64_MAX where that overflows
  std::uint64_t memory_bytes;  ///< the memory they were judged against
};
/// The shortfall of `count` items of `bytes_each` bytes against `memory` bytes; nullopt when
/// they fit, when `memory` is SIZE_MAX (unknown) or when `bytes_each` is 0.
std::optional<memory_shortfall> shortfall_against(std::size_t count, std::uint64_t bytes_each,
                                                  std::size_t memory) noexcept;
/// The same against physical_memory_bytes(). The command line and the Python module refuse
/// a plan or a replay with it before making its buffers, so that a job too large for the
/// process fails with an error instead of being ended by the out-of-memory killer.
std::optional<memory_shortfall> memory_shortfall_for(std::size_t count, std::uint64_t bytes_each) noexcept;
/// The lowest memory limit of this process's cgroup and its ancestors (UINT64_MAX when there
/// is none or it cannot be read). Read once, on the first call.
std::uint64_t cgroup_memory_limit_bytes() noexcept;
/// What this process's cgroup and its ancestors leave for new allocations now: the lowest
/// limit less usage, the inactive file cache counted as free (the kernel reclaims it
/// first), as detail::cgroup_memory_available reads it. UINT64_MAX where no cgroup has a
/// limit or it cannot be read. Read on every call (the usage changes).
std::uint64_t cgroup_memory_available_bytes() noexcept;
/// VmLck of this process from /proc/self/status, in bytes (0 if it cannot be read).
std::size_t process_locked_bytes();

}  // namespace tensormem::memory
