// The contiguous arena: (a) bytes moved by minimal-move vs full compaction on the same random
// sequence, (b) compaction throughput next to a plain memmove of the same bytes.
//
//   build/bin/arena_bench
//
// Counters: bytes_moved and defragmentations per policy, moved_ratio (minimal / full);
// GB/s of compaction and of memmove, and their ratio.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "tensormem/arena/contiguous_arena.hpp"
#include "tensormem/memory/host_resource.hpp"

namespace arena = tensormem::arena;
namespace memory = tensormem::memory;

namespace {

arena::arena_stats random_sequence(arena::defrag_policy policy) {
  memory::host_resource host;
  arena::contiguous_arena a(host, std::uint64_t{64} << 20, {.alignment = 256, .policy = policy});
  std::mt19937_64 rng(99);
  std::vector<std::uint64_t> live;
  for (int step = 0; step < 50000; ++step) {
    if (live.empty() || rng() % 100 < 51) {
      const auto bytes = static_cast<std::uint64_t>(std::exp2(std::uniform_real_distribution<double>(10, 20)(rng)));
      try {
        live.push_back(a.allocate(bytes).id);
      } catch (const arena::arena_out_of_memory&) {
        // full: free something instead
        const std::size_t i = rng() % live.size();
        a.release(live[i]);
        live[i] = live.back();
        live.pop_back();
      }
    } else {
      const std::size_t i = rng() % live.size();
      a.release(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
  }
  return a.stats();
}

void bm_bytes_moved(benchmark::State& state) {
  for (auto _ : state) {
    const arena::arena_stats minimal = random_sequence(arena::defrag_policy::minimal_move);
    const arena::arena_stats full = random_sequence(arena::defrag_policy::full_compaction);
    state.counters["minimal_bytes_moved"] = static_cast<double>(minimal.bytes_moved);
    state.counters["full_bytes_moved"] = static_cast<double>(full.bytes_moved);
    state.counters["minimal_defrags"] = static_cast<double>(minimal.defragmentations);
    state.counters["full_defrags"] = static_cast<double>(full.defragmentations);
    state.counters["moved_ratio"] =
        static_cast<double>(minimal.bytes_moved) / static_cast<double>(full.bytes_moved);
  }
}
BENCHMARK(bm_bytes_moved)->Iterations(1)->Unit(benchmark::kMillisecond);

void bm_compaction_throughput(benchmark::State& state) {
  constexpr std::uint64_t mib = 1 << 20;
  constexpr std::uint64_t capacity = 1024 * mib;
  memory::host_resource host;
  std::vector<std::byte> plain(2 * 512 * mib);
  std::memset(plain.data(), 1, plain.size());
  for (auto _ : state) {
    arena::contiguous_arena a(host, capacity, {.policy = arena::defrag_policy::full_compaction});
    std::vector<arena::tensor_block> blocks;
    for (std::uint64_t i = 0; i < capacity / mib; ++i) {
      blocks.push_back(a.allocate(mib));
      std::memset(blocks.back().data(), static_cast<int>(i), mib);
    }
    for (std::size_t i = 0; i < blocks.size(); i += 2) a.release(blocks[i]);
    const auto start = std::chrono::steady_clock::now();
    a.defragment(capacity / 2);
    const auto stop = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(stop - start).count();
    const std::uint64_t moved = a.stats().bytes_moved;
    const auto m0 = std::chrono::steady_clock::now();
    std::memmove(plain.data(), plain.data() + moved, moved);
    const auto m1 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(plain.data());
    const double memmove_seconds = std::chrono::duration<double>(m1 - m0).count();
    state.SetIterationTime(seconds);
    state.counters["bytes_moved"] = static_cast<double>(moved);
    state.counters["compaction_GBps"] = static_cast<double>(moved) / seconds / 1e9;
    state.counters["memmove_GBps"] = static_cast<double>(moved) / memmove_seconds / 1e9;
    state.counters["of_memmove"] = memmove_seconds / seconds;
  }
}
BENCHMARK(bm_compaction_throughput)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
