// The pinned pool under threads (run under ThreadSanitizer by `make test`), small requests
// never placed in a dedicated slab, and AddressSanitizer poisoning of freed ranges.

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "tensormem/memory/detail/poison.hpp"
#include "tensormem/memory/pinned_pool.hpp"

namespace tensormem::memory {
namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

TEST(thread_safety, pool_allocate_and_free_from_four_threads) {
  pinned_pool pool({.slab_bytes = 4 * mib});
  std::atomic<int> corrupted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, &corrupted, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t));
      std::vector<std::pair<unsigned char*, std::size_t>> mine;
      for (int step = 0; step < 2000; ++step) {
        if (mine.empty() || rng() % 2 == 0) {
          const std::size_t bytes = 1 + rng() % 20000;
          auto* p = static_cast<unsigned char*>(pool.allocate(bytes, 256));
          std::memset(p, t + 1, bytes);
          mine.emplace_back(p, bytes);
        } else {
          const std::size_t i = rng() % mine.size();
          for (std::size_t k = 0; k < mine[i].second; ++k) {
            if (mine[i].first[k] != t + 1) {
              ++corrupted;
              break;
            }
          }
          if (!pool.free(mine[i].first)) ++corrupted;
          mine[i] = mine.back();
          mine.pop_back();
        }
      }
      for (auto& [p, n] : mine) pool.free(p);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(corrupted.load(), 0);
  EXPECT_EQ(pool.stats().allocations, 0U);
  EXPECT_EQ(pool.stats().in_use_bytes, 0U);
}

TEST(pinned_pool_contract, small_allocations_never_land_in_a_dedicated_slab) {
  pinned_pool pool({.slab_bytes = 1 * mib});
  // A slab of its own, rounded up to a page: about 3.75 KiB of it stay free.
  auto* big = static_cast<char*>(pool.allocate(3 * mib + 5));
  std::vector<void*> small;
  for (int i = 0; i < 64; ++i) {
    small.push_back(pool.allocate(1000));
    const auto* p = static_cast<const char*>(small.back());
    ASSERT_FALSE(p >= big && p < big + 3 * mib + 4096) << "a small allocation landed in the dedicated slab";
  }
  EXPECT_EQ(pool.stats().slabs, 2U);  // the dedicated one and one standard slab
  EXPECT_TRUE(pool.free(big));        // releases the dedicated slab
  EXPECT_EQ(pool.stats().slabs, 1U);
  for (void* p : small) {
    EXPECT_TRUE(pool.owns(p));
    std::memset(p, 7, 1000);  // still mapped
    EXPECT_TRUE(pool.free(p));
  }
}

#ifdef TENSORMEM_ASAN
TEST(pinned_pool_contract, freed_memory_is_poisoned_for_address_sanitizer) {
  pinned_pool pool({.slab_bytes = 1 * mib});
  auto* p = static_cast<char*>(pool.allocate(4096, 256));
  p[0] = 1;
  EXPECT_EQ(__asan_address_is_poisoned(p), 0);
  EXPECT_EQ(__asan_address_is_poisoned(p + 4095), 0);
  pool.free(p);
  EXPECT_NE(__asan_address_is_poisoned(p), 0);
  EXPECT_NE(__asan_address_is_poisoned(p + 4095), 0);
  EXPECT_DEATH({ p[10] = 2; }, "use-after-poison");
}
#endif

}  // namespace
}  // namespace tensormem::memory
