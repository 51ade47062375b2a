// Online allocators side by side: exact best fit, the O(1) TLSF allocator and a first-fit
// std::map baseline, on (a) a random mix and (b) replays of the public traces.
//
//   build/bin/allocator_bench [--benchmark_filter=...]
//
// Counters: ns_per_op (time inside the allocator per allocate or free) and
// high_water_over_lb (arena size / lower bound).

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <string>
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

/// The random mix: 55 % allocations and 45 % frees of a random live block while fewer than
/// 4096 blocks are live, only frees at 4096; sizes log-uniform in [256 B, 16 MiB].
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
    std::mt19937_64 rng(42);
    std::uniform_real_distribution<double> log_bytes(8.0, 24.0);
    std::vector<std::uint64_t> live;
    std::uint64_t live_bytes = 0;
    for (std::size_t i = 0; i < operations; ++i) {
      const bool alloc = live.empty() || (live.size() < max_live && rng() % 100 < 55);
      if (alloc) {
        const auto bytes = static_cast<std::uint64_t>(std::exp2(log_bytes(rng)));
        m.ops.push_back({bytes, 0});
        live.push_back(*core::align_up(bytes, 256));
        live_bytes += live.back();
        m.lower_bound = std::max(m.lower_bound, live_bytes);
      } else {
        const auto victim = static_cast<std::uint32_t>(rng() % live.size());
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

template <class Allocator>
void bm_random_mix(benchmark::State& state) {
  const mix_workload& w = random_mix();
  for (auto _ : state) {
    Allocator a(core::growing, 256);
    std::vector<core::allocation> live;
    live.reserve(4096);
    const auto start = std::chrono::steady_clock::now();
    for (const mix_op& op : w.ops) {
      if (op.bytes != 0) {
        live.push_back(*a.allocate(op.bytes));
      } else {
        a.deallocate(live[op.victim]);
        live[op.victim] = live.back();
        live.pop_back();
      }
    }
    const auto stop = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(stop - start).count());
    state.counters["ns_per_op"] =
        std::chrono::duration<double, std::nano>(stop - start).count() /
        static_cast<double>(w.ops.size());
    state.counters["high_water_over_lb"] =
        static_cast<double>(a.peak()) / static_cast<double>(w.lower_bound);
  }
}


template <class Allocator>
void bm_trace(benchmark::State& state, const std::string& name) {
  const auto buffers = trace::read_trace(tensormem::bench::trace_file(name));
  const std::uint64_t lb = core::lower_bound(buffers);
  for (auto _ : state) {
    Allocator a(core::growing, 1);
    const core::replay_result r = core::replay(buffers, a);
    state.SetIterationTime(r.seconds);
    state.counters["ns_per_op"] = r.seconds * 1e9 / static_cast<double>(r.operations);
    state.counters["high_water_over_lb"] =
        static_cast<double>(r.high_water) / static_cast<double>(lb);
  }
}

void register_all() {
  benchmark::RegisterBenchmark("random_mix/best_fit", bm_random_mix<core::best_fit_allocator>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("random_mix/tlsf", bm_random_mix<core::tlsf_allocator>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("random_mix/first_fit_map", bm_random_mix<first_fit_map>)
      ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  for (const char* file : {"somas_resnet50.csv", "iopddl_G_1.csv", "iopddl_S_1.csv"}) {
    const std::string name = file;
    const std::string stem = name.substr(0, name.find('.'));
    benchmark::RegisterBenchmark(("trace/" + stem + "/best_fit").c_str(),
                                 bm_trace<core::best_fit_allocator>, name)
        ->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("trace/" + stem + "/tlsf").c_str(),
                                 bm_trace<core::tlsf_allocator>, name)
        ->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("trace/" + stem + "/first_fit_map").c_str(),
                                 bm_trace<first_fit_map>, name)
        ->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return tensormem::bench::run_benchmarks(argc, argv, register_all);
}
