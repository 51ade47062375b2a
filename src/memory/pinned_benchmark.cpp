#include "tensormem/memory/pinned_benchmark.hpp"

#include <chrono>
#include <cmath>
#include <random>
#include <vector>

#include "tensormem/memory/pinned_host_resource.hpp"
#include "tensormem/memory/pinned_pool.hpp"

namespace tensormem::memory {

pinned_benchmark_result run_pinned_benchmark(const pinned_benchmark_options& o) {
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<double> log_bytes(std::log2(static_cast<double>(o.min_bytes)),
                                                   std::log2(static_cast<double>(o.max_bytes)));
  std::vector<std::size_t> sizes(std::max(o.pool_pairs, o.mlock_pairs));
  for (std::size_t& s : sizes) s = static_cast<std::size_t>(std::exp2(log_bytes(rng)));

  using clock = std::chrono::steady_clock;
  pinned_benchmark_result r;
  const auto locked_before = static_cast<std::int64_t>(process_locked_bytes());
  {
    pinned_pool pool(pool_options{.slab_bytes = o.slab_bytes});
    pool.free(pool.allocate(1));  // the slab is made (and locked) before timing
    const std::uint64_t calls_before = pool.stats().system_calls;
    const auto start = clock::now();
    for (std::size_t i = 0; i < o.pool_pairs; ++i) pool.free(pool.allocate(sizes[i]));
    const auto stop = clock::now();
    r.pool_ns_per_pair = std::chrono::duration<double, std::nano>(stop - start).count() /
                         static_cast<double>(o.pool_pairs);
    r.pool_system_calls = pool.stats().system_calls - calls_before;
  }
  r.locked_bytes_after_release =
      static_cast<std::int64_t>(process_locked_bytes()) - locked_before;

  pinned_host_resource direct;
  const auto start = clock::now();
  for (std::size_t i = 0; i < o.mlock_pairs; ++i) {
    void* p = direct.allocate(sizes[i], 4096);
    direct.deallocate(p, sizes[i], 4096);
  }
  const auto stop = clock::now();
  r.mlock_ns_per_pair = std::chrono::duration<double, std::nano>(stop - start).count() /
                        static_cast<double>(o.mlock_pairs);
  r.mlock_system_calls = direct.stats().system_calls;
  r.speedup = r.pool_ns_per_pair > 0 ? r.mlock_ns_per_pair / r.pool_ns_per_pair : 0;
  return r;
}

}  // namespace tensormem::memory
