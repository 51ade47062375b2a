// Online allocators side by side: exact best fit, the O(1) TLSF allocator, the OffsetAllocator
// algorithm (offset_allocator_baseline.hpp) and a first-fit
// std::map baseline, on (a) a random mix and (b) replays of the public traces.
//
//   build/bin/allocator_bench [--benchmark_filter=...]
//
// Counters: ns_per_op (time inside the allocator per allocate or free) and
// high_water_over_lb (arena size / lower bound).

#include <benchmark/benchmark.h>

#include "bench_support.hpp"
#include "lazy_allocator_baseline.hpp"
#include "offset_allocator_baseline.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tensormem/core/align.hpp"
#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/replay.hpp"
#include "tensormem/core/tlsf_allocator.hpp"
#include "tensormem/trace/trace_io.hpp"

namespace core = tensormem::core;
namespace trace = tensormem::trace;

namespace {

/// Plain first fit over a std::map of free blocks (lowest offset that fits), growing at the
/// end like the others. The baseline a simple engine would write.
class first_fit_map {
 public:
  first_fit_map(std::uint64_t /*capacity*/, std::uint64_t alignment) : alignment_(alignment) {}

  std::optional<core::allocation> allocate(std::uint64_t bytes) {
    const std::uint64_t need = *core::align_up(bytes, alignment_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < need) continue;
      const std::uint64_t offset = it->first;
      const std::uint64_t rest = it->second - need;
      free_.erase(it);
      if (rest != 0) free_.emplace(offset + need, rest);
      return core::allocation{offset, need, 0, 0};
    }
    std::uint64_t offset = peak_;
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == peak_) {
        offset = last->first;
        free_.erase(last);
      }
    }
    peak_ = offset + need;
    return core::allocation{offset, need, 0, 0};
  }

  void deallocate(const core::allocation& a) {
    auto [it, inserted] = free_.emplace(a.offset, a.bytes);
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }

  std::uint64_t peak() const { return peak_; }

 private:
  std::uint64_t alignment_;
  std::uint64_t peak_ = 0;
  std::map<std::uint64_t, std::uint64_t> free_;
};

/// W1, the random mix: each event allocates with probability 0.55 (always when nothing is
/// live, never when 4,096 blocks are), else frees a uniformly random live block (the last
/// live block takes its place); sizes ceil(2^U(8, 24)) rounded up to 256 bytes; mt19937_64
/// seeded with 20240607, drawing the coin, then the size or the victim; 10 M events.
struct mix_op {
  std::uint64_t bytes;   // 0 for a free
  std::uint32_t victim;  // index into the live list for a free
};

struct mix_workload {
  std::vector<mix_op> ops;
  std::uint64_t lower_bound = 0;  // most bytes live at once (256-aligned)
};

const mix_workload& random_mix() {
  static const mix_workload w = [] {
    constexpr std::size_t operations = 10'000'000;
    constexpr std::size_t max_live = 4096;
    mix_workload m;
    m.ops.reserve(operations);
    std::mt19937_64 rng(20240607);
    std::uniform_real_distribution<double> coin(0.0, 1.0);
    std::uniform_real_distribution<double> log_bytes(8.0, 24.0);
    std::vector<std::uint64_t> live;
    std::uint64_t live_bytes = 0;
    for (std::size_t i = 0; i < operations; ++i) {
      const bool heads = coin(rng) < 0.55;
      const bool alloc = live.empty() || (live.size() < max_live && heads);
      if (alloc) {
        const auto bytes = *core::align_up(static_cast<std::uint64_t>(std::ceil(std::exp2(log_bytes(rng)))), 256);
        m.ops.push_back({bytes, 0});
        live.push_back(bytes);
        live_bytes += bytes;
        m.lower_bound = std::max(m.lower_bound, live_bytes);
      } else {
        const auto victim = static_cast<std::uint32_t>(
            std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng));
        m.ops.push_back({0, victim});
        live_bytes -= live[victim];
        live[victim] = live.back();
        live.pop_back();
      }
    }
    return m;
  }();
  return w;
}

struct run_result {
  double ns_per_op = 0;
  std::uint64_t high_water = 0;
};

// Each allocator keeps its own handles: `core::allocation` (32 bytes) for tensormem's and the
// LazyAllocator baseline, OffsetAllocator's 8 bytes for its baseline.
template <class Allocator>
using handle_of = std::remove_cvref_t<decltype(*std::declval<Allocator&>().allocate(0))>;

