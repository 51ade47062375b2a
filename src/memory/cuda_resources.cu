// CUDA resources, compiled by nvcc when the toolkit is found.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

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

// Overlapping moves. In "virtual" element indices v (v for a move down, n - 1 - v for a
// move up) every overlapping move is a move down by e elements: dst[v] = src[v - e] holds
// the same memory, so writing dst[v] destroys source element v - e. Both kernels only
// write an element after every source element it destroys has been read.
namespace {

template <bool Down>
__device__ __forceinline__ std::size_t physical(std::size_t v, std::size_t n) {
  return Down ? v : n - 1 - v;
}

// Segments of `seg` elements, one per block, taken in the order blocks start (a ticket), so
// that the block before a block has always started. A block first copies the last e
// elements of its segment (those the next block's writes destroy) into shared memory and
// raises its flag; it then waits for the flag of the block before it (whose last e
// elements its own first writes destroy), and moves its segment tile by tile, forward:
// a tile's writes destroy only elements of that tile (read before the barrier) or of
// earlier tiles. The block that takes a launch's last ticket sets the counter back to zero
// for the next launch (launches run one after another: see segment_state). A flag holds the
// number of the launch (its epoch) that raised it last, so flags are never cleared.
constexpr unsigned segment_threads = 1024;
constexpr std::size_t most_segments = std::size_t{1} << 16;
__device__ unsigned segment_tickets = 0;
__device__ unsigned long long segment_flags[most_segments];
constexpr unsigned segment_unroll = 4;
constexpr std::size_t segment_tile = std::size_t{segment_threads} * segment_unroll;

template <class T, bool Down>
__global__ void __launch_bounds__(segment_threads) move_segments(T* dst, const T* src, std::size_t n,
                                                                 std::size_t e, std::size_t seg,
                                                                 unsigned long long epoch) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* halo = reinterpret_cast<T*>(shared_bytes);
  __shared__ unsigned ticket;
  if (threadIdx.x == 0) {
    ticket = atomicAdd(&segment_tickets, 1U);
    if (ticket == gridDim.x - 1) atomicExch(&segment_tickets, 0U);  // every block has its ticket
  }
  __syncthreads();
  const unsigned b = ticket;
  const std::size_t lo = std::size_t{b} * seg;
  const std::size_t hi = lo + seg < n ? lo + seg : n;
  const std::size_t halo_lo = hi == n ? n : hi - e;  // the last block's tail is destroyed by no one
  for (std::size_t i = halo_lo + threadIdx.x; i < hi; i += blockDim.x) {
    halo[i - halo_lo] = src[physical<Down>(i, n)];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicExch(&segment_flags[b], epoch);
    if (b > 0) {
      while (*static_cast<volatile unsigned long long*>(&segment_flags[b - 1]) != epoch) __nanosleep(64);
    }
    __threadfence();
  }
  __syncthreads();
  for (std::size_t tile = lo; tile < hi; tile += segment_tile) {
    T v[segment_unroll];
#pragma unroll
    for (unsigned k = 0; k < segment_unroll; ++k) {
      const std::size_t i = tile + std::size_t{k} * blockDim.x + threadIdx.x;
      if (i < hi) v[k] = i >= halo_lo ? halo[i - halo_lo] : src[physical<Down>(i, n)];
    }
    __syncthreads();
#pragma unroll
    for (unsigned k = 0; k < segment_unroll; ++k) {
      const std::size_t i = tile + std::size_t{k} * blockDim.x + threadIdx.x;
      if (i < hi) dst[physical<Down>(i, n)] = v[k];
    }
  }
}

// Columns: for a distance too long to keep in shared memory. Thread c owns the elements
// c, c + e, c + 2e... and moves them in that order, so each write destroys an element the
// same thread has already read; no two threads touch the same element.
// Each thread keeps `Unroll` elements of its column in flight: 16 for long columns, 4 when
// the distance is so long that a column holds only a few elements (the registers of 16
// would then cost occupancy for nothing).
constexpr unsigned column_threads = 256;

template <class T, bool Down, unsigned column_unroll>
__global__ void __launch_bounds__(column_threads) move_columns(T* dst, const T* src, std::size_t n,
                                                               std::size_t e) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t c = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; c < e; c += stride) {
    for (std::size_t first = c; first < n; first += column_unroll * e) {
      T v[column_unroll];
#pragma unroll
      for (unsigned k = 0; k < column_unroll; ++k) {
        const std::size_t i = first + k * e;
        if (i < n) v[k] = src[physical<Down>(i, n)];
      }
#pragma unroll
      for (unsigned k = 0; k < column_unroll; ++k) {
        const std::size_t i = first + k * e;
        if (i < n) dst[physical<Down>(i, n)] = v[k];
      }
    }
  }
}

// The few bytes after the last whole element, by one thread, in the safe direction.
__global__ void move_tail(unsigned char* dst, const unsigned char* src, std::size_t bytes) {
  if (dst < src) {
    for (std::size_t i = 0; i < bytes; ++i) dst[i] = src[i];
  } else {
    for (std::size_t i = bytes; i-- > 0;) dst[i] = src[i];
  }
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("cuda_move: ") + what + ": " + error_text(e));
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("cuda_move: ") + what + ": " + error_text(e));
  }
}

