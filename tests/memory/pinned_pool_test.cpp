// The pinned pool: reuse without system calls, misuse, the lock limit, and locked bytes.

#include <gtest/gtest.h>

#include <grp.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tensormem/memory/errors.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"
#include "tensormem/memory/pinned_pool.hpp"
#include "limited_child.hpp"

namespace tensormem::memory {
namespace {

using testing::in_limited_child;

constexpr std::size_t mib = std::size_t{1} << 20;

TEST(pinned_pool, fitting_allocations_make_no_system_call_and_slabs_are_reused) {
  pinned_pool pool(pool_options{.slab_bytes = 8 * mib});
  void* first = pool.allocate(4096);
  const pool_stats after_first = pool.stats();
  EXPECT_EQ(after_first.slabs, 1U);
  EXPECT_GT(after_first.system_calls, 0U);
  EXPECT_EQ(after_first.locked_bytes, 8 * mib);
  for (int round = 0; round < 100; ++round) {
    void* a = pool.allocate(1 * mib);
    void* b = pool.allocate(100, dtype::f16);
    std::memset(a, round, 1 * mib);
    EXPECT_TRUE(pool.free(a));
    EXPECT_TRUE(pool.free(b));
  }
  const pool_stats s = pool.stats();
  EXPECT_EQ(s.system_calls, after_first.system_calls);
  EXPECT_EQ(s.slabs, 1U);
  EXPECT_EQ(s.total_allocations, 201U);
  EXPECT_EQ(s.allocations, 1U);
  EXPECT_GE(s.peak_in_use_bytes, 1 * mib + 256 + 4096);
  EXPECT_TRUE(pool.free(first));
  EXPECT_EQ(pool.stats().in_use_bytes, 0U);
  EXPECT_EQ(pool.stats().slabs, 1U);  // kept for reuse
  pool.trim();
  EXPECT_EQ(pool.stats().slabs, 0U);
  EXPECT_EQ(pool.stats().locked_bytes, 0U);
}

TEST(pinned_pool, elements_and_dtypes) {
  pinned_pool pool(pool_options{.slab_bytes = mib});
  void* p = pool.allocate(1000, dtype::f32);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0U);
  EXPECT_EQ(pool.stats().in_use_bytes, 4096U);  // 4000 bytes rounded to 256
  EXPECT_TRUE(pool.owns(p));
  EXPECT_TRUE(pool.free(p));
  EXPECT_FALSE(pool.owns(p));
  EXPECT_THROW(pool.allocate(SIZE_MAX / 2, dtype::f64), out_of_memory);
}

TEST(pinned_pool, foreign_and_double_frees_return_false_and_change_nothing) {
  pinned_pool pool(pool_options{.slab_bytes = mib});
  void* p = pool.allocate(1000);
  void* q = pool.allocate(1000);
  const pool_stats before = pool.stats();
  int on_stack = 0;
  EXPECT_FALSE(pool.free(&on_stack));
  EXPECT_FALSE(pool.free(nullptr));
  EXPECT_FALSE(pool.free(static_cast<char*>(p) + 1));
  EXPECT_EQ(pool.stats().in_use_bytes, before.in_use_bytes);
  EXPECT_EQ(pool.stats().allocations, before.allocations);
  EXPECT_TRUE(pool.free(p));
  EXPECT_FALSE(pool.free(p));  // double free
  EXPECT_EQ(pool.stats().allocations, 1U);
  EXPECT_TRUE(pool.free(q));
}

// Buffers aligned to a page (what the swapper, the offload pipeline and Python ask for) take
// exactly their pages: they used to take 3,840 bytes more each, so that 256 buffers of 4 KiB
// needed two 1 MiB slabs, and a 2 MiB cap did not hold two 1 MiB buffers.
TEST(pinned_pool, page_aligned_buffers_take_only_their_pages) {
  pinned_pool pool(pool_options{.slab_bytes = mib});
  std::vector<void*> pages;
  for (int i = 0; i < 256; ++i) {
    pages.push_back(pool.allocate(4096, 4096));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pages.back()) % 4096, 0U);
  }
  EXPECT_EQ(pool.stats().slabs, 1U);
  EXPECT_EQ(pool.stats().in_use_bytes, mib);
  for (void* p : pages) EXPECT_TRUE(pool.free(p));
  pinned_pool capped(pool_options{.slab_bytes = mib, .max_locked_bytes = 2 * mib});
  void* a = capped.allocate(mib, 4096);
  void* b = capped.allocate(mib, 4096);
  EXPECT_EQ(capped.stats().locked_bytes, 2 * mib);
  std::memset(a, 1, mib);
  std::memset(b, 2, mib);
  EXPECT_TRUE(capped.free(a));
  EXPECT_TRUE(capped.free(b));
}

