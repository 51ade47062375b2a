// Pinned memory: allocate/free pairs of 4 KiB-64 MiB from the pool vs one mmap+mlock each.
//
//   build/bin/pinned_bench
//
// Counters: ns_per_pair for each, speedup, locked_bytes_after_release.

#include <benchmark/benchmark.h>

#include "tensormem/memory/pinned_benchmark.hpp"

namespace {

void bm_pinned(benchmark::State& state) {
  for (auto _ : state) {
    const auto r = tensormem::memory::run_pinned_benchmark({});
    state.SetIterationTime(r.pool_ns_per_pair * 1e-9);
    state.counters["pool_ns_per_pair"] = r.pool_ns_per_pair;
    state.counters["mlock_ns_per_pair"] = r.mlock_ns_per_pair;
    state.counters["speedup"] = r.speedup;
    state.counters["locked_bytes_after_release"] = static_cast<double>(r.locked_bytes_after_release);
    state.counters["pool_system_calls"] = static_cast<double>(r.pool_system_calls);
    state.counters["mlock_system_calls"] = static_cast<double>(r.mlock_system_calls);
  }
}
BENCHMARK(bm_pinned)->UseManualTime()->Iterations(3)->Unit(benchmark::kNanosecond);

}  // namespace

BENCHMARK_MAIN();
