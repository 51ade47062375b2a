// The static planner on the public traces: the greedy phase alone, and the full planner with
// the CLI's time limits (30 s for MiniMalloc's tight instances, 10 s for the real traces).
//
//   build/bin/planner_bench [--benchmark_filter=greedy]
//   build/bin/planner_bench --benchmark_filter=scale     # synthetic family, 10^5 and 10^6 buffers
//   build/bin/planner_bench --benchmark_filter=placement # one greedy pass, one thread, 10^5 buffers
//   build/bin/planner_bench --benchmark_filter=read      # a 10^6-line trace read from memory
//   build/bin/planner_bench --benchmark_filter='validate|T=0/'  # validation; set-up and first plan
//   build/bin/planner_bench --benchmark_filter=one_thread  # MiniMalloc's instances on one thread
//
// Counters: seconds (wall time of one plan), first_plan / best_plan (when the first complete
// plan and the returned one were found), ratio (arena / lower bound).

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "planner_detail.hpp"
#include "tensormem/core/planner.hpp"
#include "tensormem/trace/trace_io.hpp"

namespace core = tensormem::core;
namespace trace = tensormem::trace;

namespace {


void bm_buffers(benchmark::State& state, const std::vector<core::buffer>& buffers, double time_limit,
                bool search, unsigned threads = 0) {
  core::plan_options o;
  o.time_limit_seconds = time_limit;
  o.search = search;
  o.threads = threads;
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

void bm_plan(benchmark::State& state, const std::string& name, double time_limit, bool search,
             unsigned threads) {
  bm_buffers(state, trace::read_trace(tensormem::bench::trace_file(name)), time_limit, search, threads);
}

// The synthetic family of core::synthetic_lifetimes (seed 1).
void bm_scale(benchmark::State& state, std::size_t n, double time_limit) {
  bm_buffers(state, core::synthetic_lifetimes(n, 1), time_limit, true);
}

// One greedy pass over the synthetic family (seed 1) in decreasing size, on one thread: the
// cost of the occupancy index's queries and insertions (placement/first_fit, placement/best_fit).
void bm_placement(benchmark::State& state, std::size_t n, core::detail::fit policy) {
  const std::vector<core::buffer> buffers = core::synthetic_lifetimes(n, 1);
  const core::detail::plan_problem p = core::detail::make_problem(buffers, 1);
  std::vector<std::uint32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0U);
  std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) { return p.bytes[a] > p.bytes[b]; });
  core::detail::occupancy_index index(p.sections, p.longest);
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    const core::detail::candidate_plan c = core::detail::place_in_order(p, order, policy, index);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!core::validate(buffers, c.offsets, c.arena).empty()) {
      state.SkipWithError("invalid plan");
      return;
    }
    state.SetIterationTime(seconds);
    state.counters["seconds"] = seconds;
    state.counters["ratio"] = static_cast<double>(c.arena) / static_cast<double>(p.lower_bound);
  }
}

// The synthetic family (seed 1) written as a trace and read back from memory: what
// `tensormem plan TRACE` spends before planning (counters: seconds, MB_per_s).
void bm_read(benchmark::State& state, std::size_t n) {
  std::ostringstream out;
  trace::write_trace(out, core::synthetic_lifetimes(n, 1));
  const std::string text = out.str();
  for (auto _ : state) {
    std::istringstream in(text);
    const auto start = std::chrono::steady_clock::now();
    const std::vector<core::buffer> buffers = trace::read_trace(in, "synthetic.csv");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (buffers.size() != n) {
      state.SkipWithError("wrong buffer count");
      return;
    }
    state.SetIterationTime(seconds);
    state.counters["seconds"] = seconds;
    state.counters["MB_per_s"] = static_cast<double>(text.size()) / seconds / 1e6;
  }
}

// The validation of a plan of the synthetic family (seed 1; the first plan, from a plan with
// no time left): what `tensormem plan` spends after planning (counter: seconds).
void bm_validate(benchmark::State& state, std::size_t n) {
  const std::vector<core::buffer> buffers = core::synthetic_lifetimes(n, 1);
  core::plan_options o;
  o.time_limit_seconds = 0;
  const core::plan_result r = core::plan(buffers, o);
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    const std::string problem = core::validate(buffers, r.offsets, r.arena_bytes);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!problem.empty()) {
      state.SkipWithError("invalid plan");
      return;
    }
    state.SetIterationTime(seconds);
    state.counters["seconds"] = seconds;
  }
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
    benchmark::RegisterBenchmark(("greedy/" + stem).c_str(), bm_plan, name, 0.0, false, 0U)
        ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
  }
  for (const entry& t : traces) {
    const std::string name = t.file;
    const std::string stem = name.substr(0, name.find('.'));
    benchmark::RegisterBenchmark(("plan/" + stem).c_str(), bm_plan, name, t.time_limit, true, 0U)
        ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  }
  // MiniMalloc's instances whose lower bound the planner reaches, on one thread and with the
  // CLI's default limit of 10 s: the canonical search's steps are then the same from run to
  // run, and best_plan is the time they take to reach the bound.
  for (const char* stem : {"minimalloc_A", "minimalloc_B", "minimalloc_C", "minimalloc_E", "minimalloc_F"}) {
    benchmark::RegisterBenchmark((std::string("one_thread/") + stem).c_str(), bm_plan, std::string(stem) + ".csv",
                                 10.0, true, 1U)
        ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  }
  for (const auto& [name, policy] : {std::pair{"first_fit", core::detail::fit::first}, std::pair{"best_fit", core::detail::fit::best}}) {
    benchmark::RegisterBenchmark((std::string("placement/") + name + "/100000").c_str(), bm_placement,
                                 std::size_t{100'000}, policy)
        ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("read/1000000", bm_read, std::size_t{1'000'000})
      ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("validate/1000000", bm_validate, std::size_t{1'000'000})
      ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
  for (const std::size_t n : {std::size_t{100'000}, std::size_t{1'000'000}}) {
    for (const double t : {0.0, 1.0, 10.0}) {
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
