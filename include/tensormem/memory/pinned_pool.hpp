#pragma once
// A pool of page-locked host memory: large locked slabs sub-allocated in O(1).

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensormem/core/tlsf_allocator.hpp"
#include "tensormem/memory/dtype.hpp"
#include "tensormem/memory/memory_resource.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"

namespace tensormem::memory {

struct pool_options {
  /// Size of a slab; an allocation larger than this gets a slab of its own.
  std::size_t slab_bytes = std::size_t{64} << 20;
  /// Cap on the bytes of all slabs together; beyond it allocate throws out_of_memory.
  std::size_t max_locked_bytes = std::numeric_limits<std::size_t>::max();
  /// Granularity and least alignment of every allocation (a power of two, at most a page).
  std::size_t alignment = 256;
  /// Hand out unlocked slabs instead of failing when RLIMIT_MEMLOCK is reached (reported in
  /// the stats as unlocked_fallbacks).
  bool allow_unlocked_fallback = false;
  /// Register every slab with CUDA (pinned_options::register_with_cuda): device copies from
  /// and to pool memory are then direct and asynchronous. Needs a CUDA device.
  bool register_with_cuda = false;
};

struct pool_stats {
  std::uint64_t slabs = 0;
  std::uint64_t slab_bytes = 0;          ///< bytes of all slabs (locked or fallback)
  std::uint64_t locked_bytes = 0;        ///< bytes of slabs actually locked
  std::uint64_t in_use_bytes = 0;        ///< bytes held by live allocations (rounded)
  std::uint64_t peak_in_use_bytes = 0;
  std::uint64_t allocations = 0;         ///< live allocations
  std::uint64_t total_allocations = 0;   ///< allocations made since construction
  std::uint64_t system_calls = 0;        ///< mmap/mlock/munmap calls made for slabs
  std::uint64_t unlocked_fallbacks = 0;  ///< slabs handed out unlocked
  std::uint64_t registered_bytes = 0;    ///< bytes of slabs registered with CUDA
  /// The size new shared slabs are made at: `slab_bytes`, or less once the memory-lock limit
  /// refused a slab of that size (halved until one could be locked).
  std::uint64_t current_slab_bytes = 0;
};

/// DeepSpeed-style pinned tensor memory, pooled. Slabs of `slab_bytes` are mapped and locked
/// by a pinned_host_resource and sub-allocated with the O(1) tlsf_allocator, so an
/// allocation that fits in an existing slab makes no system call. Empty standard slabs are
/// kept for reuse until `trim()`; a slab made for one oversized allocation is released when
/// that allocation is freed. The destructor releases every slab, live allocations included
/// (their pointers dangle afterwards). Thread-safe: one mutex guards the pool, and fork()
/// waits for a thread inside it (detail::fork_safe_mutex), so a child never inherits it held.
/// A slab is mapped and locked (and unmapped) with the lock let go: other threads allocate
/// from the existing slabs and free meanwhile.
/// In a child forked after the pool was made its memory is not locked (memory locks do not
/// pass to a child): `allocate` throws forked_child_error there, while buffers from before
/// the fork can still be used and freed, and `stats` reports no locked or registered bytes.
///
/// Under a memory-lock limit (RLIMIT_MEMLOCK without CAP_IPC_LOCK: 8 MiB for most users) a
/// shared slab the limit refuses is tried again at half the size, down to the pages of the
/// request, and later shared slabs are made at the size that was locked
/// (`pool_stats::current_slab_bytes`): an allocation the limit leaves room for succeeds,
/// locked. One that does not fit throws lock_limit_error naming its own size, or, with
/// `allow_unlocked_fallback`, gets a slab of its own size unlocked.
class pinned_pool final : public memory_resource {
 public:
  explicit pinned_pool(pool_options options = {});
  ~pinned_pool() override;

  using memory_resource::allocate;
  /// `elements` elements of `type`; throws out_of_memory (lock_limit_error when locking fails).
  void* allocate(std::size_t elements, dtype type);
  /// Frees a pointer this pool handed out. Returns false, changing nothing, for a pointer it
  /// does not own or one already freed.
  bool free(void* p) noexcept;
  /// True when `p` is a live allocation of this pool.
  bool owns(const void* p) const;
  /// Releases empty slabs.
  void trim() noexcept;
  pool_stats stats() const;
  const pool_options& options() const noexcept { return options_; }

 private:
  struct slab {
    std::byte* base = nullptr;
    std::size_t bytes = 0;
    bool dedicated = false;
    core::tlsf_allocator offsets;
    slab(std::byte* b, std::size_t n, bool d, std::size_t alignment)
        : base(b), bytes(n), dedicated(d), offsets(n, alignment) {}
  };
  struct live {
    slab* owner;
    core::allocation where;
  };

  using pool_lock = std::unique_lock<detail::fork_safe_mutex>;

  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  memory_kind do_kind() const noexcept override { return memory_kind::pinned_host; }
  bool do_thread_safe() const noexcept override { return true; }
  slab& add_slab(pool_lock& lock, std::size_t bytes, bool dedicated,
                 bool locked_only = false);
  std::pair<slab*, core::allocation> place(pool_lock& lock, std::size_t need, bool& made);
  void detach_slab(slab* s) noexcept;
  void unmap_slab(slab* s) noexcept;

  pool_options options_;
  pinned_host_resource upstream_;
  detail::fork_record made_;
  mutable detail::fork_safe_mutex mutex_;
  std::vector<std::unique_ptr<slab>> slabs_;
  std::unordered_map<const void*, live> live_;
  std::uint64_t slab_bytes_total_ = 0;
  std::uint64_t mapping_bytes_ = 0;  // of slabs being mapped by allocate, outside the lock
  std::size_t slab_size_ = 0;  // of new shared slabs: options_.slab_bytes, halved by the lock limit
  std::uint64_t in_use_ = 0;
  std::uint64_t peak_in_use_ = 0;
  std::uint64_t total_allocations_ = 0;
};

}  // namespace tensormem::memory