// What the segment kernel needs per device: the shared memory a block may take (the
// opt-in limit less the kernel's own, capped) and the next launch's epoch, above every flag
// on the device. Moves run on the legacy default stream, so a device's launches run one
// after another in the order they were made; the mutex makes that the order of the epochs.
// Nothing here depends on the module's memory staying as it was: after cudaDeviceReset the
// flags are zero and the epochs go on above them.
struct segment_state {
  bool ready = false;
  std::size_t halo_limit = 0;
  unsigned long long epoch = 0;
};
std::mutex segment_mutex;
std::vector<segment_state> segment_states;

segment_state& current_segment_state() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  if (segment_states.size() <= static_cast<std::size_t>(device)) segment_states.resize(device + 1);
  segment_state& state = segment_states[device];
  if (!state.ready) {
    int optin = 0;
    check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
          "cudaDeviceGetAttribute");
    constexpr std::size_t cap = std::size_t{192} << 10;
    const std::size_t usable = optin > 1024 ? static_cast<std::size_t>(optin) - 1024 : 0;
    state.halo_limit = usable < cap ? usable : cap;
    unsigned long long highest = 0;  // module memory starts at zero; this does not rely on it
    std::vector<unsigned long long> flags(most_segments);
    check(cudaMemcpyFromSymbol(flags.data(), segment_flags, sizeof(unsigned long long) * most_segments),
          "cudaMemcpyFromSymbol");
    for (const unsigned long long f : flags) highest = f > highest ? f : highest;
    state.epoch = highest + 1;
    state.ready = true;
  }
  return state;
}

template <class T, bool Down>
void move_elements(T* dst, const T* src, std::size_t n, std::size_t e) {
  const std::size_t halo_bytes = e * sizeof(T);
  const std::lock_guard<std::mutex> lock(segment_mutex);
  segment_state& state = current_segment_state();
  if (halo_bytes <= state.halo_limit) {
    std::size_t seg = e > 4 * segment_tile ? e : 4 * segment_tile;
    seg = (seg + segment_tile - 1) / segment_tile * segment_tile;
    if ((n + seg - 1) / seg > most_segments) {
      seg = ((n + most_segments - 1) / most_segments + segment_tile - 1) / segment_tile * segment_tile;
    }
    const std::size_t blocks = (n + seg - 1) / seg;
    // Above 48 KiB of shared memory (the kernel's own included) a launch needs the opt-in.
    if (halo_bytes > 32 * 1024) {
      check(cudaFuncSetAttribute(move_segments<T, Down>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(halo_bytes)),
            "cudaFuncSetAttribute");
    }
    move_segments<T, Down><<<static_cast<unsigned>(blocks), segment_threads, halo_bytes, 0>>>(
        dst, src, n, e, seg, state.epoch);
    check_launch("segment kernel");
    ++state.epoch;
  } else {
    const std::size_t wanted = (e + column_threads - 1) / column_threads;
    const unsigned blocks = static_cast<unsigned>(wanted < 65535 ? wanted : 65535);
    if (n / e >= 16) move_columns<T, Down, 16><<<blocks, column_threads, 0, 0>>>(dst, src, n, e);
    else move_columns<T, Down, 4><<<blocks, column_threads, 0, 0>>>(dst, src, n, e);
    check_launch("column kernel");
  }
}

template <class T>
void move_elements(void* dst, const void* src, std::size_t n, std::size_t e, bool down) {
  if (down) move_elements<T, true>(static_cast<T*>(dst), static_cast<const T*>(src), n, e);
  else move_elements<T, false>(static_cast<T*>(dst), static_cast<const T*>(src), n, e);
}

}  // namespace

void cuda_move(void* dst, const void* src, std::size_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  if (d == s || bytes == 0) return;
  const bool down = d < s;
  const std::size_t distance = down ? static_cast<std::size_t>(s - d) : static_cast<std::size_t>(d - s);
  if (distance >= bytes) {
    check(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDeviceToDevice, 0), "cudaMemcpyAsync");
    return;
  }
  // The widest element (up to 16 bytes) that both addresses are aligned to; the bytes
  // after the last whole element move on their own, after the body when moving down
  // (the body's writes stay below them) and before it when moving up.
  const auto bits = reinterpret_cast<std::uintptr_t>(d) | reinterpret_cast<std::uintptr_t>(s) | 16U;
  const std::size_t width = bits & (~bits + 1U);
  const std::size_t n = bytes / width;
  const std::size_t body = n * width;
  const auto tail = [&] {
    if (body == bytes) return;
    move_tail<<<1, 1, 0, 0>>>(d + body, s + body, bytes - body);
    check_launch("tail kernel");
  };
  if (!down) tail();
  if (n != 0) {
    const std::size_t e = distance / width;
    switch (width) {
      case 16: move_elements<uint4>(d, s, n, e, down); break;
      case 8: move_elements<unsigned long long>(d, s, n, e, down); break;
      case 4: move_elements<unsigned>(d, s, n, e, down); break;
      case 2: move_elements<unsigned short>(d, s, n, e, down); break;
      default: move_elements<unsigned char>(d, s, n, e, down); break;
    }
  }
  if (down) tail();
}

void cuda_register_host(void* p, std::size_t bytes) {
  require_device();
  const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw out_of_memory("cudaHostRegister of " + std::to_string(bytes) + " bytes failed: " + error_text(e));
  }
}

void cuda_unregister_host(void* p) noexcept {
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
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
