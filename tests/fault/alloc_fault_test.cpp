// Strong exception safety under injected std::bad_alloc: the global operator new of this
// executable fails on the n-th call after arming, for every n until the operation succeeds,
// and after each failure the object must be exactly as it was.

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "tensormem/arena/contiguous_arena.hpp"
#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/planner.hpp"
#include "tensormem/core/tlsf_allocator.hpp"
#include "tensormem/memory/host_resource.hpp"
#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/memory/statistics_adaptor.hpp"
#include "tensormem/io/file_io.hpp"
#include "tensormem/offload/offloaded_optimizer.hpp"
#include "tensormem/offload/prefetch_pipeline.hpp"
#include "tensormem/offload/swap_space.hpp"
#include "tensormem/swap/detail/range_cover.hpp"
#include "tensormem/swap/tensor_swapper.hpp"

#if defined(__GNUC__) && !defined(__clang__)
// The replacement operators below pair malloc with free by construction; GCC 12 reports
// them as mismatched wherever it inlines a container's deallocation into this file.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace {
thread_local long countdown = -1;  // < 0: disarmed; 0: the next allocation fails
// Where countdown's failure happens, countdown takes this value (a second failure, the
// then_countdown-th allocation after the first), and this one is disarmed.
thread_local long then_countdown = -1;
// While set, every allocation on a thread other than `armed_thread` fails (a library's own
// threads out of memory while the caller's are not).
std::atomic<bool> fail_on_other_threads{false};
std::atomic<std::thread::id> armed_thread;  // (read by the library's threads while a test sets it)
// While >= 0, counts the allocations made on threads other than `armed_thread`; the one made
// at 0 fails (a library's own thread failing at each of its allocations in turn).
std::atomic<long> other_countdown{-1};

// Disarms the counter when a test function returns, a failed assertion's return included, so
// that the test framework's own allocations after it do not fail.
struct disarm_on_exit {
  disarm_on_exit() = default;
  disarm_on_exit(const disarm_on_exit&) = delete;
  disarm_on_exit& operator=(const disarm_on_exit&) = delete;
  ~disarm_on_exit() { countdown = then_countdown = -1; }
};

void fail_when_due() {
  if (std::this_thread::get_id() != armed_thread.load()) {
    if (fail_on_other_threads.load()) throw std::bad_alloc();
    long left = other_countdown.load();
    while (left >= 0 && !other_countdown.compare_exchange_weak(left, left - 1)) {
    }
    if (left == 0) throw std::bad_alloc();
  }
  if (countdown == 0) {
    countdown = then_countdown;
    then_countdown = -1;
    throw std::bad_alloc();
  }
  if (countdown > 0) --countdown;
}
}  // namespace

