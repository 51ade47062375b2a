// `tensormem plan TRACE`: offline plan of a trace, validated before it is printed.

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <iostream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "huge_pages.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "stop_on_signals.hpp"
#include "tensormem/core/planner.hpp"
#include "tensormem/trace/plan_svg.hpp"
#include "tensormem/trace/trace_io.hpp"

namespace tensormem::cli {

namespace {

struct plan_cli_options {
  std::string trace;
  std::size_t synthetic = 0;
  std::uint64_t synthetic_seed = 1;
  double time_limit = 10.0;
  std::uint64_t alignment = 1;
  std::uint64_t seed = 1;
  std::string out;
  std::string svg;
  std::string html;
  bool json = false;
};

// Peak resident memory of this process, bytes.
std::uint64_t peak_rss_bytes() {
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<std::uint64_t>(u.ru_maxrss) * 1024;
}

// After the plan is out: the exit status of a plan stopped by `signal` (0: none came).
void stop_if_signalled(int signal, const core::plan_result& r) {
  if (signal == 0) return;
  throw command_failed(128 + signal, fmt::format("plan: stopped by {} after {:.3f} s; the plan above is the best "
                                                 "found by then (validated)",
                                                 signal == SIGINT ? "SIGINT" : "SIGTERM", r.seconds));
}

void run_plan(plan_cli_options o) {
  // --time-limit is the budget of reading, planning and validating together: the planner
  // gets what reading the trace left of it and keeps room for the validation (its first plan
  // always completes).
  const auto started = std::chrono::steady_clock::now();
  if (o.trace.empty() == (o.synthetic == 0)) {
    throw std::invalid_argument(o.trace.empty() ? "plan: give a trace file or --synthetic N"
                                                : "plan: give a trace file or --synthetic N, not both");
  }
  check_output_path("--out", o.out);
  check_output_path("--svg", o.svg);
  check_output_path("--html", o.html);
  std::vector<core::buffer> buffers;
  if (o.synthetic > core::max_plan_buffers) {
    throw std::invalid_argument("plan: --synthetic " + std::to_string(o.synthetic) + ": at most " +
                                std::to_string(core::max_plan_buffers) + " buffers are planned");
  }
  if (o.synthetic != 0) {
    refuse_past_memory("plan", "--synthetic " + std::to_string(o.synthetic), o.synthetic, "buffers",
                       core::plan_bytes_per_buffer);
    buffers = core::synthetic_lifetimes(o.synthetic, o.synthetic_seed);
    o.trace = "synthetic:" + std::to_string(o.synthetic) + ":" + std::to_string(o.synthetic_seed);
  } else {
    refuse_trace_past_memory("plan", o.trace, core::plan_bytes_per_buffer);
    buffers = trace::read_trace(o.trace);
    refuse_past_memory("plan", o.trace, buffers.size(), "buffers", core::plan_bytes_per_buffer);
  }
  const double read_seconds = seconds_since(started);
  core::plan_options options;
  options.time_limit_seconds = std::max(0.0, o.time_limit - read_seconds);
  options.reserve_first_plan_costs = 1;  // the validation below: a sort and a sweep of the events
  options.alignment = o.alignment;
  options.seed = o.seed;
  progress_line progress;
  if (progress.enabled()) options.progress = plan_progress_printer(progress, buffers.size());
  core::plan_result r;
  {
    const stop_on_signals signals;
    options.stop = stop_on_signals::flag();
    r = core::plan(buffers, options);
  }
  progress.clear();
  // A signal that came after the planner's last look at the flag stops nothing, but the
  // caller asked for an end all the same.
  const int stopped_by = stop_on_signals::signal();
  const auto validation = std::chrono::steady_clock::now();
  const std::string problem = core::validate(buffers, r.offsets, r.arena_bytes, o.alignment);
  const double validate_seconds = seconds_since(validation);
  if (!problem.empty()) throw std::logic_error("the planner produced an invalid plan: " + problem);
  for (std::size_t i = 0; i < buffers.size(); ++i) buffers[i].offset = r.offsets[i];
  if (!o.out.empty()) trace::write_trace(o.out, buffers);
  // The pictures take the validation above (a valid plan) instead of making their own.
  if (!o.svg.empty()) trace::write_plan_svg(o.svg, buffers, r.offsets, r.arena_bytes, r.lower_bound, problem);
  if (!o.html.empty()) {
    trace::write_plan_html(o.html, buffers, r.offsets, r.arena_bytes, r.lower_bound,
                           std::filesystem::path(o.trace).filename().string(), problem);
  }
  if (o.json) {
    nlohmann::json j;
    j["trace"] = o.trace;
    j["buffers"] = buffers.size();
    j["alignment"] = o.alignment;
    j["lower_bound"] = r.lower_bound;
    j["arena_bytes"] = r.arena_bytes;
    j["ratio"] = r.ratio();
    j["seconds"] = r.seconds;
    j["read_seconds"] = read_seconds;
    j["validate_seconds"] = validate_seconds;
    j["greedy_seconds"] = r.greedy_seconds;
    j["first_plan_seconds"] = r.first_plan_seconds;
    j["best_plan_seconds"] = r.best_plan_seconds;
    j["peak_rss_bytes"] = peak_rss_bytes();
    j["strategy"] = r.strategy;
    j["optimal"] = r.optimal;
    j["heap_huge_pages"] = huge_pages_status();
    j["stopped"] = stopped_by != 0;
    j["fallback"] = r.fallback;
    std::cout << json_text(j) << '\n';
    stop_if_signalled(stopped_by, r);
    return;
  }
  std::cout << fmt::format("trace        {}\n", o.trace)
            << fmt::format("buffers      {}\n", buffers.size())
            << fmt::format("lower bound  {} bytes ({}), sizes rounded up to {} B\n", r.lower_bound,
                           human_bytes(r.lower_bound), o.alignment)
            << fmt::format("arena        {} bytes ({})\n", r.arena_bytes, human_bytes(r.arena_bytes))
            << fmt::format("ratio        {:.4f}\n", r.ratio())
            << fmt::format("optimal      {}\n", r.optimal ? "yes, proven (no plan has a smaller arena)" : "not proven")
            << fmt::format("strategy     {}\n", r.strategy)
            << fmt::format("seconds      {:.3f} (greedy phase {:.3f}, first plan at {:.3f}, best at {:.3f})\n",
                           r.seconds, r.greedy_seconds, r.first_plan_seconds, r.best_plan_seconds)
            << fmt::format("read         {:.3f} s before planning; validated in {:.3f} s after\n", read_seconds,
                           validate_seconds)
            << fmt::format("peak RSS     {} (heap on huge pages: {})\n", human_bytes(peak_rss_bytes()),
                           huge_pages_status())
            << "validated    yes\n";
  if (!r.fallback.empty()) std::cout << fmt::format("fallback     {}\n", r.fallback);
  stop_if_signalled(stopped_by, r);
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto opts = std::make_shared<plan_cli_options>();
  CLI::App* cmd = app.add_subcommand("plan", "Plan a trace offline in one arena");
  cmd->footer("Ctrl-C (SIGINT) or SIGTERM while planning stops the search: the best plan found by then is "
              "validated, written and printed, and the exit status is 128 + the signal (130, 143); a second "
              "signal ends the process at once.");
  cmd->add_option("trace", opts->trace, "trace CSV file (id,lower,upper,size)")->check(path_given());
  cmd->add_option("--synthetic", opts->synthetic,
                  "plan N buffers of the synthetic family instead of a trace (starts uniform over N steps, "
                  "lifetimes 2^U(0,12), sizes 2^U(10,24))")
      ->check(positive_count());
  cmd->add_option("--synthetic-seed", opts->synthetic_seed, "seed of the synthetic family (default 1)")
      ->check(whole_number("SEED>=0"));
  cmd->add_option("--time-limit", opts->time_limit, "seconds for reading, planning and validating (default 10; the first plan always completes)")
      ->check(non_negative_seconds());
  cmd->add_option("--alignment", opts->alignment, "size and offset alignment (default 1)")
      ->check(power_of_two_count());
  cmd->add_option("--seed", opts->seed, "seed of the randomized search")->check(whole_number("SEED>=0"));
  cmd->add_option("--out", opts->out, "write the trace with an offset column")->check(path_given());
  cmd->add_option("--svg", opts->svg, "draw the plan as SVG")->check(path_given());
  cmd->add_option("--html", opts->html, "write the plan as one interactive HTML page (zoom, hover)")
      ->check(path_given());
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->callback([opts] { run_plan(*opts); });
}

}  // namespace tensormem::cli