// Sizes and alignments mixed at random (1 byte to 8 KiB aligned, some blocks not a whole
// number of pages, so whole-unit blocks sometimes start unaligned and the pool must fall back):
// every pointer aligned, no two live blocks overlap, contents kept until freed.
TEST(pinned_pool, mixed_alignments_stay_aligned_disjoint_and_intact) {
  pinned_pool pool(pool_options{.slab_bytes = mib});
  std::mt19937_64 rng(11);
  struct block {
    std::size_t bytes;
    unsigned char fill;
  };
  std::map<std::uintptr_t, block> live;
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 100 < 55) {
      const std::size_t alignment = std::size_t{1} << (rng() % 14);
      const std::size_t bytes = 1 + rng() % (rng() % 4 == 0 ? 300000 : 9000);
      auto* p = static_cast<unsigned char*>(pool.allocate(bytes, alignment));
      const auto at = reinterpret_cast<std::uintptr_t>(p);
      ASSERT_EQ(at % alignment, 0U) << "step " << step;
      const auto next = live.lower_bound(at);
      if (next != live.end()) {
        ASSERT_LE(at + bytes, next->first) << "step " << step;
      }
      if (next != live.begin()) {
        const auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second.bytes, at) << "step " << step;
      }
      const auto fill = static_cast<unsigned char>(rng());
      std::memset(p, fill, bytes);
      live[at] = {bytes, fill};
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      const auto* p = reinterpret_cast<unsigned char*>(it->first);
      for (std::size_t k = 0; k < it->second.bytes; k += 97) {
        ASSERT_EQ(p[k], it->second.fill) << "step " << step;
      }
      ASSERT_TRUE(pool.free(reinterpret_cast<void*>(it->first)));
      live.erase(it);
    }
  }
  for (const auto& [at, b] : live) EXPECT_TRUE(pool.free(reinterpret_cast<void*>(at)));
  EXPECT_EQ(pool.stats().in_use_bytes, 0U);
}

TEST(pinned_pool, oversized_allocations_get_their_own_slab) {
  pinned_pool pool(pool_options{.slab_bytes = mib});
  void* big = pool.allocate(3 * mib + 5);
  EXPECT_EQ(pool.stats().slabs, 1U);
  EXPECT_GE(pool.stats().slab_bytes, 3 * mib + 5);
  std::memset(big, 1, 3 * mib + 5);
  EXPECT_TRUE(pool.free(big));
  EXPECT_EQ(pool.stats().slabs, 0U);  // released with its allocation
}

// The edges of "larger than a slab": a slab's size exactly is served from a shared slab, kept
// after the free and reused without a system call; a byte more gets a slab of its own.
TEST(pinned_pool, an_allocation_of_a_slab_exactly_shares_and_one_byte_more_does_not) {
  pinned_pool pool(pool_options{.slab_bytes = mib});
  void* whole = pool.allocate(mib);
  EXPECT_TRUE(pool.free(whole));
  EXPECT_EQ(pool.stats().slabs, 1U);  // kept for the next allocation
  const std::uint64_t calls = pool.stats().system_calls;
  whole = pool.allocate(mib);
  EXPECT_EQ(pool.stats().system_calls, calls);
  EXPECT_TRUE(pool.free(whole));
  void* more = pool.allocate(mib + 1);
  EXPECT_EQ(pool.stats().slabs, 2U);
  EXPECT_TRUE(pool.free(more));
  EXPECT_EQ(pool.stats().slabs, 1U);  // its own slab went with it
}

// Alignments up to a page are the pool's; above one, or not a power of two, refused.
TEST(pinned_pool, the_pools_alignment_may_be_a_page) {
  const std::size_t page = pinned_host_resource::page_bytes();
  pinned_pool pages(pool_options{.slab_bytes = mib, .alignment = page});
  void* a = pages.allocate(1);
  void* b = pages.allocate(1);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a) % page, 0U);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b) % page, 0U);
  EXPECT_NE(a, b);
  EXPECT_TRUE(pages.free(a));
  EXPECT_TRUE(pages.free(b));
  EXPECT_THROW(pinned_pool(pool_options{.slab_bytes = mib, .alignment = 2 * page}), std::invalid_argument);
  EXPECT_THROW(pinned_pool(pool_options{.slab_bytes = mib, .alignment = 3}), std::invalid_argument);
}