// The high-water mark of an allocator that keeps one; 0 for the timed OffsetAllocator
// baseline, which keeps none (as OffsetAllocator): its mark comes from an untimed run of
// `with_peak<A>`, the same allocator keeping one.
template <class Allocator>
std::uint64_t peak_of(const Allocator& a) {
  if constexpr (requires { a.peak(); }) return a.peak();
  else return 0;
}
template <class Allocator>
struct with_peak_of {
  using type = Allocator;
};
template <>
struct with_peak_of<tensormem::bench::offset_allocator_baseline> {
  using type = tensormem::bench::offset_allocator_baseline_with_peak;
};
template <class Allocator>
using with_peak = typename with_peak_of<Allocator>::type;

// A growing allocator for a stream with at most `max_live` blocks live at once, sized as a
// user who knows that bound would size it. The OffsetAllocator baseline gets a node pool of
// 2 * max_live + 2 nodes (each live block, a free block beside each, and the free rest of
// the arena: OffsetAllocator's maxAllocs); a pool of its default 128 Ki nodes, zeroed before
// every replay, pushed the small traces' nodes out of cache and slowed the baseline by up to
// 25 %. An allocator with `reserve(blocks)` (tlsf_allocator) is given the same bound.
template <class Allocator>
Allocator make_for(std::uint64_t alignment, std::size_t max_live) {
  if constexpr (std::is_constructible_v<Allocator, std::uint64_t, std::uint64_t, std::uint32_t>) {
    return Allocator(core::growing, alignment, static_cast<std::uint32_t>(2 * max_live + 2));
  } else {
    Allocator a(core::growing, alignment);
    if constexpr (requires { a.reserve(std::size_t{0}); }) a.reserve(2 * max_live + 1);
    return a;
  }
}

// One W1 event: an allocation kept in `live`, or the free of live[victim], whose place the
// last live handle takes.
template <class Allocator>
[[gnu::always_inline]] inline void apply(Allocator& a, std::vector<handle_of<Allocator>>& live, const mix_op& op) {
  if (op.bytes != 0) {
    live.push_back(*a.allocate(op.bytes));
  } else {
    a.deallocate(live[op.victim]);
    live[op.victim] = live.back();
    live.pop_back();
  }
}

template <class Allocator>
run_result run_mix(const mix_workload& w) {
  Allocator a = make_for<Allocator>(256, 4096);
  std::vector<handle_of<Allocator>> live;
  live.reserve(4096);
  const auto start = std::chrono::steady_clock::now();
  for (const mix_op& op : w.ops) apply(a, live, op);
  const auto stop = std::chrono::steady_clock::now();
  return {std::chrono::duration<double, std::nano>(stop - start).count() / static_cast<double>(w.ops.size()),
          peak_of(a)};
}

// One sample of a trace: replays in `core::replay`'s order (frees before allocations at
// equal times, ties in file order), each by a new allocator and handle list (made outside
// the timed loop), until they add up to 2 ms of allocator calls, so that a trace of a few
// hundred operations (a few microseconds) is not one timer reading.
template <class Allocator>
run_result run_trace(const std::vector<core::buffer>& buffers, const std::vector<core::replay_event>& order) {
  double seconds = 0;
  std::size_t operations = 0;
  std::uint64_t high_water = 0;
  do {
    Allocator a = make_for<Allocator>(1, buffers.size());
    std::vector<handle_of<Allocator>> handles(buffers.size());
    const auto start = std::chrono::steady_clock::now();
    for (const core::replay_event& e : order) {
      if (!e.allocate) {
        a.deallocate(handles[e.index]);
      } else if (const auto h = a.allocate(buffers[e.index].bytes)) [[likely]] {
        handles[e.index] = *h;
      } else {
        throw std::runtime_error("allocator_bench: buffer '" + buffers[e.index].id + "' does not fit");
      }
    }
    const auto stop = std::chrono::steady_clock::now();
    seconds += std::chrono::duration<double>(stop - start).count();
    operations += order.size();
    high_water = peak_of(a);
  } while (seconds < 2e-3);
  return {seconds * 1e9 / static_cast<double>(operations), high_water};
}

