// The CUDA paths on a real device, each against a host oracle: device moves against
// std::memmove, an arena of device memory through defragmentations against the patterns
// written into it, and cudaMalloc's failure. Without a device (or a build without CUDA)
// every case skips and says why.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "tensormem/arena/contiguous_arena.hpp"
#include "tensormem/memory/cuda_resources.hpp"
#include "tensormem/memory/errors.hpp"
#include "tensormem/memory/host_resource.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"
#include "tensormem/memory/pinned_pool.hpp"

#ifdef TENSORMEM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace tensormem::memory {
namespace {

std::byte pattern(std::uint64_t key, std::uint64_t i) {
  return static_cast<std::byte>((key * 131 + i * 7 + (i >> 8)) & 0xff);
}

using put_bytes = void (*)(void* dst, const void* src, std::size_t bytes);
using get_bytes = std::vector<std::byte> (*)(const void* src, std::size_t bytes);

// Random allocations (up to a sixth of the arena) and releases that keep it about four fifths
// full, with both policies: after every defragmentation (and every 25 steps) each live
// tensor's bytes are read back through `get` and compared with the pattern `put` wrote, and
// each bound observer must have been told the tensor's current place.
void check_arena_contents(memory_resource& resource, put_bytes put, get_bytes get) {
  for (const arena::defrag_policy policy :
       {arena::defrag_policy::minimal_move, arena::defrag_policy::full_compaction}) {
    constexpr std::uint64_t capacity = std::uint64_t{1} << 20;
    arena::contiguous_arena a(resource, capacity, {.alignment = 256, .policy = policy});
    std::map<std::uint64_t, std::uint64_t> live;  // id -> bytes
    std::map<std::uint64_t, std::byte*> told;     // id -> where its observer was last told
    std::mt19937_64 rng(policy == arena::defrag_policy::minimal_move ? 7 : 8);
    std::uint64_t defragmentations_seen = 0;
    for (int step = 0; step < 2000; ++step) {
      const arena::arena_stats s = a.stats();
      const std::uint64_t bytes = 1 + rng() % (capacity / 6);
      if (!live.empty() && (rng() % 100 < 30 || bytes > s.free_bytes || s.free_bytes < capacity / 5)) {
        auto it = live.begin();
        std::advance(it, static_cast<long>(rng() % live.size()));
        a.release(it->first);
        told.erase(it->first);
        live.erase(it);
      } else {
        const arena::tensor_block b = a.allocate(bytes);
        std::vector<std::byte> host(bytes);
        for (std::uint64_t i = 0; i < bytes; ++i) host[i] = pattern(b.id, i);
        put(b.data(), host.data(), bytes);
        a.bind(b.id, [&told](const arena::tensor_block& moved) { told[moved.id] = moved.data(); });
        live[b.id] = bytes;
      }
      const std::uint64_t defragmentations = a.stats().defragmentations;
      if (defragmentations == defragmentations_seen && step % 25 != 0) continue;
      defragmentations_seen = defragmentations;
      for (const auto& [id, size] : live) {
        const arena::tensor_block b = a.block(id);
        if (told.contains(id)) {
          ASSERT_EQ(told[id], b.data()) << "observer of tensor " << id;
        }
        const std::vector<std::byte> got = get(b.data(), size);
        for (std::uint64_t i = 0; i < size; ++i) {
          ASSERT_EQ(got[i], pattern(id, i)) << "tensor " << id << " byte " << i << " at step " << step;
        }
      }
    }
    const arena::arena_stats end = a.stats();
    EXPECT_GT(end.defragmentations, 50U) << "the loop must defragment";
    std::printf("%s: %llu defragmentations, %llu bytes moved\n",
                policy == arena::defrag_policy::minimal_move ? "minimal move" : "full compaction",
                static_cast<unsigned long long>(end.defragmentations),
                static_cast<unsigned long long>(end.bytes_moved));
    EXPECT_GT(end.bytes_moved, 0U);
  }
}

void host_put(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
std::vector<std::byte> host_get(const void* src, std::size_t bytes) {
  const auto* p = static_cast<const std::byte*>(src);
  return {p, p + bytes};
}

TEST(cuda_device, the_arena_content_check_defragments_on_host_memory) {
  host_resource host;
  check_arena_contents(host, host_put, host_get);
}

// Pinned memory registered with CUDA needs a device (or a CUDA build): without one the
// resource and the pool refuse at construction, saying why, before mapping anything.
TEST(cuda_device, registering_pinned_memory_without_a_device_is_refused_at_construction) {
  if (cuda_unavailable_reason().empty()) GTEST_SKIP() << "a CUDA device is here: registration is tested with it";
  try {
    pinned_host_resource r(pinned_options{.register_with_cuda = true});
    FAIL() << "constructed without a device";
  } catch (const device_unavailable& e) {
    EXPECT_NE(std::string(e.what()).find("register_with_cuda needs a CUDA device: "), std::string::npos) << e.what();
  }
  EXPECT_THROW(pinned_pool(pool_options{.register_with_cuda = true}), device_unavailable);
  pinned_host_resource plain;
  void* p = plain.allocate(4096);
  EXPECT_THROW(cuda_register_host(p, 4096), device_unavailable);
  cuda_unregister_host(p);  // nothing to undo: no effect
  plain.deallocate(p, 4096);
  EXPECT_EQ(plain.stats().registered_bytes, 0U);
}

#ifdef TENSORMEM_HAVE_CUDA

#define SKIP_WITHOUT_A_DEVICE()                                                    \
  do {                                                                             \
    const std::string why = cuda_unavailable_reason();                             \
    if (!why.empty()) GTEST_SKIP() << "CUDA device test skipped: " << why;         \
  } while (false)

void to_device(void* dst, const void* src, std::size_t bytes) {
  ASSERT_EQ(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
}
std::vector<std::byte> from_device(const void* src, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), src, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// Random moves inside one device buffer, overlapping in both directions at distances from
// 1 byte up, mirrored by std::memmove on a host copy; the device bytes must equal the
// mirror's after every few moves.
TEST(cuda_device, cuda_move_matches_memmove_for_overlapping_moves) {
  SKIP_WITHOUT_A_DEVICE();
  cuda_device_resource device;
  constexpr std::size_t n = std::size_t{1} << 20;
  void* buffer = device.allocate(n);
  auto* d = static_cast<std::byte*>(buffer);
  std::vector<std::byte> mirror(n);
  for (std::size_t i = 0; i < n; ++i) mirror[i] = pattern(1, i);
  to_device(d, mirror.data(), n);
  std::mt19937_64 rng(20261127);
  for (int step = 0; step < 400; ++step) {
    const bool near = step % 2 == 0;
    const std::size_t distance = near ? 1 + rng() % 64 : 1 + rng() % (n / 2);
    const std::size_t limit = near ? 4096 : n - distance;
    const std::size_t bytes = std::min<std::size_t>(1 + rng() % limit, n - distance);
    const std::size_t low = rng() % (n - distance - bytes + 1);
    const bool up = rng() % 2 == 0;
    const std::size_t src = up ? low : low + distance;
    const std::size_t dst = up ? low + distance : low;
    cuda_move(d + dst, d + src, bytes);
    std::memmove(mirror.data() + dst, mirror.data() + src, bytes);
    if (step % 20 == 19) {
      ASSERT_TRUE(from_device(d, n) == mirror) << "after step " << step << " (" << bytes << " bytes, "
                                               << (up ? "up" : "down") << " by " << distance << ")";
    }
  }
  cuda_move(d, d, n);        // no-op
  cuda_move(d + 5, d, 0);    // no-op
  ASSERT_TRUE(from_device(d, n) == mirror);
  device.deallocate(buffer, n);
}

// Every kernel path of cuda_move against std::memmove on random bytes (a pattern with a
// period would hide a move by that period): element widths 1 to 16 bytes (the addresses'
// alignment) with a tail of 0 to 15 bytes, distances from 1 byte to shared memory's limit
// and beyond it (segments, then columns; around 48 KiB a launch needs the opt-in to more
// shared memory), both directions, moves of a few bytes to 48 MiB.
// The last case moves 520 MiB of byte-aligned data by 3 bytes, which takes more segments
// than the kernel has flags for, so the segments grow.
TEST(cuda_device, cuda_move_is_memmove_at_every_width_distance_and_direction) {
  SKIP_WITHOUT_A_DEVICE();
  cuda_device_resource device;
  constexpr std::size_t n = std::size_t{64} << 20;
  auto* d = static_cast<std::byte*>(device.allocate(n));
  std::vector<std::byte> mirror(n);
  std::mt19937_64 rng(20261128);
  for (std::byte& b : mirror) b = static_cast<std::byte>(rng() & 0xff);
  to_device(d, mirror.data(), n);
  const std::size_t distances[] = {1, 3, 8, 16, 48, 256, 4096, (48 << 10) - 16, 48 << 10, (48 << 10) + 16, 65536,
                                   (192 << 10) - 16, (192 << 10) + 16, std::size_t{1} << 20, std::size_t{5} << 20};
  const std::size_t lengths[] = {2, 100, 4099, (std::size_t{1} << 20) + 5, std::size_t{12} << 20,
                                 std::size_t{48} << 20};
  int cases = 0;
  for (const std::size_t distance : distances) {
    for (const std::size_t length : lengths) {
      for (const std::size_t misalign : {0UL, 1UL, 2UL, 4UL, 8UL}) {
        for (const bool up : {false, true}) {
          const std::size_t bytes = length + (rng() % 16);
          if (bytes + distance + 64 > n) continue;
          const std::size_t low = misalign + 16 * (rng() % ((n - bytes - distance - 32) / 16));
          const std::size_t src = up ? low : low + distance;
          const std::size_t dst = up ? low + distance : low;
          cuda_move(d + dst, d + src, bytes);
          std::memmove(mirror.data() + dst, mirror.data() + src, bytes);
          ++cases;
          const std::size_t from = low;
          const std::size_t span = bytes + distance;
          const std::vector<std::byte> got = from_device(d + from, span);
          ASSERT_TRUE(std::equal(got.begin(), got.end(), mirror.begin() + static_cast<std::ptrdiff_t>(from)))
              << (up ? "up" : "down") << " by " << distance << ", " << bytes << " bytes at " << low;
        }
      }
    }
  }
  ASSERT_TRUE(from_device(d, n) == mirror) << "bytes outside the moved ranges changed";
  EXPECT_GT(cases, 850);
  device.deallocate(d, n);

  constexpr std::size_t big = std::size_t{520} << 20;
  auto* b = static_cast<std::byte*>(device.allocate(big + 64));
  std::vector<std::byte> host(big + 64);
  for (std::byte& x : host) x = static_cast<std::byte>(rng() & 0xff);
  to_device(b, host.data(), host.size());
  cuda_move(b + 1, b + 4, big);  // down by 3, byte-aligned
  std::memmove(host.data() + 1, host.data() + 4, big);
  ASSERT_TRUE(from_device(b, host.size()) == host) << "520 MiB down by 3 bytes";
  cuda_move(b + 7, b + 1, big);  // and up by 6
  std::memmove(host.data() + 7, host.data() + 1, big);
  ASSERT_TRUE(from_device(b, host.size()) == host) << "520 MiB up by 6 bytes";
  device.deallocate(b, big + 64);
}

// cudaDeviceReset throws away the module's memory (the segment kernel's ticket counter and
// flags) and its launch settings (the opt-in to more shared memory): moves in segments, with
// a small and a large halo, and in columns still match std::memmove after each reset.
TEST(cuda_device, cuda_move_works_after_the_device_is_reset) {
  SKIP_WITHOUT_A_DEVICE();
  std::mt19937_64 rng(20261129);
  for (int round = 0; round < 3; ++round) {
    cuda_device_resource device;
    constexpr std::size_t n = std::size_t{8} << 20;
    auto* d = static_cast<std::byte*>(device.allocate(n));
    std::vector<std::byte> mirror(n);
    for (std::byte& b : mirror) b = static_cast<std::byte>(rng() & 0xff);
    to_device(d, mirror.data(), n);
    for (const std::size_t distance : {std::size_t{256}, std::size_t{96} << 10, std::size_t{1} << 20}) {
      cuda_move(d, d + distance, n - distance);
      std::memmove(mirror.data(), mirror.data() + distance, n - distance);
      cuda_move(d + distance / 2, d, n - distance);
      std::memmove(mirror.data() + distance / 2, mirror.data(), n - distance);
    }
    ASSERT_TRUE(from_device(d, n) == mirror) << "round " << round;
    device.deallocate(d, n);
    ASSERT_EQ(cudaDeviceReset(), cudaSuccess);
  }
}

// An arena of device memory under random allocations and releases, with both policies:
// every live tensor keeps its pattern through every defragmentation, and every bound
// observer knows where its tensor went. Also run on host memory below, where it needs no
// device (the same loop must defragment there).
TEST(cuda_device, arena_keeps_device_contents_through_defragmentation) {
  SKIP_WITHOUT_A_DEVICE();
  cuda_device_resource device;
  check_arena_contents(device, to_device, from_device);
}

// cudaMalloc's failure is out_of_memory naming the request, and leaves no sticky error:
// the next allocation works.
TEST(cuda_device, a_failed_cudamalloc_is_out_of_memory_and_leaves_the_device_usable) {
  SKIP_WITHOUT_A_DEVICE();
  cuda_device_resource device;
  const std::size_t huge = std::size_t{1} << 52;  // 4 PiB
  try {
    (void)device.allocate(huge);
    FAIL() << "cudaMalloc of 4 PiB succeeded";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(huge)), std::string::npos) << e.what();
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  void* p = device.allocate(1 << 20);
  ASSERT_NE(p, nullptr);
  const std::vector<std::byte> zeros(1 << 20);
  to_device(p, zeros.data(), zeros.size());
  device.deallocate(p, 1 << 20);
  EXPECT_THROW((void)device.allocate(64, 512), std::invalid_argument);
}

cudaMemoryType memory_type(const void* p) {
  cudaPointerAttributes attributes{};
  EXPECT_EQ(cudaPointerGetAttributes(&attributes, p), cudaSuccess);
  return attributes.type;
}

// Pinned memory with register_with_cuda is known to CUDA (plain locked memory is not), copies
// to and from the device through it arrive whole, and freeing it unregisters it: a thousand
// allocations of the same size, which mmap tends to place at the same address, all register
// (registering a range that is still registered fails). The pool registers its slabs.
TEST(cuda_device, registered_pinned_memory_is_known_to_cuda_and_unregistered_when_freed) {
  SKIP_WITHOUT_A_DEVICE();
  pinned_host_resource plain;
  pinned_host_resource registered(pinned_options{.register_with_cuda = true});
  cuda_device_resource device;
  constexpr std::size_t n = 3 * 4096 + 5;
  auto* a = static_cast<std::byte*>(plain.allocate(n));
  auto* b = static_cast<std::byte*>(registered.allocate(n, 8192));
  EXPECT_EQ(memory_type(a), cudaMemoryTypeUnregistered);
  EXPECT_EQ(memory_type(b), cudaMemoryTypeHost);
  EXPECT_EQ(registered.stats().registered_bytes, 4U * 4096);
  EXPECT_EQ(plain.stats().registered_bytes, 0U);
  for (std::size_t i = 0; i < n; ++i) b[i] = pattern(5, i);
  void* d = device.allocate(n);
  ASSERT_EQ(cudaMemcpyAsync(d, b, n, cudaMemcpyHostToDevice, 0), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(a, d, n, cudaMemcpyDeviceToHost, 0), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(0), cudaSuccess);
  EXPECT_EQ(std::memcmp(a, b, n), 0);
  registered.deallocate(b, n, 8192);
  EXPECT_EQ(registered.stats().registered_bytes, 0U);
  cuda_register_host(a, 4096);
  EXPECT_EQ(memory_type(a), cudaMemoryTypeHost);
  cuda_unregister_host(a);
  EXPECT_EQ(memory_type(a), cudaMemoryTypeUnregistered);
  plain.deallocate(a, n);
  device.deallocate(d, n);
  for (int i = 0; i < 1000; ++i) {
    void* p = registered.allocate(1 << 16);
    ASSERT_EQ(memory_type(p), cudaMemoryTypeHost) << "allocation " << i;
    registered.deallocate(p, 1 << 16);
  }
  EXPECT_EQ(registered.stats().registered_bytes, 0U);

  pinned_pool pool(pool_options{.slab_bytes = 1 << 20, .register_with_cuda = true});
  void* p = pool.allocate(1000);
  EXPECT_EQ(memory_type(p), cudaMemoryTypeHost);
  EXPECT_EQ(pool.stats().registered_bytes, std::uint64_t{1} << 20);
  EXPECT_TRUE(pool.free(p));
  pool.trim();
  EXPECT_EQ(pool.stats().registered_bytes, 0U);
}

// cudaHostAlloc memory is host memory the device can reach: the runtime says so, and a
// device-to-host copy lands in it.
TEST(cuda_device, pinned_memory_is_registered_and_reachable_from_the_device) {
  SKIP_WITHOUT_A_DEVICE();
  cuda_pinned_resource pinned;
  cuda_device_resource device;
  constexpr std::size_t n = 3 * 4096 + 5;
  auto* host = static_cast<std::byte*>(pinned.allocate(n, 4096));
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, host), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
  void* d = device.allocate(n);
  std::vector<std::byte> expected(n);
  for (std::size_t i = 0; i < n; ++i) expected[i] = pattern(3, i);
  to_device(d, expected.data(), n);
  ASSERT_EQ(cudaMemcpyAsync(host, d, n, cudaMemcpyDeviceToHost, nullptr), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  EXPECT_EQ(std::memcmp(host, expected.data(), n), 0);
  device.deallocate(d, n);
  pinned.deallocate(host, n, 4096);
}

#else

// Without CUDA every entry point refuses with the build's reason, a copy before touching
// either pointer (both are null here).
TEST(cuda_device, skipped_in_a_build_without_cuda) {
  EXPECT_FALSE(cuda_built());
  const std::string why = cuda_unavailable_reason();
  for (const auto& call : std::vector<std::function<void()>>{
           [] { cuda_move(nullptr, nullptr, 16); }, [] { cuda_device_resource r; },
           [] { cuda_pinned_resource r; }}) {
    try {
      call();
      ADD_FAILURE() << "accepted";
    } catch (const device_unavailable& e) {
      EXPECT_EQ(std::string(e.what()).find(why), 0U) << e.what();
    }
  }
  GTEST_SKIP() << "CUDA device tests skipped: " << why;
}

#endif

}  // namespace
}  // namespace tensormem::memory