TEST(pinned_pool, cap_on_locked_bytes_is_a_typed_error_that_changes_nothing) {
  pinned_pool pool(pool_options{.slab_bytes = mib, .max_locked_bytes = 2 * mib});
  void* a = pool.allocate(mib);
  void* b = pool.allocate(mib);
  const pool_stats before = pool.stats();
  try {
    pool.allocate(mib);
    FAIL() << "allocation past the cap succeeded";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("cap of 2097152"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.stats().slabs, before.slabs);
  EXPECT_EQ(pool.stats().allocations, before.allocations);
  EXPECT_TRUE(pool.free(a));
  EXPECT_NE(pool.allocate(mib), nullptr);  // fits the freed space
  EXPECT_TRUE(pool.free(b));
}

// A slab is mapped, populated and locked, and unmapped, with the pool's lock let go: while one
// thread maps 256 MiB (tens of milliseconds) and then frees it, another allocates and frees
// in an existing slab. Before, the second waited for the whole mapping. Timed by completion
// order, not by a bound: with the system calls under the lock the small calls can never end
// first. Three tries, for a scheduler that leaves the second thread unscheduled throughout.
TEST(pinned_pool, other_threads_allocate_and_free_while_a_slab_is_mapped_or_unmapped) {
  bool before_mapped = false;
  bool before_unmapped = false;
  const auto small_calls = [](pinned_pool& pool) {
    for (int i = 0; i < 100; ++i) ASSERT_TRUE(pool.free(pool.allocate(4096)));
  };
  for (int attempt = 0; attempt < 3 && !(before_mapped && before_unmapped); ++attempt) {
    pinned_pool pool(pool_options{.slab_bytes = 1 * mib});
    pool.free(pool.allocate(4096));  // a shared slab to allocate from
    std::atomic<int> stage{0};  // 1: mapping, 2: mapped, 3: unmapping, 4: unmapped
    std::thread grower([&] {
      stage = 1;
      void* big = pool.allocate(256 * mib);
      stage = 2;
      while (stage.load() != 3) std::this_thread::yield();
      pool.free(big);
      stage = 4;
    });
    while (stage.load() != 1) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    small_calls(pool);
    before_mapped = before_mapped || stage.load() == 1;
    while (stage.load() != 2) std::this_thread::yield();
    stage = 3;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    small_calls(pool);
    before_unmapped = before_unmapped || stage.load() == 3;
    grower.join();
    EXPECT_EQ(pool.stats().slabs, 1U);  // the big slab was its own, gone with its buffer
  }
  EXPECT_TRUE(before_mapped) << "the small calls always waited for the 256 MiB slab's mapping";
  EXPECT_TRUE(before_unmapped) << "the small calls always waited for the 256 MiB slab's unmapping";
}

// trim() unmaps each empty slab with the lock let go, as a free does: a 256 MiB slab being
// trimmed keeps no other thread from allocating and freeing in another slab.
TEST(pinned_pool, other_threads_allocate_and_free_while_a_slab_is_trimmed) {
  bool before_trimmed = false;
  for (int attempt = 0; attempt < 3 && !before_trimmed; ++attempt) {
    pinned_pool pool(pool_options{.slab_bytes = 256 * mib});
    void* a = pool.allocate(200 * mib);
    pool.free(pool.allocate(200 * mib));  // a second slab, now empty
    ASSERT_EQ(pool.stats().slabs, 2U);
    std::atomic<int> stage{0};  // 1: trimming, 2: trimmed
    std::thread trimmer([&] {
      stage = 1;
      pool.trim();
      stage = 2;
    });
    while (stage.load() != 1) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    for (int i = 0; i < 100; ++i) ASSERT_TRUE(pool.free(pool.allocate(4096)));  // in the first slab
    before_trimmed = stage.load() == 1;
    trimmer.join();
    EXPECT_EQ(pool.stats().slabs, 1U);
    EXPECT_TRUE(pool.free(a));
  }
  EXPECT_TRUE(before_trimmed) << "the small calls always waited for the trim's unmapping";
}

// Slabs being mapped by several threads at once count against the cap together: of two
// concurrent 200 MiB requests under a 300 MiB cap, one is refused (without it, both passed
// the check before either was added).
TEST(pinned_pool, slabs_mapped_at_once_stay_within_the_cap) {
  pinned_pool pool(pool_options{.slab_bytes = 1 * mib, .max_locked_bytes = 300 * mib});
  std::atomic<int> ready{0};
  std::atomic<int> refused{0};
  std::vector<void*> got(2, nullptr);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < 2) std::this_thread::yield();
      try {
        got[static_cast<std::size_t>(t)] = pool.allocate(200 * mib);
      } catch (const out_of_memory& e) {
        EXPECT_NE(std::string(e.what()).find("would pass the cap"), std::string::npos) << e.what();
        refused.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(refused.load(), 1);
  EXPECT_LE(pool.stats().slab_bytes, 300 * mib);
  for (void* p : got) {
    if (p != nullptr) {
      EXPECT_TRUE(pool.free(p));
    }
  }
}

TEST(pinned_pool, destructor_returns_every_locked_byte) {
  const std::size_t before = process_locked_bytes();
  {
    pinned_pool pool(pool_options{.slab_bytes = 4 * mib});
    for (int i = 0; i < 10; ++i) pool.allocate(3 * mib);  // left live on purpose
    EXPECT_GE(process_locked_bytes(), before + 10 * 4 * mib);
    EXPECT_EQ(pool.stats().locked_bytes, 10 * 4 * mib);
  }
  EXPECT_EQ(process_locked_bytes(), before);
}

// A request the limit has no room for: the error names the request's own size (the pool
// tried slabs down to it), not the slab's.
TEST(pinned_pool, lock_limit_gives_a_clear_error) {
  const auto [code, message] = in_limited_child([](std::string& out) {
    try {
      pinned_pool pool(pool_options{.slab_bytes = 4 * mib});
      pool.allocate(2 * mib);
      out = "allocation past RLIMIT_MEMLOCK succeeded";
      return 1;
    } catch (const lock_limit_error& e) {
      out = e.what();
      return e.requested_bytes() == 2 * mib && e.limit_bytes() == mib ? 0 : 2;
    } catch (const std::exception& e) {
      out = std::string("wrong exception: ") + e.what();
      return 3;
    }
  });
  EXPECT_EQ(code, 0) << message;
  EXPECT_NE(message.find("cannot lock 2097152 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("RLIMIT_MEMLOCK is 1048576 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("ulimit -l"), std::string::npos) << message;
}

// A refused lock gives the mapping back: nothing stays mapped (the process's address space
// is as before) and the stats count mmap, mlock and munmap.
// allocate_locked takes allocate's checks: a bad alignment, a size past the address space.
TEST(pinned_host_resource, allocate_locked_refuses_what_allocate_refuses) {
  pinned_host_resource resource;
  EXPECT_THROW(resource.allocate_locked(4096, 3), std::invalid_argument);
  EXPECT_THROW(resource.allocate_locked(std::numeric_limits<std::size_t>::max() - 100, 4096), out_of_memory);
  // The largest size that can be padded to its alignment is refused by the machine's memory;
  // one byte more cannot be represented.
  const auto refusal = [&](std::size_t bytes) {
    try {
      resource.allocate_locked(bytes, 4096);
    } catch (const out_of_memory& e) {
      return std::string(e.what());
    }
    return std::string("served");
  };
  const std::size_t largest = std::numeric_limits<std::size_t>::max() - 4096;
  EXPECT_NE(refusal(largest).find("more than this machine's"), std::string::npos) << refusal(largest);
  EXPECT_NE(refusal(largest + 1).find("cannot be represented"), std::string::npos) << refusal(largest + 1);
  // A page whose alignment alone needs a mapping larger than the machine: refused before any
  // mapping, by the machine's memory, not tried (MAP_POPULATE would end in the OOM killer).
  const std::size_t physical = tensormem::memory::physical_memory_bytes();
  const std::size_t past = std::bit_ceil(physical) << 1U;
  for (const bool locked : {true, false}) {
    try {
      void* p = locked ? resource.allocate_locked(4096, past) : resource.allocate(4096, past);
      resource.deallocate(p, 4096, past);
      ADD_FAILURE() << "an alignment of " << past << " bytes was served";
    } catch (const out_of_memory& e) {
      EXPECT_NE(std::string(e.what()).find("more than this machine's " + std::to_string(physical)), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(resource.stats().mappings, 0U);
  EXPECT_EQ(resource.stats().system_calls, 0U);
  void* p = resource.allocate_locked(0, 4096);  // a distinct pointer, as allocate gives
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(resource.stats().locked_bytes, 4096U);
  resource.deallocate(p, 0, 4096);
  EXPECT_EQ(resource.stats().mappings, 0U);
}

// The process's virtual size, in pages (0 where it cannot be read).
unsigned long mapped_pages() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  unsigned long pages = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%lu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  return pages;
}

// Alignments above a page: the mapping is made larger by the alignment less a page and both
// ends are trimmed, so the block is aligned, holds its bytes, is the only part left mapped
// (the virtual size grows by the block alone) and is counted as one locked mapping of its
// page-rounded size; each trimmed end is one more system call.
TEST(pinned_host_resource, alignments_above_a_page_are_trimmed_to_the_block) {
  pinned_host_resource resource;
  const std::size_t page = pinned_host_resource::page_bytes();
  // One allocation first: the first reads the machine's memory, and the heap grows for it.
  resource.deallocate(resource.allocate_locked(1, 2 * page), 1, 2 * page);
  static_cast<void>(mapped_pages());
  for (const std::size_t alignment : {2 * page, std::size_t{64} << 10U, std::size_t{2} << 20U, 64 * mib}) {
    for (const std::size_t bytes : {std::size_t{1}, page + 5, 3 * mib}) {
      const std::size_t mapped = (bytes + page - 1) / page * page;
      const unsigned long pages_before = mapped_pages();
      const std::uint64_t calls_before = resource.stats().system_calls;
      auto* p = static_cast<unsigned char*>(resource.allocate_locked(bytes, alignment));
      const unsigned long pages_after = mapped_pages();
      const pinned_stats s = resource.stats();
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % alignment, 0U) << alignment;
      std::memset(p, 0x5a, bytes);
      EXPECT_EQ(p[bytes - 1], 0x5a);
      EXPECT_EQ(s.mappings, 1U);
      EXPECT_EQ(s.mapped_bytes, mapped);
      EXPECT_EQ(s.locked_bytes, mapped);
      // mmap, mlock, and a munmap for each end cut off (at least one: the extra is not 0).
      const std::uint64_t calls = s.system_calls - calls_before;
      EXPECT_GE(calls, 3U) << alignment;
      EXPECT_LE(calls, 4U) << alignment;
      // Nothing of the extra stays mapped (the heap may grow by a few pages meanwhile: a trimmed
      // end left mapped shows where it is larger than that, as with 64 MiB nearly always).
      EXPECT_LE((pages_after - pages_before) * page, mapped + 256 * 1024) << "alignment " << alignment;
      resource.deallocate(p, bytes, alignment);
      EXPECT_EQ(resource.stats().mappings, 0U);
      EXPECT_EQ(resource.stats().locked_bytes, 0U);
      EXPECT_EQ(resource.stats().mapped_bytes, 0U);
    }
  }
}

// A mapping handed out unlocked is given back as unlocked: the locked bytes count only the
// locked ones, before and after either is freed, in either order.
TEST(pinned_host_resource, locked_and_unlocked_mappings_are_counted_apart_when_freed) {
  const auto [code, message] = in_limited_child([](std::string& out) {
    try {
      pinned_host_resource resource(pinned_options{.allow_unlocked_fallback = true});
      void* locked = resource.allocate(256 << 10U, 4096);  // within the 1 MiB limit
      void* unlocked = resource.allocate(2 * mib, 4096);   // past it: unlocked
      void* locked2 = resource.allocate(256 << 10U, 4096);
      std::memset(unlocked, 1, 2 * mib);
      const auto text = [&](const char* when) {
        const pinned_stats s = resource.stats();
        return std::string(when) + ": locked " + std::to_string(s.locked_bytes) + ", mapped " +
               std::to_string(s.mapped_bytes) + ", fallbacks " + std::to_string(s.unlocked_fallbacks) + "; ";
      };
      bool ok = resource.stats().locked_bytes == 512U << 10U && resource.stats().unlocked_fallbacks == 1;
      out += text("all three");
      resource.deallocate(unlocked, 2 * mib, 4096);
      ok = ok && resource.stats().locked_bytes == 512U << 10U && resource.stats().mapped_bytes == 512U << 10U;
      out += text("unlocked freed");
      resource.deallocate(locked, 256 << 10U, 4096);
      ok = ok && resource.stats().locked_bytes == 256U << 10U;
      out += text("one locked freed");
      void* unlocked2 = resource.allocate(2 * mib, 4096);
      resource.deallocate(locked2, 256 << 10U, 4096);
      ok = ok && resource.stats().locked_bytes == 0 && resource.stats().mapped_bytes == 2 * mib;
      out += text("locked freed before an unlocked one");
      resource.deallocate(unlocked2, 2 * mib, 4096);
      ok = ok && resource.stats().locked_bytes == 0 && resource.stats().mappings == 0 &&
           resource.stats().unlocked_fallbacks == 2;
      out += text("all freed");
      return ok ? 0 : 1;
    } catch (const std::exception& e) {
      out = e.what();
      return 2;
    }
  });
  EXPECT_EQ(code, 0) << message;
}

TEST(pinned_pool, a_refused_lock_unmaps_and_counts_its_calls) {
  const auto [code, message] = in_limited_child([](std::string& out) {
    pinned_host_resource resource;
    const unsigned long before = mapped_pages();
    try {
      resource.allocate(64 * mib);
      out = "allocation past RLIMIT_MEMLOCK succeeded";
      return 1;
    } catch (const lock_limit_error&) {
    }
    const unsigned long after = mapped_pages();
    const pinned_stats s = resource.stats();
    out = "pages " + std::to_string(before) + " -> " + std::to_string(after) + ", mappings " +
          std::to_string(s.mappings) + ", mapped " + std::to_string(s.mapped_bytes) + ", calls " +
          std::to_string(s.system_calls);
    // (Below 64 MiB of growth: the allocator's own bookkeeping may map a little.)
    const bool unmapped = after < before + (16 * mib) / 4096;
    return unmapped && s.mappings == 0 && s.mapped_bytes == 0 && s.system_calls == 3 ? 0 : 2;
  });
  EXPECT_EQ(code, 0) << message;
}

TEST(pinned_pool, unlocked_fallback_is_reported) {
  const auto [code, message] = in_limited_child([](std::string& out) {
    try {
      pinned_pool pool(pool_options{.slab_bytes = 4 * mib, .allow_unlocked_fallback = true});
      void* p = pool.allocate(2 * mib);  // more than the limit: unlocked
      std::memset(p, 7, 2 * mib);
      const pool_stats s = pool.stats();
      out = "fallbacks " + std::to_string(s.unlocked_fallbacks) + " locked " +
            std::to_string(s.locked_bytes);
      return s.unlocked_fallbacks == 1 && s.locked_bytes == 0 && pool.free(p) ? 0 : 1;
    } catch (const std::exception& e) {
      out = e.what();
      return 2;
    }
  });
  EXPECT_EQ(code, 0) << message;
}

int lock_limited_pool_serves_small_requests(std::string& out, bool fallback) {
  try {
    pinned_pool pool(pool_options{.slab_bytes = 4 * mib, .allow_unlocked_fallback = fallback});
    std::vector<void*> blocks;
    for (int i = 0; i < 100; ++i) {
      blocks.push_back(pool.allocate(1000));
      std::memset(blocks.back(), i, 1000);
    }
    const pool_stats s = pool.stats();
    out = "slabs " + std::to_string(s.slabs) + ", slab size now " + std::to_string(s.current_slab_bytes) +
          ", locked " + std::to_string(s.locked_bytes) + ", unlocked fallbacks " + std::to_string(s.unlocked_fallbacks);
    // Halved from 4 MiB, so a power of two (whole pages at every step: none is rounded up).
    const bool shared = s.slabs == 1 && s.current_slab_bytes < 4 * mib && s.current_slab_bytes >= 100 * 1000 &&
                        std::has_single_bit(s.current_slab_bytes);
    const bool locked = s.unlocked_fallbacks == 0 && s.locked_bytes == s.current_slab_bytes;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (static_cast<unsigned char*>(blocks[i])[999] != static_cast<unsigned char>(i)) return 4;
    }
    return shared && locked ? 0 : 1;
  } catch (const std::exception& e) {
    out = e.what();
    return 2;
  }
}

// Under the limit (1 MiB) a pool of 4 MiB slabs still serves what fits, locked: the refused
// slab is halved until one is locked, and later small allocations share it. With the
// unlocked fallback allowed, such requests are still locked; only one past the limit is not.
TEST(pinned_pool, requests_the_lock_limit_leaves_room_for_are_locked_in_smaller_slabs) {
  for (const bool fallback : {false, true}) {
    const auto body = fallback ? +[](std::string& out) { return lock_limited_pool_serves_small_requests(out, true); }
                               : +[](std::string& out) { return lock_limited_pool_serves_small_requests(out, false); };
    const auto [code, message] = in_limited_child(body);
    EXPECT_EQ(code, 0) << (fallback ? "with the fallback: " : "") << message;
  }
}

}  // namespace
}  // namespace tensormem::memory
