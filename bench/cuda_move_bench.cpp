// Device moves and device defragmentation against cudaMemcpy (needs a CUDA device).
//   build/bin/cuda_move_bench
//
// cuda_move/<distance>/<direction>: 256 MiB moved by `distance` bytes inside one buffer,
// against one cudaMemcpy of 256 MiB between two buffers, interleaved, medians of 9 (CUDA
// events). chunked/<distance>: the former method (a cudaMemcpy per chunk of the distance)
// on 16 MiB, for the record. arena/<policy>: a 1 GiB device arena filled with random
// tensors (256 B to 16 MiB), every other one released, then defragmented to one hole of
// all the free bytes (either policy then moves every tensor above the first gap): wall time of
// `defragment` (its planning included) against cudaMemcpy of the same tensors, one call
// each, to non-overlapping places.

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_bench_support.hpp"
#include "tensormem/arena/contiguous_arena.hpp"
#include "tensormem/memory/cuda_resources.hpp"

namespace {

using tensormem::memory::cuda_move;

using tensormem::bench::check;
using tensormem::bench::device_ms;
using tensormem::bench::median;
using tensormem::bench::skipped_without_device;

struct device_buffer {
  explicit device_buffer(std::size_t bytes) { check(cudaMalloc(&p, bytes), "cudaMalloc"); }
  ~device_buffer() { cudaFree(p); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  std::byte* get() const { return static_cast<std::byte*>(p); }
  void* p = nullptr;
};

void bm_move(benchmark::State& state, std::size_t distance, bool up) {
  if (skipped_without_device(state)) return;
  constexpr std::size_t bytes = std::size_t{256} << 20;
  device_buffer a(bytes + distance);
  device_buffer b(bytes);
  check(cudaMemset(a.get(), 1, bytes + distance), "cudaMemset");
  std::byte* low = a.get();
  std::byte* high = a.get() + distance;
  for (auto _ : state) {
    std::vector<double> mine;
    std::vector<double> copy;
    try {
      for (int round = 0; round < 9; ++round) {
        copy.push_back(device_ms([&] { check(cudaMemcpy(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy"); }));
        mine.push_back(device_ms([&] { up ? cuda_move(high, low, bytes) : cuda_move(low, high, bytes); }));
      }
    } catch (const std::exception& e) {
      return state.SkipWithError(e.what());
    }
    const double ms = median(mine);
    const double base = median(copy);
    state.SetIterationTime(ms * 1e-3);
    state.counters["GB_per_s"] = static_cast<double>(bytes) / (ms * 1e6);
    state.counters["memcpy_GB_per_s"] = static_cast<double>(bytes) / (base * 1e6);
    state.counters["fraction_of_memcpy"] = base / ms;
  }
}

// The former cuda_move: a cudaMemcpy per chunk of the distance.
void chunked_move(std::byte* d, const std::byte* s, std::size_t bytes) {
  const std::size_t distance = d < s ? static_cast<std::size_t>(s - d) : static_cast<std::size_t>(d - s);
  const std::size_t chunk = std::min(distance, bytes);
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t n = std::min(chunk, bytes - done);
    const std::size_t at = d < s ? done : bytes - done - n;
    check(cudaMemcpy(d + at, s + at, n, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    done += n;
  }
}

void bm_chunked(benchmark::State& state, std::size_t distance) {
  if (skipped_without_device(state)) return;
  constexpr std::size_t bytes = std::size_t{16} << 20;
  device_buffer a(bytes + distance);
  for (auto _ : state) {
    const double ms = device_ms([&] { chunked_move(a.get(), a.get() + distance, bytes); });
    const double mine = device_ms([&] { cuda_move(a.get(), a.get() + distance, bytes); });
    state.SetIterationTime(ms * 1e-3);
    state.counters["GB_per_s"] = static_cast<double>(bytes) / (ms * 1e6);
    state.counters["cuda_move_GB_per_s"] = static_cast<double>(bytes) / (mine * 1e6);
  }
}

void bm_arena(benchmark::State& state, tensormem::arena::defrag_policy policy) {
  if (skipped_without_device(state)) return;
  using namespace tensormem;
  constexpr std::uint64_t capacity = std::uint64_t{1} << 30;
  memory::cuda_device_resource device;
  for (auto _ : state) {
    arena::contiguous_arena a(device, capacity, {.alignment = 256, .policy = policy});
    std::mt19937_64 rng(20261127);
    std::vector<std::uint64_t> ids;
    for (;;) {
      const auto bytes = static_cast<std::uint64_t>(std::exp2(8.0 + 16.0 * static_cast<double>(rng() % 10000) / 10000.0));
      if (a.stats().largest_free_bytes < bytes + 256) break;
      ids.push_back(a.allocate(bytes).id);
    }
    for (std::size_t i = 0; i < ids.size(); i += 2) a.release(ids[i]);
    // What the defragmentation will move, copied tensor by tensor to a separate buffer.
    std::vector<arena::tensor_block> survivors = a.blocks();
    device_buffer other(capacity);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const arena::arena_stats before = a.stats();
    const auto start = std::chrono::steady_clock::now();
    if (!a.defragment(before.free_bytes)) throw std::runtime_error("defragment refused");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const arena::arena_stats after = a.stats();
    const std::uint64_t moved = after.bytes_moved - before.bytes_moved;
    const std::uint64_t moves = after.moves - before.moves;
    // The same bytes by cudaMemcpy: each moved tensor, one call each.
    std::vector<std::uint64_t> sizes;
    for (const arena::tensor_block& b : survivors) {
      if (a.block(b.id).offset != b.offset) sizes.push_back(b.bytes);
    }
    const auto copy_start = std::chrono::steady_clock::now();
    std::uint64_t at = 0;
    for (const std::uint64_t bytes : sizes) {
      check(cudaMemcpyAsync(other.get() + at, a.base() + at, bytes, cudaMemcpyDeviceToDevice, 0), "cudaMemcpyAsync");
      at += (bytes + 255) / 256 * 256;
    }
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const double copy_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - copy_start).count();
    state.SetIterationTime(ms * 1e-3);
    state.counters["tensors_moved"] = static_cast<double>(moves);
    state.counters["MiB_moved"] = static_cast<double>(moved) / (1 << 20);
    state.counters["GB_per_s"] = static_cast<double>(moved) / (ms * 1e6);
    state.counters["memcpy_GB_per_s"] = static_cast<double>(moved) / (copy_ms * 1e6);
    state.counters["fraction_of_memcpy"] = copy_ms / ms;
  }
}

void register_all() {
  for (const std::size_t distance : {std::size_t{256}, std::size_t{1024}, std::size_t{4096}, std::size_t{65536},
                                     std::size_t{192} << 10, std::size_t{256} << 10, std::size_t{1} << 20,
                                     std::size_t{16} << 20, std::size_t{128} << 20}) {
    for (const bool up : {false, true}) {
      benchmark::RegisterBenchmark(("cuda_move/" + std::to_string(distance) + (up ? "/up" : "/down")).c_str(),
                                   [distance, up](benchmark::State& s) { bm_move(s, distance, up); })
          ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
    }
  }
  for (const std::size_t distance : {std::size_t{4096}, std::size_t{65536}, std::size_t{1} << 20}) {
    benchmark::RegisterBenchmark(("chunked/" + std::to_string(distance)).c_str(),
                                 [distance](benchmark::State& s) { bm_chunked(s, distance); })
        ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  }
  for (const auto policy : {tensormem::arena::defrag_policy::full_compaction, tensormem::arena::defrag_policy::minimal_move}) {
    const bool full = policy == tensormem::arena::defrag_policy::full_compaction;
    benchmark::RegisterBenchmark(full ? "arena/full_compaction" : "arena/minimal_move",
                                 [policy](benchmark::State& s) { bm_arena(s, policy); })
        ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) { return tensormem::bench::run_benchmarks(argc, argv, register_all); }