// The high-water mark of a timed run of Allocator: the run's own, or, for an allocator that
// keeps none, that of a run of with_peak<Allocator> (same placements; only its mark is used).
template <class Allocator, class Run>
std::uint64_t high_water_of(const run_result& timed, Run run) {
  if constexpr (std::is_same_v<with_peak<Allocator>, Allocator>) return timed.high_water;
  else return run.template operator()<with_peak<Allocator>>().high_water;
}

template <class Allocator>
void bm_random_mix(benchmark::State& state) {
  const mix_workload& w = random_mix();
  for (auto _ : state) {
    const run_result r = run_mix<Allocator>(w);
    state.SetIterationTime(r.ns_per_op * static_cast<double>(w.ops.size()) * 1e-9);
    state.counters["ns_per_op"] = r.ns_per_op;
    const std::uint64_t high_water = high_water_of<Allocator>(r, [&w]<class A>() { return run_mix<A>(w); });
    state.counters["high_water_over_lb"] = static_cast<double>(high_water) / static_cast<double>(w.lower_bound);
  }
}

template <class Allocator>
void bm_trace(benchmark::State& state, const std::string& name) {
  const auto buffers = trace::read_trace(tensormem::bench::trace_file(name));
  const std::vector<core::replay_event> order = core::replay_order(buffers);
  const std::uint64_t lb = core::lower_bound(buffers);
  for (auto _ : state) {
    const run_result r = run_trace<Allocator>(buffers, order);
    state.SetIterationTime(r.ns_per_op * 1e-9 * static_cast<double>(2 * buffers.size()));
    state.counters["ns_per_op"] = r.ns_per_op;
    state.counters["high_water_over_lb"] = static_cast<double>(r.high_water) / static_cast<double>(lb);
  }
}

// An allocator beside a baseline (the OffsetAllocator or the LazyAllocator algorithm) on the
// same stream in one process, runs interleaved (baseline, allocator, baseline...), medians:
// the ratio of their ns per op (above 1: slower than the baseline) and both high-water marks
// over the lower bound.
template <class Allocator, class Baseline, class Run>
void bm_versus_baseline(benchmark::State& state, Run run, std::uint64_t lower_bound) {
  for (auto _ : state) {
    std::vector<double> mine;
    std::vector<double> base;
    run_result last_mine;
    run_result last_base;
    for (int round = 0; round < 5; ++round) {
      last_base = run.template operator()<Baseline>();
      last_mine = run.template operator()<Allocator>();
      base.push_back(last_base.ns_per_op);
      mine.push_back(last_mine.ns_per_op);
    }
    last_base.high_water = high_water_of<Baseline>(last_base, run);
    std::sort(mine.begin(), mine.end());
    std::sort(base.begin(), base.end());
    state.SetIterationTime(mine[2] * 1e-9);
    state.counters["ns_per_op"] = mine[2];
    state.counters["baseline_ns_per_op"] = base[2];
    state.counters["ratio_to_baseline"] = mine[2] / base[2];
    state.counters["high_water_over_lb"] = static_cast<double>(last_mine.high_water) / static_cast<double>(lower_bound);
    state.counters["baseline_high_water_over_lb"] =
        static_cast<double>(last_base.high_water) / static_cast<double>(lower_bound);
  }
}

// The slowest single calls: W1's first 200,000 events (the live set and the blocks grow to
// their full counts in the first 50,000 or so), each `allocate` or `deallocate` timed alone
// by a new allocator, with `reserve(2 * 4,096 + 1)` before the stream or without it; one
// pass, registered first, so that the heap is as new as in a program's first steps.
// steady_clock costs about 20 ns a reading, which every call's time includes. Counters: the
// slowest call, the 99.99th and 99.9th percentiles, and the calls slower than 10 us and
// than 200 us (a pool that doubles copies every node; a page touched for the first time
// costs a fault; an interrupt lands in some call whatever the allocator does).
template <class Allocator, bool Reserve>
void bm_call_latency(benchmark::State& state) {
  constexpr std::size_t events = 200'000;
  const mix_workload& w = random_mix();
  std::vector<double> all;
  all.reserve(events * static_cast<std::size_t>(state.max_iterations));
  double slow = 0;
  double slower = 0;
  for (auto _ : state) {
    Allocator a(core::growing, 256);
    if constexpr (Reserve) a.reserve(2 * 4096 + 1);
    std::vector<handle_of<Allocator>> live(4096);  // its pages touched before the clock starts
    live.clear();
    double total = 0;
    for (std::size_t i = 0; i < events; ++i) {
      const mix_op& op = w.ops[i];
      const auto start = std::chrono::steady_clock::now();
      apply(a, live, op);
      const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
      total += ns;
      all.push_back(ns);
      slow += ns > 10'000 ? 1 : 0;
      slower += ns > 200'000 ? 1 : 0;
    }
    state.SetIterationTime(total * 1e-9);
  }
  std::sort(all.begin(), all.end());
  const auto at = [&all](double q) { return all[static_cast<std::size_t>(q * static_cast<double>(all.size() - 1))]; };
  state.counters["max_ns"] = all.back();
  state.counters["p99_99_ns"] = at(0.9999);
  state.counters["p99_9_ns"] = at(0.999);
  state.counters["calls_over_10us"] = slow / static_cast<double>(state.iterations());
  state.counters["calls_over_200us"] = slower / static_cast<double>(state.iterations());
}

