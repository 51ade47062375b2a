// CUDA resources, compiled by nvcc when the toolkit is found.

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "tensormem/memory/cuda_resources.hpp"
#include "tensormem/memory/errors.hpp"

namespace tensormem::memory {

namespace {

std::string error_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

void require_device() {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) throw device_unavailable(why);
}

std::size_t round_up(std::size_t bytes, std::size_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

}  // namespace

bool cuda_built() noexcept { return true; }

std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return "no CUDA device: cudaGetDeviceCount returned " + error_text(e);
  if (count == 0) return "no CUDA device: cudaGetDeviceCount found 0 devices";
  return {};
}

void cuda_move(void* dst, const void* src, std::size_t bytes) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  if (d == s || bytes == 0) return;
  const std::size_t distance = d < s ? static_cast<std::size_t>(s - d) : static_cast<std::size_t>(d - s);
  const std::size_t chunk = distance < bytes ? distance : bytes;
  // Forward when moving down, backward when moving up: no chunk overlaps its source.
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t n = chunk < bytes - done ? chunk : bytes - done;
    const std::size_t at = d < s ? done : bytes - done - n;
    const cudaError_t e = cudaMemcpy(d + at, s + at, n, cudaMemcpyDeviceToDevice);
    if (e != cudaSuccess) throw std::runtime_error("cuda_move: " + error_text(e));
    done += n;
  }
}

cuda_device_resource::cuda_device_resource() { require_device(); }

void* cuda_device_resource::do_allocate(std::size_t bytes, std::size_t alignment) {
  // cudaMalloc aligns to at least 256 bytes; larger alignments are over-allocated and the
  // pointer is not adjusted, so they are refused instead.
  if (alignment > 256) {
    throw std::invalid_argument("cuda_device_resource: alignment " + std::to_string(alignment) +
                                " above 256 is not supported");
  }
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, round_up(bytes, 256));
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw out_of_memory("cuda_device_resource: cudaMalloc of " + std::to_string(bytes) +
                        " bytes failed: " + error_text(e));
  }
  return p;
}

void cuda_device_resource::do_deallocate(void* p, std::size_t, std::size_t) noexcept {
  cudaFree(p);
}

cuda_pinned_resource::cuda_pinned_resource() { require_device(); }

void* cuda_pinned_resource::do_allocate(std::size_t bytes, std::size_t alignment) {
  if (alignment > 4096) {
    throw std::invalid_argument("cuda_pinned_resource: alignment " + std::to_string(alignment) +
                                " above 4096 is not supported");
  }
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, round_up(bytes, 4096), cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw out_of_memory("cuda_pinned_resource: cudaHostAlloc of " + std::to_string(bytes) +
                        " bytes failed: " + error_text(e));
  }
  return p;
}

void cuda_pinned_resource::do_deallocate(void* p, std::size_t, std::size_t) noexcept {
  cudaFreeHost(p);
}

}  // namespace tensormem::memory
