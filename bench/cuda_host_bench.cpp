// Host memory and the device (needs a CUDA device).
//   build/bin/cuda_host_bench
//
// copy/<memory>/<direction>: 256 MiB between host memory and the device with
// cudaMemcpyAsync, medians of 5 (CUDA events around the copy and the wait), from memory that
// is pageable (a touched std::vector), locked only (pinned_host_resource), locked and
// registered with CUDA (pinned_host_resource with register_with_cuda) and cudaHostAlloc'd
// (cuda_pinned_resource).
// allocate/<what>: one allocation and its release, 1 MiB: a registered pinned_pool against
// cudaHostAlloc/cudaFreeHost, and a device arena against cudaMalloc/cudaFree.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_bench_support.hpp"
#include "tensormem/arena/contiguous_arena.hpp"
#include "tensormem/memory/cuda_resources.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"
#include "tensormem/memory/pinned_pool.hpp"

namespace {

using namespace tensormem;

using bench::check;
using bench::skipped_without_device;

constexpr std::size_t copy_bytes = std::size_t{256} << 20;

enum class host_memory { pageable, locked, registered, cuda_host_alloc };

void bm_copy(benchmark::State& state, host_memory kind, bool to_device) {
  if (skipped_without_device(state)) return;
  std::vector<std::byte> pageable;
  std::unique_ptr<memory::memory_resource> resource;
  std::byte* host = nullptr;
  if (kind == host_memory::pageable) {
    pageable.assign(copy_bytes, std::byte{1});
    host = pageable.data();
  } else {
    if (kind == host_memory::cuda_host_alloc) resource = std::make_unique<memory::cuda_pinned_resource>();
    else resource = std::make_unique<memory::pinned_host_resource>(
        memory::pinned_options{.register_with_cuda = kind == host_memory::registered});
    host = static_cast<std::byte*>(resource->allocate(copy_bytes, 4096));
    std::memset(host, 1, copy_bytes);
  }
  void* device = nullptr;
  check(cudaMalloc(&device, copy_bytes), "cudaMalloc");
  for (auto _ : state) {
    std::vector<double> ms;
    for (int round = 0; round < 5; ++round) {
      ms.push_back(bench::device_ms([&] {
        if (to_device) check(cudaMemcpyAsync(device, host, copy_bytes, cudaMemcpyHostToDevice, 0), "cudaMemcpyAsync");
        else check(cudaMemcpyAsync(host, device, copy_bytes, cudaMemcpyDeviceToHost, 0), "cudaMemcpyAsync");
      }));
    }
    const double median_ms = bench::median(ms);
    state.SetIterationTime(median_ms * 1e-3);
    state.counters["GB_per_s"] = static_cast<double>(copy_bytes) / (median_ms * 1e6);
  }
  cudaFree(device);
  if (resource) resource->deallocate(host, copy_bytes, 4096);
}

constexpr std::size_t small_bytes = std::size_t{1} << 20;

void bm_pool(benchmark::State& state) {
  if (skipped_without_device(state)) return;
  memory::pinned_pool pool(memory::pool_options{.register_with_cuda = true});
  pool.free(pool.allocate(small_bytes));  // the slab exists from here on, as in a running engine
  for (auto _ : state) {
    void* p = pool.allocate(small_bytes);
    benchmark::DoNotOptimize(p);
    pool.free(p);
  }
}

void bm_cuda_host_alloc(benchmark::State& state) {
  if (skipped_without_device(state)) return;
  for (auto _ : state) {
    void* p = nullptr;
    check(cudaHostAlloc(&p, small_bytes, cudaHostAllocPortable), "cudaHostAlloc");
    benchmark::DoNotOptimize(p);
    check(cudaFreeHost(p), "cudaFreeHost");
  }
}

void bm_device_arena(benchmark::State& state) {
  if (skipped_without_device(state)) return;
  memory::cuda_device_resource device;
  arena::contiguous_arena a(device, std::uint64_t{1} << 30, {});
  for (auto _ : state) {
    const arena::tensor_block b = a.allocate(small_bytes);
    benchmark::DoNotOptimize(b.data());
    a.release(b.id);
  }
}

void bm_cuda_malloc(benchmark::State& state) {
  if (skipped_without_device(state)) return;
  for (auto _ : state) {
    void* p = nullptr;
    check(cudaMalloc(&p, small_bytes), "cudaMalloc");
    benchmark::DoNotOptimize(p);
    check(cudaFree(p), "cudaFree");
  }
}

void register_all() {
  const std::pair<host_memory, const char*> kinds[] = {{host_memory::pageable, "pageable"},
                                                       {host_memory::locked, "locked"},
                                                       {host_memory::registered, "registered"},
                                                       {host_memory::cuda_host_alloc, "cuda_host_alloc"}};
  for (const auto& [kind, name] : kinds) {
    for (const bool to_device : {true, false}) {
      benchmark::RegisterBenchmark((std::string("copy/") + name + (to_device ? "/to_device" : "/to_host")).c_str(),
                                   [kind, to_device](benchmark::State& s) { bm_copy(s, kind, to_device); })
          ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::RegisterBenchmark("allocate/pinned_pool_registered", bm_pool);
  benchmark::RegisterBenchmark("allocate/cudaHostAlloc", bm_cuda_host_alloc);
  benchmark::RegisterBenchmark("allocate/device_arena", bm_device_arena);
  benchmark::RegisterBenchmark("allocate/cudaMalloc", bm_cuda_malloc);
}

}  // namespace

int main(int argc, char** argv) { return tensormem::bench::run_benchmarks(argc, argv, register_all); }