const std::vector<std::string>& trace_names() {
  static const std::vector<std::string> names = {
      "minimalloc_A.csv", "minimalloc_B.csv", "minimalloc_C.csv", "minimalloc_D.csv", "minimalloc_E.csv",
      "minimalloc_F.csv", "somas_resnet50.csv", "iopddl_G_1.csv", "iopddl_S_1.csv"};
  return names;
}

// `<group>/W1/<label>` and `<group>/<trace>/<label>`: Allocator against Baseline.
template <class Allocator, class Baseline>
void register_versus(const std::string& group, const std::string& label) {
  benchmark::RegisterBenchmark((group + "/W1/" + label).c_str(), [](benchmark::State& state) {
    bm_versus_baseline<Allocator, Baseline>(
        state, []<class A>() { return run_mix<A>(random_mix()); }, random_mix().lower_bound);
  })->UseManualTime()->Iterations(1)->Unit(benchmark::kNanosecond);
  for (const std::string& name : trace_names()) {
    const std::string stem = name.substr(0, name.find('.'));
    benchmark::RegisterBenchmark((group + "/" + stem + "/" + label).c_str(), [name](benchmark::State& state) {
      const auto buffers = trace::read_trace(tensormem::bench::trace_file(name));
      const std::vector<core::replay_event> order = core::replay_order(buffers);
      bm_versus_baseline<Allocator, Baseline>(
          state, [&buffers, &order]<class A>() { return run_trace<A>(buffers, order); }, core::lower_bound(buffers));
    })->UseManualTime()->Iterations(1)->Unit(benchmark::kNanosecond);
  }
}

void register_all() {
  // First, while the process's heap is new (as in a program's first steps).
  benchmark::RegisterBenchmark("call_latency/tlsf/reserve", bm_call_latency<core::tlsf_allocator, true>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("call_latency/tlsf/grow", bm_call_latency<core::tlsf_allocator, false>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("call_latency/best_fit/reserve", bm_call_latency<core::best_fit_allocator, true>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("call_latency/best_fit/grow", bm_call_latency<core::best_fit_allocator, false>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("random_mix/best_fit", bm_random_mix<core::best_fit_allocator>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("random_mix/tlsf", bm_random_mix<core::tlsf_allocator>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("random_mix/offset_allocator_baseline",
                               bm_random_mix<tensormem::bench::offset_allocator_baseline>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("random_mix/first_fit_map", bm_random_mix<first_fit_map>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  register_versus<core::tlsf_allocator, tensormem::bench::offset_allocator_baseline>("versus_baseline", "tlsf");
  register_versus<core::best_fit_allocator, tensormem::bench::lazy_allocator_baseline>("versus_lazy", "best_fit");
  for (const std::string& name : trace_names()) {
    const std::string stem = name.substr(0, name.find('.'));
    benchmark::RegisterBenchmark(("trace/" + stem + "/best_fit").c_str(), bm_trace<core::best_fit_allocator>, name)
        ->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("trace/" + stem + "/tlsf").c_str(), bm_trace<core::tlsf_allocator>, name)
        ->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("trace/" + stem + "/first_fit_map").c_str(), bm_trace<first_fit_map>, name)
        ->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return tensormem::bench::run_benchmarks(argc, argv, register_all);
}
