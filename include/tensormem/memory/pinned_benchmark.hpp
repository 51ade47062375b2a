#pragma once
// The measurement behind `tensormem pinned-bench` and bench/pinned_bench.

#include <cstddef>
#include <cstdint>

namespace tensormem::memory {

struct pinned_benchmark_options {
  std::size_t pool_pairs = 20000;   ///< allocate/free pairs through the pool
  std::size_t mlock_pairs = 200;    ///< pairs of one mmap + mlock (+ munmap) each
  std::size_t min_bytes = 4096;     ///< sizes are log-uniform in [min_bytes, max_bytes]
  std::size_t max_bytes = std::size_t{64} << 20;
  std::size_t slab_bytes = std::size_t{64} << 20;
  std::uint64_t seed = 1;
};

struct pinned_benchmark_result {
  double pool_ns_per_pair = 0;
  double mlock_ns_per_pair = 0;
  double speedup = 0;                          ///< mlock / pool
  std::int64_t locked_bytes_after_release = 0; ///< VmLck growth left once the pool is gone
  std::uint64_t pool_system_calls = 0;         ///< made by the pool during its pairs
  std::uint64_t mlock_system_calls = 0;        ///< made by the mapping per pair (mmap, mlock, munmap each)
};

/// Allocate/free pairs of the same size sequence from a pinned_pool (one slab, reused) and
/// from pinned_host_resource (a locked mapping per allocation). The pool's memory is locked
/// once when its slab is made; each per-allocation mapping is populated and locked anew, as
/// pinning a fresh tensor does.
pinned_benchmark_result run_pinned_benchmark(const pinned_benchmark_options& options);

}  // namespace tensormem::memory