void* operator new(std::size_t bytes) {
  fail_when_due();
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
// Over-aligned types (the O(1) allocator's nodes) come through these.
void* operator new(std::size_t bytes, std::align_val_t alignment) {
  fail_when_due();
  const auto a = static_cast<std::size_t>(alignment);
  if (void* p = std::aligned_alloc(a, std::max(a, (bytes + a - 1) / a * a))) return p;  // a multiple of a
  throw std::bad_alloc();
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace tensormem {
namespace {

/// A folder of its own under /tmp, removed with everything in it at the end of the scope.
struct scratch_folder {
  std::string path;
  scratch_folder() {
    char name[] = "/tmp/tensormem-fault-XXXXXX";
    if (::mkdtemp(name) == nullptr) throw std::system_error(errno, std::generic_category(), "mkdtemp");
    path = name;
  }
  scratch_folder(const scratch_folder&) = delete;
  scratch_folder& operator=(const scratch_folder&) = delete;
  ~scratch_folder() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

/// Runs `op` with the n-th allocation failing, n = 0, 1, ...; `check` verifies after each
/// failure that nothing changed. Returns how many failures were injected.
template <class Op, class Check>
int inject_until_success(Op op, Check check) {
  for (long n = 0;; ++n) {
    countdown = n;
    try {
      op();
      countdown = -1;
      return static_cast<int>(n);
    } catch (const std::bad_alloc&) {
      countdown = -1;
      check();
      if (::testing::Test::HasFatalFailure()) return static_cast<int>(n);
    }
  }
}

/// How many allocations `op` makes on this thread (none of them fails).
template <class Op>
long allocations_in(Op op) {
  constexpr long far = 1L << 40;
  countdown = far;
  op();
  const long made = far - countdown;
  countdown = -1;
  return made;
}

// With `by_offset`, frees go through free(offset, bytes), after a first one that builds the
// offset index: allocations then also keep the index, within the same guarantee.
template <class A>
void allocator_strong_guarantee(bool by_offset = false) {
  std::mt19937_64 rng(3);
  A a(std::uint64_t{1} << 30, 256);
  A reference(std::uint64_t{1} << 30, 256);  // same history, no faults
  if (by_offset) {
    for (A* x : {&a, &reference}) {
      const core::allocation first = *x->allocate(1000);
      x->free(first.offset, 1000);
    }
  }
  const auto release = [by_offset](A& x, const core::allocation& h) {
    if (by_offset) x.free(h.offset, h.bytes);
    else x.deallocate(h);
  };
  std::vector<std::pair<core::allocation, core::allocation>> live;
  int injected = 0;
  for (int step = 0; step < 400; ++step) {
    if (live.empty() || rng() % 100 < 60) {
      const std::uint64_t bytes = 1 + rng() % 100'000;
      std::optional<core::allocation> got;
      injected += inject_until_success([&] { got = a.allocate(bytes); }, [&] {
        ASSERT_EQ(a.check_invariants(), "");
        ASSERT_EQ(a.used(), reference.used());
        ASSERT_EQ(a.peak(), reference.peak());
        ASSERT_EQ(a.stats().free_blocks, reference.stats().free_blocks);
        ASSERT_EQ(a.stats().largest_free_bytes, reference.stats().largest_free_bytes);
      });
      const auto want = reference.allocate(bytes);
      ASSERT_TRUE(got && want);
      ASSERT_EQ(got->offset, want->offset) << "step " << step;
      live.emplace_back(*got, *want);
    } else {
      const std::size_t i = rng() % live.size();
      // Frees must not allocate at all: any allocation here would throw.
      countdown = 0;
      release(a, live[i].first);
      countdown = -1;
      release(reference, live[i].second);
      live[i] = live.back();
      live.pop_back();
    }
    ASSERT_EQ(a.check_invariants(), "") << "step " << step;
  }
  EXPECT_GT(injected, 0);
}

TEST(strong_guarantee, best_fit_allocate_and_free) { allocator_strong_guarantee<core::best_fit_allocator>(); }
TEST(strong_guarantee, tlsf_allocate_and_free) { allocator_strong_guarantee<core::tlsf_allocator>(); }
TEST(strong_guarantee, best_fit_allocate_and_free_by_offset) {
  allocator_strong_guarantee<core::best_fit_allocator>(true);
}
TEST(strong_guarantee, tlsf_allocate_and_free_by_offset) { allocator_strong_guarantee<core::tlsf_allocator>(true); }

// Both allocators build their offset index on the first free(offset, bytes); with no memory
// for it, that call (and later ones) still frees by walking the blocks, and a later call
// builds the index.
template <class Allocator>
void free_by_offset_without_memory_for_the_index() {
  Allocator a(core::growing, 256);
  std::vector<core::allocation> live;
  for (int i = 0; i < 100; ++i) live.push_back(*a.allocate(1000 + 256 * static_cast<std::uint64_t>(i % 7)));
  a.deallocate(live[20]);  // a free block in the middle: the walk passes it
  countdown = 0;  // every allocation fails from here: the index cannot be built
  EXPECT_EQ(a.try_free(live[10].offset, live[10].bytes), core::free_status::ok);
  countdown = 0;
  EXPECT_EQ(a.try_free(live[10].offset, live[10].bytes), core::free_status::not_allocated);  // twice
  countdown = 0;
  EXPECT_EQ(a.try_free(live[20].offset, live[20].bytes), core::free_status::not_allocated);  // a free block
  countdown = 0;
  EXPECT_EQ(a.try_free(live[50].offset + 256, live[50].bytes), core::free_status::not_allocated);  // inside
  countdown = 0;
  EXPECT_EQ(a.try_free(live[50].offset, live[50].bytes + 1000), core::free_status::size_mismatch);
  countdown = -1;
  EXPECT_EQ(a.check_invariants(), "");
  core::free_status status{};
  EXPECT_GT(allocations_in([&] { status = a.try_free(live[50].offset, live[50].bytes); }), 0)
      << "the index was not built";
  EXPECT_EQ(status, core::free_status::ok);
  EXPECT_EQ(allocations_in([&] { status = a.try_free(live[60].offset, live[60].bytes); }), 0)
      << "a free by offset after the index was built asked for memory";
  EXPECT_EQ(status, core::free_status::ok);
  a.deallocate(live[51]);  // handles and offsets mix
  EXPECT_EQ(a.try_free(live[52].offset, live[52].bytes), core::free_status::ok);
  EXPECT_EQ(a.try_free(live[52].offset, live[52].bytes), core::free_status::not_allocated);
  EXPECT_EQ(a.stats().live_allocations, 94U);
  EXPECT_EQ(a.check_invariants(), "");
}

TEST(strong_guarantee, tlsf_free_by_offset_without_memory_for_the_index) {
  free_by_offset_without_memory_for_the_index<core::tlsf_allocator>();
}

TEST(strong_guarantee, best_fit_free_by_offset_without_memory_for_the_index) {
  free_by_offset_without_memory_for_the_index<core::best_fit_allocator>();
}

// After reserve(B), a stream that never has more than B blocks runs with every allocation
// failing: neither allocate nor deallocate asks for memory. Random sizes, both exact and
// class sizes, at most L = 300 live (so at most 2L + 1 blocks); the counter is re-armed
// before each call, so a single allocation anywhere fails the test.
template <class Allocator>
void allocates_nothing_within_the_reserve() {
  const disarm_on_exit disarm;
  constexpr std::size_t most_live = 300;
  Allocator a(core::growing, 256);
  a.reserve(2 * most_live + 1);
  std::mt19937_64 rng(17);
  std::vector<core::allocation> live;
  live.reserve(most_live);  // the test's own list asks for nothing while armed either
  std::size_t most_blocks = 0;
  for (int step = 0; step < 20'000; ++step) {
    countdown = 0;
    if (live.empty() || (live.size() < most_live && rng() % 100 < 55)) {
      const std::uint64_t bytes = rng() % 4 == 0 ? (std::uint64_t{1} << 24) + rng() % (std::uint64_t{1} << 26)
                                                 : 1 + rng() % (std::uint64_t{1} << 20);
      std::optional<core::allocation> got;
      ASSERT_NO_THROW(got = a.allocate(bytes)) << "step " << step;
      ASSERT_TRUE(got);
      live.push_back(*got);
    } else {
      const std::size_t i = rng() % live.size();
      ASSERT_NO_THROW(a.deallocate(live[i])) << "step " << step;
      live[i] = live.back();
      live.pop_back();
    }
    countdown = -1;
    most_blocks = std::max<std::size_t>(most_blocks, live.size() + a.stats().free_blocks);
  }
  EXPECT_EQ(a.check_invariants(), "");
  EXPECT_GT(most_blocks, 2 * most_live * 3 / 4);  // the stream came near the reserve

  // Exactly at the bound: 101 blocks side by side, then every other one freed and taken
  // again, with a reserve of 101.
  Allocator c(core::growing, 256);
  c.reserve(101);
  std::vector<core::allocation> row;
  row.reserve(101);
  countdown = 0;
  for (std::uint64_t i = 0; i < 101; ++i) {
    ASSERT_NO_THROW(row.push_back(*c.allocate(256 * (1 + i % 5)))) << "block " << i;
    countdown = 0;
  }
  for (int round = 0; round < 3; ++round) {
    for (std::size_t i = 0; i < row.size(); i += 2) {
      ASSERT_NO_THROW(c.deallocate(row[i]));
      countdown = 0;
    }
    for (std::size_t i = 0; i < row.size(); i += 2) {
      ASSERT_NO_THROW(row[i] = *c.allocate(row[i].bytes)) << "round " << round << " block " << i;
      countdown = 0;
    }
  }
  countdown = -1;
  EXPECT_EQ(c.check_invariants(), "");
  EXPECT_EQ(c.stats().live_allocations, 101U);
  // Without a reserve, the first allocation asks for memory (the pool grows from empty).
  Allocator b(core::growing, 256);
  countdown = 0;
  EXPECT_THROW((void)b.allocate(1000), std::bad_alloc);
  countdown = -1;
  EXPECT_EQ(b.check_invariants(), "");
  EXPECT_EQ(b.used(), 0U);
}

TEST(reserve, tlsf_allocates_nothing_while_the_blocks_stay_within_the_reserve) {
  allocates_nothing_within_the_reserve<core::tlsf_allocator>();
}
TEST(reserve, best_fit_allocates_nothing_while_the_blocks_stay_within_the_reserve) {
  allocates_nothing_within_the_reserve<core::best_fit_allocator>();
}

// A reserve that cannot be had changes nothing: the allocator goes on as before, and a
// reserve no larger than the pool already is asks for nothing.
template <class Allocator>
void reserve_without_memory_changes_nothing() {
  Allocator a(core::growing, 256);
  const auto first = *a.allocate(1000);
  const auto second = *a.allocate(5000);
  a.deallocate(first);
  const int injected = inject_until_success([&] { a.reserve(100'000); }, [&] {
    ASSERT_EQ(a.check_invariants(), "");
    ASSERT_EQ(a.used(), 5120U);
    ASSERT_EQ(a.stats().free_blocks, 1U);
  });
  EXPECT_GT(injected, 0);
  countdown = 0;
  EXPECT_NO_THROW(a.reserve(50'000));  // within what is reserved: no allocation
  countdown = -1;
  EXPECT_THROW(a.reserve(std::size_t{0xffffffffU} - 17U), std::length_error);
  EXPECT_NO_THROW(a.deallocate(second));
  EXPECT_EQ(a.check_invariants(), "");
  EXPECT_EQ(a.used(), 0U);
}

TEST(reserve, tlsf_reserve_without_memory_changes_nothing) {
  reserve_without_memory_changes_nothing<core::tlsf_allocator>();
}
TEST(reserve, best_fit_reserve_without_memory_changes_nothing) {
  reserve_without_memory_changes_nothing<core::best_fit_allocator>();
}

// The pinned pool: an allocation that fails for lack of memory (its slab's record, the live
// table) leaves every count as it was and no slab mapped behind it (a slab's mapping is
// undone); frees and trims allocate nothing.
TEST(strong_guarantee, pinned_pool_allocate_free_and_trim) {
  memory::pinned_pool pool(memory::pool_options{.slab_bytes = 1 << 20});
  std::mt19937_64 rng(5);
  std::vector<void*> live;
  int injected = 0;
  for (int step = 0; step < 200; ++step) {
    if (live.empty() || rng() % 100 < 60) {
      // Mostly fits a slab; sometimes a new shared slab or one of its own.
      const std::size_t bytes = rng() % 10 == 0 ? (1 << 20) + 1 + rng() % (1 << 20) : 1 + rng() % (300 << 10);
      const memory::pool_stats before = pool.stats();
      void* got = nullptr;
      injected += inject_until_success([&] { got = pool.allocate(bytes, 256); }, [&] {
        const memory::pool_stats now = pool.stats();
        ASSERT_EQ(now.slabs, before.slabs);
        ASSERT_EQ(now.slab_bytes, before.slab_bytes);
        ASSERT_EQ(now.locked_bytes, before.locked_bytes);  // no mapping left behind
        ASSERT_EQ(now.allocations, before.allocations);
        ASSERT_EQ(now.in_use_bytes, before.in_use_bytes);
        ASSERT_EQ(now.total_allocations, before.total_allocations);
      });
      ASSERT_NE(got, nullptr);
      live.push_back(got);
    } else {
      const std::size_t i = rng() % live.size();
      countdown = 0;  // frees and trims must not allocate: any allocation here would throw
      ASSERT_TRUE(pool.free(live[i]));
      if (step % 7 == 0) pool.trim();
      countdown = -1;
      live[i] = live.back();
      live.pop_back();
    }
    ASSERT_EQ(pool.stats().locked_bytes, pool.stats().slab_bytes) << "step " << step;
  }
  EXPECT_GT(injected, 0);
  for (void* p : live) EXPECT_TRUE(pool.free(p));
  pool.trim();
  EXPECT_EQ(pool.stats().locked_bytes, 0U);
}

// A swapper that cannot be made for lack of memory (its staging buffers' records, its
// engine, its threads' state) gives back every staging buffer it took from the pool.
TEST(strong_guarantee, a_swapper_that_cannot_be_made_gives_its_staging_buffers_back) {
  memory::pinned_pool pool(memory::pool_options{.slab_bytes = 4 << 20});
  for (const auto engine : {io::engine_kind::uring, io::engine_kind::threads}) {
    const int injected = inject_until_success(
        [&] { swap::tensor_swapper s(pool, swap::swap_options{.engine = engine, .staging_buffers = 4}); },
        [&] { ASSERT_EQ(pool.stats().allocations, 0U); });
    EXPECT_GT(injected, 3);
    EXPECT_EQ(pool.stats().allocations, 0U);
  }
}

// An offloaded optimizer's first state written under memory failures: every failure gives
// the pinned buffers back; the state is written once a try gets through.
TEST(strong_guarantee, an_optimizer_whose_first_state_cannot_be_written_keeps_no_pinned_buffer) {
  const scratch_folder scratch;
  const std::string dir = scratch.path;
  {
    offload::optimizer_options options;
    options.swap.folders = {dir};
    options.group_bytes = 16 << 10;
    options.pipeline.pinned_budget = 256 << 10;
    offload::offloaded_optimizer opt({10000, 3000, 20000}, options);
    std::vector<std::vector<float>> values = {std::vector<float>(10000, 1.0F), std::vector<float>(3000, 2.0F),
                                              std::vector<float>(20000, 3.0F)};
    const std::vector<const float*> params = {values[0].data(), values[1].data(), values[2].data()};
    int failed = 0;
    {
      // What is read once per process (the machine's memory, cached on the first call, which
      // falls back to "unknown" where it cannot be read) is read here, before any fault.
      offload::offloaded_optimizer first({10000, 3000, 20000}, options);
      first.initialize(params);
    }
    for (long n = 0; n < 400 && !opt.initialized(); ++n) {
      countdown = n;
      try {
        opt.initialize(params);
      } catch (const std::bad_alloc&) {
        ++failed;
      }
      countdown = -1;
      ASSERT_EQ(opt.pool().stats().allocations, 0U) << "allocation " << n << " failed";
    }
    EXPECT_TRUE(opt.initialized());
    EXPECT_GT(failed, 0);
  }
}

// An offloaded optimizer's step out of memory, on the caller's thread (each of its
// allocations in turn) or on the library's threads (the n-th allocation off it): a step that
// fails leaves the parameters, the step counts and the committed state as they were, and the
// next step gives exactly what a twin that never failed gives.
// Two offloaded optimizers over the same parameters' values (each its own copy) and
// gradients, initialized: one to fail, its twin never.
struct optimizer_and_twin {
  scratch_folder scratch;
  std::vector<std::uint64_t> numels = {900, 300, 1600};
  std::unique_ptr<offload::offloaded_optimizer> opt, twin;
  std::vector<std::vector<float>> values, twin_values, grads;
  std::vector<float*> params, twin_params;
  std::vector<const float*> grad_ptrs;
  std::vector<offload::param_hyper> hyper;

  optimizer_and_twin() : hyper(numels.size()) {
    const auto make = [&](const std::string& name) {
      offload::optimizer_options options;
      options.swap.folders = {scratch.path};
      options.group_bytes = 8 << 10;
      options.pipeline.pinned_budget = 96 << 10;
      options.name = name;
      return std::make_unique<offload::offloaded_optimizer>(numels, options);
    };
    opt = make("faulty");
    twin = make("twin");
    for (std::size_t i = 0; i < numels.size(); ++i) {
      values.emplace_back(numels[i]);
      grads.emplace_back(numels[i]);
      for (std::size_t k = 0; k < numels[i]; ++k) {
        values[i][k] = static_cast<float>((k * 7 + i) % 101) / 50.0F - 1.0F;
        grads[i][k] = static_cast<float>((k * 13 + i) % 97) / 97.0F - 0.5F;
      }
    }
    twin_values = values;
    for (auto& x : values) params.push_back(x.data());
    for (auto& x : twin_values) twin_params.push_back(x.data());
    for (const auto& g : grads) grad_ptrs.push_back(g.data());
    opt->initialize(std::vector<const float*>(params.begin(), params.end()));
    twin->initialize(std::vector<const float*>(twin_params.begin(), twin_params.end()));
  }
};

TEST(strong_guarantee, an_optimizer_step_out_of_memory_changes_nothing) {
  optimizer_and_twin t;
  auto& [scratch, numels, opt, twin, values, twin_values, grads, params, twin_params, grad_ptrs, hyper] = t;
  int failed = 0;
  std::array<bool, 2> beyond = {false, false};  // each side's last round made fewer allocations than its count
  for (long n = 0; n < 3000 && !(beyond[0] && beyond[1]); ++n) {
    const auto before = values;
    const auto steps_before = opt->steps();
    bool reached = false;
    try {
      if (n % 2 == 0) {
        countdown = n / 2;  // the caller's thread
      } else {
        armed_thread = std::this_thread::get_id();
        other_countdown = n / 2;  // the library's threads
      }
      opt->step(params, grad_ptrs, hyper);
      reached = countdown < 0 && n % 2 == 0;
      countdown = -1;
      reached |= other_countdown.exchange(-1) < 0;
    } catch (const std::exception& e) {  // std::bad_alloc, or the I/O's ENOMEM as offload_error
      countdown = -1;
      other_countdown = -1;
      reached = true;
      ++failed;
      ASSERT_EQ(values, before) << "allocation " << n << ": a failed step changed the parameters (" << e.what() << ")";
      ASSERT_EQ(opt->steps(), steps_before) << "allocation " << n;
      continue;  // the same step again, with the next allocation failing
    }
    twin->step(twin_params, grad_ptrs, hyper);
    ASSERT_EQ(values, twin_values) << "allocation " << n << ": the step after the failures differs from the twin's";
    ASSERT_EQ(opt->steps(), twin->steps());
    beyond[static_cast<std::size_t>(n % 2)] = !reached;
  }
  EXPECT_GT(failed, 10);
}

// A step that fails and whose undoing then fails too (two failures on the caller's thread:
// the n-th allocation, then the k-th after it, for every n and k): the error is
// step_not_undone naming the parameters that may have changed, every other parameter is as
// it was, restore_parameters puts the named ones back, and the next step gives the twin's.
TEST(strong_guarantee, an_optimizer_step_that_cannot_be_undone_says_which_parameters_changed) {
  optimizer_and_twin t;
  auto& [scratch, numels, opt, twin, values, twin_values, grads, params, twin_params, grad_ptrs, hyper] = t;
  int not_undone = 0;
  bool stepped = false;
  for (long n = 0; n < 3000 && !stepped; ++n) {
    for (long k = 0; k < 3000; ++k) {
      const auto before = values;
      const auto steps_before = opt->steps();
      countdown = n;
      then_countdown = k;
      try {
        opt->step(params, grad_ptrs, hyper);
        countdown = then_countdown = -1;
        stepped = true;
        break;
      } catch (const offload::step_not_undone& e) {
        countdown = then_countdown = -1;
        ++not_undone;
        ASSERT_FALSE(e.parameters().empty()) << e.what();
        ASSERT_EQ(e.error(), ENOMEM) << e.what();
        EXPECT_NE(std::string(e.what()).find("restore_parameters"), std::string::npos) << e.what();
        for (std::size_t i = 0; i < numels.size(); ++i) {
          if (std::find(e.parameters().begin(), e.parameters().end(), i) == e.parameters().end()) {
            ASSERT_EQ(values[i], before[i]) << "n " << n << ", k " << k << ": parameter " << i << " changed unnamed";
          }
        }
        ASSERT_EQ(opt->steps(), steps_before);
        opt->restore_parameters(params);
        ASSERT_EQ(values, before) << "n " << n << ", k " << k << ": restore_parameters";
      } catch (const std::exception& e) {  // undone: the second failure came too late, or never
        const bool second_unused = then_countdown >= 0 || countdown >= 0;
        countdown = then_countdown = -1;
        ASSERT_EQ(values, before) << "n " << n << ", k " << k << ": " << e.what();
        ASSERT_EQ(opt->steps(), steps_before);
        if (second_unused) break;  // a later second failure would not come either
      }
    }
  }
  ASSERT_TRUE(stepped);
  twin->step(twin_params, grad_ptrs, hyper);
  ASSERT_EQ(values, twin_values) << "the step after the failures differs from the twin's";
  EXPECT_GT(not_undone, 5);
}

// An offloaded optimizer's save, load and rewrite out of memory (each allocation in turn, on
// the caller's thread and, alternately, off it): a failed save leaves the previous
// checkpoint and no temporary file; a failed load or rewrite leaves the state, step counts
// included, as it was.
TEST(strong_guarantee, an_optimizer_save_load_or_rewrite_out_of_memory_changes_nothing) {
  const scratch_folder scratch;
  offload::optimizer_options options;
  options.swap.folders = {scratch.path};
  options.group_bytes = 8 << 10;
  options.pipeline.pinned_budget = 96 << 10;
  const std::vector<std::uint64_t> numels = {900, 300, 1600};
  offload::offloaded_optimizer opt(numels, options);
  std::vector<std::vector<float>> values;
  for (const std::uint64_t n : numels) values.emplace_back(n, 0.25F);
  std::vector<const float*> initial;
  std::vector<float*> params;
  std::vector<const float*> grads;
  for (auto& v : values) {
    initial.push_back(v.data());
    params.push_back(v.data());
    grads.push_back(v.data());
  }
  opt.initialize(initial);
  const std::vector<offload::param_hyper> hyper(numels.size());
  opt.step(params, grads, hyper);
  const std::string path = scratch.path + "/ck";
  opt.save(path, "first");
  const auto file_bytes = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
  };
  const std::vector<char> first = file_bytes(path);
  const auto state = [&] {
    std::vector<float> all;
    opt.visit([&](const offload::offloaded_optimizer::group&, const float* record) {
      all.insert(all.end(), record, record + 64);  // the head of each record
    });
    return std::make_pair(all, opt.steps());
  };
  opt.step(params, grads, hyper);  // the state now differs from the checkpoint's
  const auto stepped = state();
  const std::string stepped_path = scratch.path + "/stepped";
  opt.save(stepped_path);
  const auto put_file = [](const std::string& p, const std::vector<char>& bytes) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  // Runs `op` with the n-th allocation failing, alternately on the caller's thread and off
  // it, for every n until neither side reaches its count; `failed(n, e)` checks after each
  // failure, `undo` puts things back after a success. Returns the failures.
  const auto each_allocation = [](const auto& op, const auto& failed, const auto& undo) {
    int failures = 0;
    std::array<bool, 2> beyond{};
    for (long n = 0; n < 4000 && !(beyond[0] && beyond[1]); ++n) {
      if (n % 2 == 0) {
        countdown = n / 2;
      } else {
        armed_thread = std::this_thread::get_id();
        other_countdown = n / 2;
      }
      bool reached = false;
      const auto disarm = [&] {
        reached = (n % 2 == 0 && countdown < 0) || other_countdown.load() < 0;
        countdown = -1;
        other_countdown = -1;
      };
      try {
        op();
        disarm();
        undo();
      } catch (const std::exception& e) {
        disarm();
        ++failures;
        failed(n, e);
        if (::testing::Test::HasFatalFailure()) return failures;
      }
      beyond[static_cast<std::size_t>(n % 2)] = !reached;
    }
    return failures;
  };
  const int saves = each_allocation(
      [&] { opt.save(path, "second"); },
      [&](long n, const std::exception& e) {
        ASSERT_EQ(file_bytes(path), first) << "allocation " << n << ": a failed save changed the checkpoint ("
                                           << e.what() << ")";
        for (const auto& entry : std::filesystem::directory_iterator(scratch.path)) {
          ASSERT_EQ(entry.path().filename().string().find(".tensormem-tmp."), std::string::npos)
              << "allocation " << n << ": " << entry.path() << " was left";
        }
      },
      [&] { put_file(path, first); });
  const int loads = each_allocation(
      [&] { opt.load(path); },
      [&](long n, const std::exception& e) {
        ASSERT_EQ(state(), stepped) << "allocation " << n << ": a failed load changed the state (" << e.what() << ")";
      },
      [&] { opt.load(stepped_path); });
  const int rewrites = each_allocation(
      [&] {
        opt.rewrite([](const offload::offloaded_optimizer::group&, float* record) { record[0] += 1.0F; }, {7, 7, 7});
      },
      [&](long n, const std::exception& e) {
        ASSERT_EQ(state(), stepped) << "allocation " << n << ": a failed rewrite changed the state (" << e.what()
                                    << ")";
      },
      [&] { opt.load(stepped_path); });
  EXPECT_GT(saves, 5);
  EXPECT_GT(loads, 5);
  EXPECT_GT(rewrites, 5);
}

// The tracking and trace-log adaptors: an allocation refused for lack of memory takes no
// sequence number, id or time step, so the report and the trace are those of the
// allocations that were made.
TEST(strong_guarantee, adaptors_number_only_the_allocations_made) {
  memory::host_resource host;
  memory::tracking_adaptor tracking(host);
  std::ostringstream log;
  std::vector<std::pair<void*, std::size_t>> made;
  made.reserve(6);  // (the test's own list allocates nothing under the faults)
  {
    memory::trace_log_adaptor logger(tracking, log);
    int failed = 0;
    for (std::size_t i = 0; i < 6; ++i) {
      failed += inject_until_success([&] { made.emplace_back(logger.allocate(64 * (i + 1), 64), 64 * (i + 1)); },
                                     [] {});
    }
    EXPECT_GT(failed, 0);
    for (const auto& [p, bytes] : made) logger.deallocate(p, bytes, 64);
  }
  // Trace lines "a<id>,<lower>,<upper>,<size>": ids 0-5, allocations at steps 0-5, frees 6-11.
  EXPECT_EQ(log.str(), "id,lower,upper,size\na0,0,6,64\na1,1,7,128\na2,2,8,192\na3,3,9,256\na4,4,10,320\n"
                       "a5,5,11,384\n");
  // Straight on a tracking adaptor: three allocations made through faults, then a fourth.
  memory::tracking_adaptor counted(host);
  std::vector<void*> kept(3, nullptr);
  int failed = 0;
  for (void*& p : kept) failed += inject_until_success([&] { p = counted.allocate(8, 8); }, [] {});
  EXPECT_GT(failed, 0);
  for (void* p : kept) counted.deallocate(p, 8, 8);
  void* p = counted.allocate(8, 8);
  EXPECT_EQ(counted.leak_report().rfind("#3 ", 0), 0U) << counted.leak_report();  // three before it
  counted.deallocate(p, 8, 8);
}

std::size_t open_descriptors() {
  return static_cast<std::size_t>(std::distance(std::filesystem::directory_iterator("/proc/self/fd"),
                                                std::filesystem::directory_iterator{}));
}

// A read or write that cannot be queued for lack of memory (its op, its requests on each
// ring) leaves nothing behind: wait() has nothing to wait for, the file is closed, and no
// part of a write reaches the file. Before, an op was registered before its requests were
// queued: a failure in between left one that wait() waited for for ever, or a write of
// which some blocks went out after the caller was told it failed.
TEST(strong_guarantee, a_transfer_that_cannot_be_queued_leaves_nothing_behind) {
  const scratch_folder scratch;
  const std::string dir = scratch.path;
  constexpr std::size_t bytes = 64 * 4096;
  auto* data = static_cast<std::byte*>(std::aligned_alloc(4096, bytes));
  for (const unsigned rings : {1U, 3U}) {
    io::file_io_options options;
    options.block_bytes = 4096;
    options.rings = rings;
    options.engine = io::engine_kind::threads;
    io::async_file_io io(options);
    const std::string path = dir + "/f" + std::to_string(rings);
    std::memset(data, 1, bytes);
    io.write(data, bytes, path, 0);
    ASSERT_TRUE(io.wait().errors.empty());
    const std::size_t descriptors = open_descriptors();
    int failed = 0;
    for (long n = 0; n < 200; ++n) {
      std::memset(data, 2, bytes);
      countdown = n;
      bool queued = true;
      try {
        io.write(data, bytes, path, 0);
      } catch (const std::bad_alloc&) {
        queued = false;
        ++failed;
      }
      countdown = -1;
      const auto done = io.wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(10));
      ASSERT_TRUE(done.has_value()) << "allocation " << n << ": wait() waits for an op that was never queued";
      ASSERT_TRUE(done->errors.empty());
      ASSERT_EQ(done->completed, queued ? 1U : 0U) << "allocation " << n << ": an op never queued was collected";
      ASSERT_EQ(io.pending(), 0U) << "allocation " << n;
      ASSERT_EQ(open_descriptors(), descriptors) << "allocation " << n;
      // The file holds the old bytes (1) after a refused write, the new (2) after a queued one.
      std::memset(data, 0, bytes);
      io.read(data, bytes, path, 0);
      ASSERT_TRUE(io.wait().errors.empty());
      const auto expected = std::byte{static_cast<unsigned char>(queued ? 2 : 1)};
      for (std::size_t i = 0; i < bytes; i += 4096) {
        ASSERT_EQ(data[i], expected) << "allocation " << n << ", byte " << i;
      }
      std::memset(data, 1, bytes);  // back to the old bytes for the next round
      io.write(data, bytes, path, 0);
      ASSERT_TRUE(io.wait().errors.empty());
      if (queued && n > 20) break;
    }
    EXPECT_GT(failed, 0);
  }
  std::free(data);
}

// An I/O engine out of memory loses no completion and returns none twice: `submit` takes
// every request or none, a `wait` that fails keeps what it had reaped (reaping itself never
// allocates: a completion taken from the ring and then lost would leave its request
// outstanding for ever), and the thread engine's workers never allocate, since on their
// threads a std::bad_alloc would end the process (every allocation off the caller's thread
// fails here).
TEST(strong_guarantee, io_engines_lose_no_completion_when_out_of_memory) {
  char templ[] = "/tmp/tensormem-fault-XXXXXX";
  const int file = ::mkstemp(templ);
  ASSERT_GE(file, 0);
  constexpr std::size_t count = 16;
  constexpr std::size_t bytes = 4096;
  std::vector<std::byte> contents(count * bytes);
  for (std::size_t i = 0; i < contents.size(); ++i) contents[i] = std::byte{static_cast<unsigned char>(i / bytes + 1)};
  ASSERT_EQ(::pwrite(file, contents.data(), contents.size(), 0), static_cast<ssize_t>(contents.size()));
  std::vector<std::byte> into(contents.size());
  for (const io::engine_kind kind : {io::engine_kind::uring, io::engine_kind::threads}) {
    SCOPED_TRACE(std::string(io::to_string(kind)));
    const disarm_on_exit disarm;
    int failed_submits = 0;
    int failed_waits = 0;
    for (long n = 0; n < 60; ++n) {  // a new engine each round: its first allocations fail
      std::unique_ptr<io::io_engine> engine;
      try {
        engine = kind == io::engine_kind::uring ? io::make_uring_engine(4) : io::make_thread_engine(4, 2);
      } catch (const std::system_error& e) {
        std::cerr << "io_uring unavailable here (" << e.what() << "): its engine not tested\n";
        break;
      }
      armed_thread = std::this_thread::get_id();
      fail_on_other_threads = true;
      std::fill(into.begin(), into.end(), std::byte{0});
      std::vector<io::io_request> requests(count);
      for (std::size_t i = 0; i < count; ++i) {
        requests[i].fd = file;
        requests[i].offset = i * bytes;
        requests[i].buffer = into.data() + i * bytes;
        requests[i].bytes = bytes;
        requests[i].user_data = i;
      }
      countdown = n % 4;
      try {
        engine->submit(requests);
      } catch (const std::bad_alloc&) {
        countdown = -1;
        ++failed_submits;
        ASSERT_EQ(engine->outstanding(), 0U) << "a refused submit kept some of its requests";
        engine->submit(requests);
      }
      countdown = -1;
      ASSERT_EQ(engine->outstanding(), count);
      std::map<std::uint64_t, int> seen;
      long failing_waits = n % 5;  // this round's first waits each fail at one allocation
      while (engine->outstanding() != 0) {
        countdown = failing_waits-- > 0 ? n % 3 : -1;
        std::vector<io::io_completion> done;
        try {
          done = engine->wait(static_cast<std::size_t>(1 + n % 3));
        } catch (const std::bad_alloc&) {
          ++failed_waits;
        }
        countdown = -1;
        for (const io::io_completion& c : done) {
          ++seen[c.user_data];
          EXPECT_EQ(c.result, static_cast<std::int64_t>(bytes)) << c.user_data;
        }
      }
      ASSERT_EQ(seen.size(), count) << "round " << n << ": a completion was lost";
      for (const auto& [id, times] : seen) {
        ASSERT_LT(id, count);
        ASSERT_EQ(times, 1) << "round " << n << ": completion " << id << " returned twice";
      }
      ASSERT_EQ(into, contents) << "round " << n;
      engine.reset();
      fail_on_other_threads = false;
    }
    fail_on_other_threads = false;
    if (failed_submits + failed_waits == 0) continue;  // (io_uring unavailable)
    EXPECT_GT(failed_submits, 0);
    EXPECT_GT(failed_waits, 0);
  }
  ::close(file);
  ::unlink(templ);
}

// A ring's thread out of memory (every allocation off the caller's thread fails) does not
// end the process: what it cannot hand to its engine fails with ENOMEM, what it cannot
// collect yet it collects once memory is back, and the handle goes on working.
TEST(strong_guarantee, a_ring_thread_out_of_memory_fails_operations_and_goes_on) {
  const scratch_folder scratch;
  const std::string path = scratch.path + "/f";
  constexpr std::size_t bytes = 64 * 4096;
  auto* data = static_cast<std::byte*>(std::aligned_alloc(4096, bytes));
  for (const io::engine_kind kind : {io::engine_kind::uring, io::engine_kind::threads}) {
    SCOPED_TRACE(std::string(io::to_string(kind)));
    io::file_io_options options;
    options.block_bytes = 4096;
    options.rings = 2;
    options.engine = kind;
    io::async_file_io io(options);
    int failed = 0;
    for (std::size_t blocks = 1; blocks <= 64; blocks *= 2) {  // more than before: the engines must grow
      std::memset(data, static_cast<int>(blocks), bytes);
      armed_thread = std::this_thread::get_id();
      fail_on_other_threads = true;
      io.write(data, blocks * 4096, path, 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      fail_on_other_threads = false;
      const auto r = io.wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(60));
      ASSERT_TRUE(r.has_value()) << blocks;
      for (const auto& e : r->errors) {
        EXPECT_EQ(e.error, ENOMEM) << e.message;
        ++failed;
      }
      io.write(data, blocks * 4096, path, 0);  // memory is back
      ASSERT_TRUE(io.wait().errors.empty());
      std::memset(data, 0, bytes);
      io.read(data, blocks * 4096, path, 0);
      ASSERT_TRUE(io.wait().errors.empty());
      for (std::size_t i = 0; i < blocks * 4096; i += 512) {
        ASSERT_EQ(data[i], std::byte{static_cast<unsigned char>(blocks)}) << i;
      }
    }
    EXPECT_GT(failed, 0);
  }
  std::free(data);
}

// A wait or wait_for that runs out of memory (its result, a validation's read-back buffer)
// collects nothing: the operations stay pending and a later call reports them.
TEST(strong_guarantee, a_wait_out_of_memory_collects_nothing) {
  const scratch_folder scratch;
  const std::string dir = scratch.path;
  std::vector<std::byte> data(3 * 8192, std::byte{7});
  io::file_io_options options;
  options.block_bytes = 4096;
  options.engine = io::engine_kind::threads;
  io::async_file_io io(options);
  int failed = 0;
  failed += inject_until_success(
      [&] {
        if (io.pending() == 0) {  // queued without faults: only the wait's allocations fail
          const long armed = std::exchange(countdown, -1);
          for (int i = 0; i < 3; ++i) io.write(data.data() + i * 8192, 8192, dir + "/" + std::to_string(i), 0, true);
          countdown = armed;
        }
        const io::async_file_io::wait_result r = io.wait();
        countdown = -1;
        EXPECT_EQ(r.completed, 3U);
        EXPECT_TRUE(r.errors.empty());
      },
      [&] { ASSERT_EQ(io.pending(), 3U) << "a failed wait collected operations"; });
  std::uint64_t ticket = 0;
  failed += inject_until_success(
      [&] {
        if (io.pending() == 0) {
          const long armed = std::exchange(countdown, -1);
          ticket = io.write(data.data(), 8192, dir + "/t", 0, true);
          countdown = armed;
        }
        const io::file_io_error e = io.wait_for(ticket);
        countdown = -1;
        EXPECT_EQ(e.error, 0) << e.message;
      },
      [&] { ASSERT_EQ(io.pending(), 1U) << "a failed wait_for collected its operation"; });
  EXPECT_EQ(io.pending(), 0U);
  EXPECT_GE(failed, 4);
}

// A swapper whose threads run out of memory (the n-th allocation off the caller's thread
// fails, for every n until a round sees none: each place where the worker, the committer or
// the engine allocates) does not end the process and loses nothing: a transfer fails with
// ENOMEM and a message, a failed swap-out leaves the version before it, a swap-in that
// succeeds is exact, and no temporary file stays. Plain files (reused spares and files of
// their own), packed slots, both engines. Before, any such failure ended the process.
TEST(strong_guarantee, a_swapper_whose_threads_run_out_of_memory_fails_transfers_and_loses_nothing) {
  const scratch_folder scratch;
  const std::filesystem::path dir = scratch.path;
  memory::pinned_pool pool(memory::pool_options{.slab_bytes = 4 << 20});
  struct mode {
    io::engine_kind engine;
    bool reuse;
    std::size_t pack_below;
  };
  const std::vector<std::size_t> sizes = {5000, 65536, 3 * 65536 + 17};
  const auto fill = [](std::vector<std::byte>& t, long version) {
    const auto v = static_cast<std::size_t>(version);
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = std::byte{static_cast<unsigned char>(v * 31 + i % 251)};
  };
  for (const mode m : {mode{io::engine_kind::uring, true, 0}, mode{io::engine_kind::uring, false, 0},
                       mode{io::engine_kind::threads, true, 0}, mode{io::engine_kind::uring, true, 1U << 20}}) {
    SCOPED_TRACE(std::string(io::to_string(m.engine)) + (m.reuse ? ", spares" : ", own files") +
                 (m.pack_below != 0 ? ", packed" : ""));
    const std::filesystem::path here = dir / std::to_string(m.reuse) / std::to_string(m.pack_below) /
                                       std::string(io::to_string(m.engine));
    std::filesystem::create_directories(here);
    // A new swapper each round where the files outlive it (not packs), so that what a swapper
    // makes on first use is made under the faults too.
    std::optional<swap::tensor_swapper> swapper;
    const auto make = [&] {
      swapper.emplace(pool, swap::swap_options{.engine = m.engine, .block_bytes = 65536, .staging_buffers = 4,
                                               .reuse_files = m.reuse, .pack_below = m.pack_below});
      return &*swapper;
    };
    swap::tensor_swapper* s = make();
    std::vector<std::vector<std::byte>> data;
    std::vector<swap::tensor_ref> refs;
    std::vector<std::string> paths;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      data.emplace_back(sizes[i]);
      paths.push_back((here / ("t" + std::to_string(i))).string());
    }
    for (auto& t : data) refs.push_back({t.data(), t.size()});
    std::vector<long> on_disk(sizes.size(), 1);
    for (auto& t : data) fill(t, 1);
    for (const auto& r : s->wait(s->swap_out(refs, paths))) ASSERT_EQ(r.error, 0) << r.message;
    const auto check = [&](const std::vector<swap::swap_result>& results, long n) {
      int failed = 0;
      for (const auto& r : results) {
        if (r.error == 0) continue;
        EXPECT_EQ(r.error, ENOMEM) << "allocation " << n << ": " << r.message;
        EXPECT_NE(r.message, "") << "allocation " << n;
        ++failed;
      }
      return failed;
    };
    int failures = 0;
    for (long n = 0; n < 2000; ++n) {
      const long version = n + 2;
      for (auto& t : data) fill(t, version);
      if (m.pack_below == 0) s = make();
      armed_thread = std::this_thread::get_id();
      other_countdown = n;
      const std::vector<swap::swap_result> out = s->wait(s->swap_out(refs, paths));
      bool reached = other_countdown.exchange(-1) < 0;  // the n-th allocation came (and failed)
      int failed = check(out, n);
      for (std::size_t i = 0; i < out.size(); ++i) {
        if (out[i].error == 0) on_disk[i] = version;
      }
      for (auto& t : data) std::fill(t.begin(), t.end(), std::byte{0});
      other_countdown = n;
      const std::vector<swap::swap_result> in = s->wait(s->swap_in(paths, refs));
      reached |= other_countdown.exchange(-1) < 0;
      failed += check(in, n);
      std::vector<std::byte> expected;
      for (std::size_t i = 0; i < in.size(); ++i) {
        if (in[i].error != 0) continue;
        expected.resize(sizes[i]);
        fill(expected, on_disk[i]);
        ASSERT_EQ(data[i], expected) << "allocation " << n << ": " << paths[i];
      }
      // With memory back, every tensor reads back as its last completed swap-out left it.
      for (auto& t : data) std::fill(t.begin(), t.end(), std::byte{0});
      for (const auto& r : s->wait(s->swap_in(paths, refs))) {
        ASSERT_EQ(r.error, 0) << "allocation " << n << ": " << r.message;
      }
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        expected.resize(sizes[i]);
        fill(expected, on_disk[i]);
        ASSERT_EQ(data[i], expected) << "allocation " << n << ": " << paths[i] << " lost a version";
      }
      if (m.pack_below == 0) {  // a file of another tensor: refused for its header, or for memory
        const std::string other = "another tensor";
        other_countdown = n;
        const std::vector<swap::swap_result> refused = s->wait(s->swap_in({&paths[2], 1}, {&refs[2], 1}, {&other, 1}));
        reached |= other_countdown.exchange(-1) < 0;
        EXPECT_TRUE(refused[0].error == EINVAL || refused[0].error == ENOMEM) << refused[0].message;
        EXPECT_NE(refused[0].message, "");
      }
      {  // a file that is not there: ENOENT (or ENOMEM), with a message even where none could be made
        const std::string missing = (here / "missing").string();
        other_countdown = n;
        const std::vector<swap::swap_result> none = s->wait(s->swap_in({&missing, 1}, {&refs[0], 1}));
        reached |= other_countdown.exchange(-1) < 0;
        EXPECT_TRUE(none[0].error == ENOENT || none[0].error == ENOMEM) << none[0].message;
        EXPECT_NE(none[0].message.find(missing), std::string::npos) << none[0].message;
      }
      if (m.pack_below != 0) {  // a path packed for the first time: the index gains its entry
        std::vector<std::byte> fresh(3000);
        fill(fresh, version);
        const std::string path = (here / ("fresh" + std::to_string(n))).string();
        const swap::tensor_ref ref{fresh.data(), fresh.size()};
        other_countdown = n;
        const std::vector<swap::swap_result> first = s->wait(s->swap_out({&ref, 1}, {&path, 1}));
        reached |= other_countdown.exchange(-1) < 0;
        failed += check(first, n);
        if (first[0].error == 0) {
          std::fill(fresh.begin(), fresh.end(), std::byte{0});
          for (const auto& r : s->wait(s->swap_in({&path, 1}, {&ref, 1}))) ASSERT_EQ(r.error, 0) << r.message;
          expected.resize(fresh.size());
          fill(expected, version);
          ASSERT_EQ(fresh, expected) << "allocation " << n << ": " << path;
        }
      }
      failures += failed;
      if (!reached) break;  // the threads made fewer than n allocations in the round
    }
    EXPECT_GT(failures, 2);
    swapper.reset();
  }
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    EXPECT_EQ(e.path().filename().string().find(".tensormem-tmp."), std::string::npos) << e.path() << " was left";
  }
}

// A swap-out or swap-in refused for lack of memory on the caller's thread (at each of its
// allocations in turn) leaves nothing behind: no transfer to wait for, no path or memory
// held; a wait refused so collects nothing, and the ticket can be waited for again.
TEST(strong_guarantee, a_swap_that_cannot_be_queued_or_collected_changes_nothing) {
  const scratch_folder scratch;
  const std::filesystem::path dir = scratch.path;
  memory::pinned_pool pool(memory::pool_options{.slab_bytes = 4 << 20});
  for (const std::size_t pack_below : {std::size_t{0}, std::size_t{1} << 20}) {
    SCOPED_TRACE(pack_below != 0 ? "packed" : "files");
    swap::tensor_swapper s(pool, swap::swap_options{.block_bytes = 65536, .staging_buffers = 4,
                                                    .pack_below = pack_below});
    std::vector<std::vector<std::byte>> data;
    std::vector<swap::tensor_ref> refs;
    std::vector<std::string> paths;
    for (const std::size_t bytes : {std::size_t{5000}, std::size_t{65536}, std::size_t{3 * 65536 + 17}}) {
      data.emplace_back(bytes);
      for (std::size_t i = 0; i < bytes; ++i) data.back()[i] = std::byte{static_cast<unsigned char>(bytes + i % 253)};
      paths.push_back((dir / (std::to_string(pack_below) + "-" + std::to_string(bytes))).string());
    }
    for (auto& t : data) refs.push_back({t.data(), t.size()});
    const std::vector<std::vector<std::byte>> written = data;
    const auto nothing_left = [&] {
      ASSERT_TRUE(s.synchronize_until(std::chrono::steady_clock::now() + std::chrono::seconds(20)))
          << "a refused transfer left one behind, waited for for ever";
    };
    for (const bool out : {true, false, true, false}) {  // (the second time, what the first left made)
      std::uint64_t ticket = 0;
      int injected = inject_until_success(
          [&] { ticket = out ? s.swap_out(refs, paths) : s.swap_in(paths, refs); }, nothing_left);
      EXPECT_GT(injected, 3);
      std::vector<swap::swap_result> results;
      injected = inject_until_success([&] { results = s.wait(ticket); },
                                      [&] { ASSERT_TRUE(s.outstanding(ticket)) << "a failed wait collected it"; });
      EXPECT_GT(injected, 0);
      ASSERT_EQ(results.size(), paths.size());
      for (const auto& r : results) EXPECT_EQ(r.error, 0) << r.message;
      if (out) {
        for (auto& t : data) std::fill(t.begin(), t.end(), std::byte{0});
      } else {
        EXPECT_EQ(data, written);
      }
    }
  }
}

// A swapper destroyed with a swap-out not waited for, where collecting its results runs out of
// memory: the destructor still waits for the transfers to end before the staging goes back to
// the pool, and returns; what was swapped out reads back whole.
TEST(strong_guarantee, a_swapper_destroyed_out_of_memory_waits_for_its_transfers) {
  const scratch_folder scratch;
  memory::pinned_pool pool(memory::pool_options{.slab_bytes = 4 << 20});
  std::vector<std::byte> data(3 * 65536 + 17);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = std::byte{static_cast<unsigned char>(i % 251)};
  const std::string path = (std::filesystem::path(scratch.path) / "t").string();
  const swap::tensor_ref ref{data.data(), data.size()};
  {
    swap::tensor_swapper s(pool, swap::swap_options{.block_bytes = 65536, .staging_buffers = 4});
    s.swap_out({&ref, 1}, {&path, 1});
    countdown = 0;  // the destructor's first allocation, collecting the results, fails
  }
  countdown = -1;
  EXPECT_EQ(pool.stats().in_use_bytes, 0U);
  swap::tensor_swapper again(pool, swap::swap_options{.block_bytes = 65536, .staging_buffers = 4});
  std::vector<std::byte> back(data.size());
  const swap::tensor_ref in{back.data(), back.size()};
  const auto r = again.wait(again.swap_in({&path, 1}, {&in, 1}));
  ASSERT_EQ(r.size(), 1U);
  EXPECT_EQ(r[0].error, 0) << r[0].message;
  EXPECT_EQ(back, data);
}

// The swapper's record of the memory its transfers use: an add or remove refused for lack of
// memory changes nothing (no key left that changes no count), and after reserve(k) the next
// k new keys need no memory.
TEST(strong_guarantee, range_cover_changes_all_or_nothing) {
  swap::detail::range_cover c;
  c.add(100, 200);
  c.add(300, 400);
  const auto same_as_before = [&] {
    ASSERT_EQ(c.keys(), 4U) << "a refused change left a key";
    ASSERT_TRUE(c.overlaps(150, 151));
    ASSERT_FALSE(c.overlaps(200, 300));
  };
  EXPECT_GT(inject_until_success([&] { c.add(250, 270); }, same_as_before), 0);  // two new keys
  EXPECT_EQ(c.keys(), 6U);
  c.remove(250, 270);
  EXPECT_EQ(c.keys(), 4U);
  c.add(100, 400);  // 100-200 and 300-400 twice, 200-300 once
  EXPECT_EQ(c.keys(), 4U);
  c.reserve(2);
  countdown = 0;  // every allocation from here fails
  c.remove(100, 200);  // keys at 100 (count 1) and 200 (count 1): 200 merges away, none new
  c.remove(150, 160);  // two new keys, from the reserve
  countdown = -1;
  EXPECT_TRUE(c.overlaps(140, 150));
  EXPECT_FALSE(c.overlaps(150, 160));
  EXPECT_TRUE(c.overlaps(160, 170));
}

/// Adds `count` tensors of `bytes` named t0, t1... to `space` and commits a first generation
/// of each, every byte `value`; returns their ids.
std::vector<std::size_t> committed_tensors(offload::swap_space& space, int count, std::size_t bytes, int value) {
  void* staged = std::aligned_alloc(4096, bytes);
  std::memset(staged, value, bytes);
  std::vector<std::size_t> ids;
  for (int i = 0; i < count; ++i) {
    ids.push_back(space.add("t" + std::to_string(i), bytes));
    auto t = space.write(ids.back(), staged);
    space.finish(t);
    space.commit(ids.back());
  }
  std::free(staged);
  return ids;
}

// A prefetch pipeline that cannot be made for lack of memory (its buffers' list, the reads
// it starts, its collector thread) gives back every buffer it took, after any read it
// started into one has ended.
TEST(strong_guarantee, a_prefetch_pipeline_that_cannot_be_made_gives_its_buffers_back) {
  const scratch_folder scratch;
  const std::string dir = scratch.path;
  {
    offload::swap_space_options options;
    options.folders = {dir};
    offload::swap_space space(options);
    const std::vector<std::size_t> ids = committed_tensors(space, 6, 8192, 7);
    memory::pinned_pool pool(memory::pool_options{.slab_bytes = 1 << 20});
    // Every allocation of the construction in turn, whether or not it ends the construction
    // (a read that cannot start is the item's error, reported when it is acquired).
    int failed = 0;
    for (long n = 0; n < 400; ++n) {
      std::optional<offload::prefetch_pipeline> p;
      countdown = n;
      try {
        p.emplace(space, pool, ids, offload::pipeline_options{3 * 8192, 0});
      } catch (const std::bad_alloc&) {
        ++failed;
      }
      countdown = -1;
      p.reset();
      ASSERT_EQ(pool.stats().allocations, 0U) << "allocation " << n << " failed";
    }
    EXPECT_GT(failed, 3);
  }
}

// A prefetch pipeline's write-backs under memory failures, on the caller's thread (a
// release's k-th allocation) and on the library's threads (the n-th allocation off the
// caller's thread, for every n: the collector, the I/O rings): the process goes on, a write
// that could not be made is reported by finish() (a read, by acquire()), and every tensor
// `written()` names reads back as written, every other one as it was. Before, the
// collector's record of the tensors written could end the process.
TEST(strong_guarantee, a_prefetch_pipeline_out_of_memory_loses_no_write_back) {
  const scratch_folder scratch;
  const std::string dir = scratch.path;
  {
    offload::swap_space_options options;
    options.folders = {dir};
    offload::swap_space space(options);
    constexpr std::size_t bytes = 8192;
    const std::vector<std::size_t> ids = committed_tensors(space, 6, bytes, 1);
    void* staged = std::aligned_alloc(4096, bytes);
    memory::pinned_pool pool(memory::pool_options{.slab_bytes = 1 << 20});
    int failed_runs = 0;
    for (long n = 0; n < 2000; ++n) {
      const auto round = static_cast<unsigned char>(n % 200 + 2);
      bool write_failed = false;
      std::size_t released = 0;
      std::vector<std::size_t> written;
      armed_thread = std::this_thread::get_id();
      other_countdown = n;
      {
        offload::prefetch_pipeline p(space, pool, ids, offload::pipeline_options{3 * bytes, 0});
        for (std::size_t i = 0; i < ids.size(); ++i) {
          std::byte* b = nullptr;
          try {
            b = p.acquire(i);
          } catch (const offload::offload_error& e) {  // its read failed (ENOMEM): reported here
            EXPECT_EQ(e.error(), ENOMEM) << e.what();
            continue;
          } catch (const std::bad_alloc&) {  // its read could not be started
            continue;
          }
          ASSERT_EQ(b[0], std::byte{1}) << "allocation " << n << ", position " << i;
          std::memset(b, round, bytes);
          const disarm_on_exit disarm;
          if (i == static_cast<std::size_t>(n) % ids.size()) countdown = n % 5;  // this release's k-th allocation
          p.release(i, true);  // a failure is kept for finish()
          ++released;
        }
        try {
          p.finish();
        } catch (const std::exception&) {
          write_failed = true;
        }
        written = p.written();
      }
      const bool reached = other_countdown.exchange(-1) < 0;
      failed_runs += write_failed ? 1 : 0;
      if (!write_failed) {
        EXPECT_EQ(written.size(), released) << "allocation " << n;
      }
      for (const std::size_t id : written) space.commit(id);
      for (const std::size_t id : ids) {
        std::memset(staged, 0, bytes);
        auto t = space.read(id, staged);
        space.finish(t);
        const bool fresh = std::find(written.begin(), written.end(), id) != written.end();
        ASSERT_EQ(static_cast<std::byte*>(staged)[bytes - 1], fresh ? std::byte{round} : std::byte{1})
            << "allocation " << n << ", tensor " << id;
        std::memset(staged, 1, bytes);  // back to the first contents for the next round
        t = space.write(id, staged);
        space.finish(t);
        space.commit(id);
      }
      if (!reached && n >= 5) break;  // the threads made fewer than n allocations
    }
    EXPECT_GT(failed_runs, 3);
    std::free(staged);
  }
}

// A tensor that cannot be added to a swap space for lack of memory takes none of a folder's
// capacity: the capacity it would have reserved is there for the next. Before, every such
// failure kept its share reserved, and a folder was reported full while it was not.
TEST(strong_guarantee, a_tensor_refused_for_memory_reserves_no_capacity) {
  const scratch_folder scratch;
  offload::swap_space_options options;
  options.folders = {scratch.path};
  options.capacity_bytes = {2 * 2 * 8192};  // two tensors of 8 KiB, two generations each
  offload::swap_space space(options);
  EXPECT_GT(inject_until_success([&] { space.add("a", 8192); }, [&] { ASSERT_EQ(space.size(), 0U); }), 1);
  EXPECT_NO_THROW(space.add("b", 8192)) << "the failed adds kept capacity";
  EXPECT_THROW(space.add("c", 8192), offload::offload_error);  // now it is full
}

// A swap space's read or write of several stripes that runs out of memory part way (at each
// allocation in turn) ends the stripes it had queued before it throws: nothing lands in the
// buffer afterwards. Before, those stripes were left running, uncollected, on a buffer the
// caller was free to reuse.
TEST(strong_guarantee, a_striped_transfer_refused_for_memory_leaves_nothing_running) {
  const scratch_folder scratch;
  const std::string dir = scratch.path;
  {
    offload::swap_space_options options;
    options.folders = {dir + "/a", dir + "/b"};
    for (const auto& f : options.folders) std::filesystem::create_directory(f);
    options.stripe_bytes = 4096;
    offload::swap_space space(options);
    constexpr std::size_t bytes = 8 * 4096;
    auto* buffer = static_cast<std::byte*>(std::aligned_alloc(4096, bytes));
    const std::size_t id = space.add("t", bytes);
    std::memset(buffer, 7, bytes);
    auto t = space.write(id, buffer);
    space.finish(t);
    space.commit(id);
    int failed = 0;
    for (long n = 0, failed_before = -1; n < 400 && failed != failed_before; ++n) {  // until neither fails
      failed_before = failed;
      for (const bool write : {false, true}) {
        std::memset(buffer, write ? 9 : 0, bytes);
        countdown = n;
        bool refused = false;
        try {
          auto u = write ? space.write(id, buffer) : space.read(id, buffer);
          countdown = -1;
          space.finish(u);
        } catch (const std::bad_alloc&) {
          refused = true;
        }
        countdown = -1;
        if (!refused) continue;
        ++failed;
        std::memset(buffer, 0x55, bytes);  // the caller's next use of its buffer
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        for (std::size_t i = 0; i < bytes; i += 512) {
          ASSERT_EQ(buffer[i], std::byte{0x55}) << "allocation " << n << ": a stripe landed after it failed, at " << i;
        }
      }
    }
    EXPECT_GT(failed, 8);
    std::free(buffer);
  }
}

std::byte pattern(std::uint64_t id, std::uint64_t i) {
  return static_cast<std::byte>((id * 131 + i * 7) & 0xff);
}

TEST(strong_guarantee, arena_allocate_with_defragmentation) {
  memory::host_resource host;
  for (const auto policy : {arena::defrag_policy::minimal_move, arena::defrag_policy::full_compaction}) {
    arena::contiguous_arena a(host, 1 << 16, {.alignment = 256, .policy = policy});
    std::map<std::uint64_t, std::uint64_t> live;  // id -> bytes
    auto fill = [&](const arena::tensor_block& b) {
      for (std::uint64_t i = 0; i < b.bytes; ++i) b.data()[i] = pattern(b.id, i);
    };
    // Checkerboard: every other tensor released leaves holes too small for a large request.
    std::vector<arena::tensor_block> blocks;
    for (int i = 0; i < 64; ++i) blocks.push_back(a.allocate(1000));
    for (auto& b : blocks) fill(b);
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (i % 2 == 0) a.release(blocks[i]);
      else live[blocks[i].id] = blocks[i].bytes;
    }
    std::map<std::uint64_t, std::uint64_t> offsets_before;
    for (const auto& [id, bytes] : live) offsets_before[id] = a.block(id).offset;
    const arena::arena_stats before = a.stats();
    int notified = 0;
    for (const auto& [id, bytes] : live) a.bind(id, [&notified](const arena::tensor_block&) { ++notified; });
    arena::tensor_block big;
    const int injected = inject_until_success([&] { big = a.allocate(8000); }, [&] {
      ASSERT_EQ(notified, 0);
      ASSERT_EQ(a.stats().defragmentations, before.defragmentations);
      ASSERT_EQ(a.stats().used_bytes, before.used_bytes);
      ASSERT_EQ(a.stats().largest_free_bytes, before.largest_free_bytes);
      for (const auto& [id, bytes] : live) {
        const arena::tensor_block b = a.block(id);
        ASSERT_EQ(b.offset, offsets_before[id]) << "moved although allocate threw";
        for (std::uint64_t i = 0; i < bytes; ++i) ASSERT_EQ(b.data()[i], pattern(id, i));
      }
    });
    EXPECT_GT(injected, 0);
    EXPECT_EQ(a.stats().defragmentations, before.defragmentations + 1);
    EXPECT_GT(notified, 0);
    for (const auto& [id, bytes] : live) {
      const arena::tensor_block b = a.block(id);
      for (std::uint64_t i = 0; i < bytes; ++i) ASSERT_EQ(b.data()[i], pattern(id, i));
    }
  }
}

// The planner's instances for the tests below: `n` buffers over `horizon` steps, lifetimes up
// to 4,000 steps, sizes 64 x [1, kinds]. 3,000 over 10^5 steps: more than 4,096 sections, the
// rounds on two lanes; 20,000 over 7 x 10^5: the split greedy pays (first passes split across
// two threads, the guided rounds beside the classic variants).
std::vector<core::buffer> planner_instance(unsigned seed, std::size_t n, std::uint64_t horizon, std::uint64_t kinds) {
  std::mt19937_64 rng(seed);
  std::vector<core::buffer> b;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t lower = rng() % horizon;
    const std::uint64_t length = 1 + rng() % 4000;
    b.push_back({"b" + std::to_string(i), lower, lower + length, 64 * (1 + rng() % kinds), {}});
  }
  return b;
}

// Every allocation on the planner's own threads fails: plan() throws std::bad_alloc on the
// caller's thread once every thread has ended (no std::terminate, and no side of a split pass
// left waiting at its barrier for the other).
TEST(planner_faults, allocations_failing_on_the_planners_threads_come_out_of_plan) {
  for (const auto& b : {planner_instance(5, 3000, 100'000, 8), planner_instance(8, 20'000, 700'000, 4)}) {
    core::plan_options o;
    o.threads = 2;
    o.time_limit_seconds = 5;
    armed_thread = std::this_thread::get_id();
    fail_on_other_threads = true;
    EXPECT_THROW(core::plan(b, o), std::bad_alloc) << b.size() << " buffers";
    fail_on_other_threads = false;
    const core::plan_result r = core::plan(b, o);  // and nothing is left behind
    EXPECT_EQ(core::validate(b, r.offsets, r.arena_bytes, 1), "");
  }
}

// The caller's n-th allocation fails while the planner's other thread works (n over a
// range that reaches every phase): std::bad_alloc or a valid plan, every time.
TEST(planner_faults, an_allocation_failing_on_the_callers_thread_comes_out_of_plan) {
  for (const auto& b : {planner_instance(5, 3000, 100'000, 8), planner_instance(8, 20'000, 700'000, 4)}) {
    int failed = 0;
    for (long n = 1; n < 20'000'000; n = n * 3 / 2 + 1) {
      core::plan_options o;
      o.threads = 2;
      o.time_limit_seconds = 5;
      const disarm_on_exit disarm;
      countdown = n;
      try {
        const core::plan_result r = core::plan(b, o);
        countdown = -1;
        EXPECT_EQ(core::validate(b, r.offsets, r.arena_bytes, 1), "") << n;
        break;  // the caller's allocations are fewer than n
      } catch (const std::bad_alloc&) {
        countdown = -1;
        ++failed;
      }
    }
    EXPECT_GE(failed, 8) << b.size() << " buffers";  // (the caller allocates 100-150 times in all)
  }
}


// With a fixed capacity, a reserve of any count makes room for the most blocks the arena can
// ever hold (one per alignment unit, the last one shorter) and no more: no length_error, no
// memory past that, and a stream that tiles the whole arena with the smallest blocks still
// asks for no memory.
template <class Allocator>
void a_fixed_arena_reserves_what_it_can_hold() {
  const disarm_on_exit disarm;
  constexpr std::uint64_t units = 64;
  Allocator a(units * 256 + 100, 256);
  EXPECT_EQ(a.blocks_to_reserve(std::size_t{1} << 40), units + 1);
  EXPECT_EQ(a.blocks_to_reserve(7), 7U);
  EXPECT_EQ(Allocator(core::growing, 256).blocks_to_reserve(std::size_t{1} << 40), std::size_t{1} << 40);
  EXPECT_EQ(Allocator(100, 256).blocks_to_reserve(1000), 1U);
  a.reserve(std::size_t{1} << 40);
  std::vector<core::allocation> row;
  row.reserve(units);
  countdown = 0;
  for (std::uint64_t i = 0; i < units; ++i) {
    ASSERT_NO_THROW(row.push_back(*a.allocate(256))) << "block " << i;
    countdown = 0;
  }
  std::optional<core::allocation> none;
  ASSERT_NO_THROW(none = a.allocate(1));
  EXPECT_FALSE(none);  // full
  countdown = 0;
  for (std::size_t round = 0; round < 3; ++round) {
    for (std::size_t i = round % 2; i < row.size(); i += 2) {
      ASSERT_NO_THROW(a.deallocate(row[i]));
      countdown = 0;
    }
    for (std::size_t i = round % 2; i < row.size(); i += 2) {
      ASSERT_NO_THROW(row[i] = *a.allocate(256)) << "round " << round << " block " << i;
      countdown = 0;
    }
  }
  countdown = -1;
  EXPECT_EQ(a.check_invariants(), "");
  EXPECT_EQ(a.stats().live_allocations, units);
}

TEST(reserve, tlsf_with_a_fixed_capacity_reserves_what_the_arena_can_hold) {
  a_fixed_arena_reserves_what_it_can_hold<core::tlsf_allocator>();
}
TEST(reserve, best_fit_with_a_fixed_capacity_reserves_what_the_arena_can_hold) {
  a_fixed_arena_reserves_what_it_can_hold<core::best_fit_allocator>();
}

}  // namespace
}  // namespace tensormem
