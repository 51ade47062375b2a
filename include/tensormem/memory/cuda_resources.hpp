#pragma once
// CUDA memory resources. Declared always; implemented when tensormem is built with CUDA
// (TENSORMEM_CUDA=AUTO finds the toolkit, ON requires it). `cuda_available()` tells at run
// time whether a device can be used.

#include <string>

#include "tensormem/memory/memory_resource.hpp"

namespace tensormem::memory {

/// True when this build has CUDA support.
bool cuda_built() noexcept;
/// Empty when a CUDA device is usable; otherwise why not ("built without CUDA", "no CUDA
/// device: cudaGetDeviceCount returned ...").
std::string cuda_unavailable_reason();

/// Moves `bytes` of device memory from `src` to `dst`, overlapping or not, like memmove.
/// Ranges that do not overlap take one device-to-device cudaMemcpyAsync; overlapping ones one
/// kernel launch whatever the distance (in elements of up to 16 bytes, as far as both
/// addresses are aligned, and the last few bytes by a second, one-thread launch). A distance
/// that fits in a block's shared memory moves in segments, each block keeping the elements
/// the next block overwrites; a longer one in columns a distance apart, each thread moving
/// its column in order. Ordered on the legacy default stream and, like cudaMemcpy between
/// device addresses, it may return before the bytes have moved. Throws device_unavailable
/// without CUDA and std::runtime_error when a launch or copy fails.
void cuda_move(void* dst, const void* src, std::size_t bytes);

/// Registers [p, p + bytes) of host memory with CUDA (cudaHostRegister, portable to every
/// device), so that copies between it and a device are direct DMA and cudaMemcpyAsync
/// returns without waiting for them. CUDA copies memory it does not know of through its own
/// staging buffers, locked or not. Throws device_unavailable without a usable device and
/// out_of_memory when the driver refuses (the message says why).
void cuda_register_host(void* p, std::size_t bytes);
/// Undoes cuda_register_host (cudaHostUnregister). Never throws.
void cuda_unregister_host(void* p) noexcept;

/// cudaMalloc / cudaFree on the current device. The memory is not host-accessible.
/// Constructing it without a usable device throws device_unavailable. Thread-safe.
class cuda_device_resource final : public memory_resource {
 public:
  cuda_device_resource();

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  memory_kind do_kind() const noexcept override { return memory_kind::cuda_device; }
  bool do_thread_safe() const noexcept override { return true; }
};

/// cudaHostAlloc / cudaFreeHost: page-locked host memory the device can reach directly.
/// Constructing it without a usable device throws device_unavailable. Thread-safe.
class cuda_pinned_resource final : public memory_resource {
 public:
  cuda_pinned_resource();

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  memory_kind do_kind() const noexcept override { return memory_kind::cuda_pinned_host; }
  bool do_thread_safe() const noexcept override { return true; }
};

}  // namespace tensormem::memory
