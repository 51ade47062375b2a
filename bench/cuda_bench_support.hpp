#pragma once
// Helpers shared by the benchmarks that need a CUDA device.

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "tensormem/memory/cuda_resources.hpp"

namespace tensormem::bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// True, with the reason reported as the case's error, when no CUDA device can be used.
inline bool skipped_without_device(benchmark::State& state) {
  const std::string why = memory::cuda_unavailable_reason();
  if (why.empty()) return false;
  state.SkipWithError(why.c_str());
  return true;
}

/// Device milliseconds of f(), between two events on the legacy default stream.
template <class F>
double device_ms(F&& f) {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  check(cudaEventRecord(start, 0), "cudaEventRecord");
  f();
  check(cudaEventRecord(stop, 0), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace tensormem::bench
