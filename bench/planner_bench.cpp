// The static planner on the public traces: the greedy phase alone, and the full planner with
// the CLI's time limits (30 s for MiniMalloc's tight instances, 10 s for the real traces).
//
//   build/bin/planner_bench [--benchmark_filter=greedy]
//   build/bin/planner_bench --benchmark_filter=scale     # synthetic family, 10^5 and 10^6 buffers
//
// Counters: seconds (wall time of one plan), first_plan / best_plan (when the first complete
// plan and the returned one were found), ratio (arena / lower bound).

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <string>
#include <vector>

#include "tensormem/core/planner.hpp"
#include "tensormem/trace/trace_io.hpp"

namespace core = tensormem::core;
namespace trace = tensormem::trace;

namespace {


void bm_buffers(benchmark::State& state, const std::vector<core::buffer>& buffers, double time_limit,
                bool search) {
  core::plan_options o;
  o.time_limit_seconds = time_limit;
  o.search = search;
  for (auto _ : state) {
    const core::plan_result r = core::plan(buffers, o);
    if (!core::validate(buffers, r.offsets, r.arena_bytes).empty()) {
      state.SkipWithError("invalid plan");
      return;
    }
    state.SetIterationTime(r.seconds);
    state.counters["seconds"] = r.seconds;
    state.counters["greedy_seconds"] = r.greedy_seconds;
    state.counters["first_plan"] = r.first_plan_seconds;
    state.counters["best_plan"] = r.best_plan_seconds;
    state.counters["ratio"] = r.ratio();
    state.SetLabel(r.strategy);
  }
}

void bm_plan(benchmark::State& state, const std::string& name, double time_limit, bool search) {
  bm_buffers(state, trace::read_trace(tensormem::bench::trace_file(name)), time_limit, search);
}

// The synthetic family of core::synthetic_lifetimes (seed 1).
void bm_scale(benchmark::State& state, std::size_t n, double time_limit) {
  bm_buffers(state, core::synthetic_lifetimes(n, 1), time_limit, true);
}

void register_all() {
  struct entry {
    const char* file;
    double time_limit;
  };
  const entry traces[] = {
      {"minimalloc_A.csv", 30}, {"minimalloc_B.csv", 30}, {"minimalloc_C.csv", 30},
      {"minimalloc_D.csv", 30}, {"minimalloc_E.csv", 30}, {"minimalloc_F.csv", 30},
      {"somas_resnet50.csv", 10}, {"iopddl_G_1.csv", 10},  {"iopddl_S_1.csv", 10},
  };
  for (const entry& t : traces) {
    const std::string name = t.file;
    const std::string stem = name.substr(0, name.find('.'));
    benchmark::RegisterBenchmark(("greedy/" + stem).c_str(), bm_plan, name, 0.0, false)
        ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
  }
  for (const entry& t : traces) {
    const std::string name = t.file;
    const std::string stem = name.substr(0, name.find('.'));
    benchmark::RegisterBenchmark(("plan/" + stem).c_str(), bm_plan, name, t.time_limit, true)
        ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  }
  for (const std::size_t n : {std::size_t{100'000}, std::size_t{1'000'000}}) {
    for (const double t : {1.0, 10.0}) {
      benchmark::RegisterBenchmark(("scale/" + std::to_string(n) + "/T=" + std::to_string(static_cast<int>(t))).c_str(),
                                   bm_scale, n, t)
          ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return tensormem::bench::run_benchmarks(argc, argv, register_all);
}
