// `tensormem replay TRACE`: online replay of a trace through one allocator.

#include <iostream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "report.hpp"
#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/replay.hpp"
#include "tensormem/core/tlsf_allocator.hpp"
#include "tensormem/trace/trace_io.hpp"
#include "timed_replay.hpp"

namespace tensormem::cli {

namespace {

struct replay_options {
  std::string trace;
  std::string allocator = "best-fit";
  std::uint64_t alignment = 256;
  bool json = false;
};

// Replaying takes about 140 bytes of memory a buffer (peak RSS at 10^6 buffers: 141 MiB;
// docs/BENCHMARKS.md).
constexpr std::uint64_t replay_bytes_per_buffer = 140;

void run_replay(const replay_options& o) {
  refuse_trace_past_memory("replay", o.trace, replay_bytes_per_buffer);
  const auto buffers = trace::read_trace(o.trace);
  refuse_past_memory("replay", o.trace, buffers.size(), "buffers", replay_bytes_per_buffer);
  const timed_replay t = o.allocator == "best-fit"
                            ? replay_timed<core::best_fit_allocator>(buffers, o.alignment)
                            : replay_timed<core::tlsf_allocator>(buffers, o.alignment);
  const core::replay_result& r = t.first;
  const std::uint64_t lb = core::lower_bound(buffers, o.alignment);
  if (o.json) {
    nlohmann::json j;
    j["trace"] = o.trace;
    j["allocator"] = o.allocator;
    j["alignment"] = o.alignment;
    j["buffers"] = buffers.size();
    j["lower_bound"] = lb;
    j["high_water"] = r.high_water;
    j["ratio"] = ratio_of(r.high_water, lb);
    j["ns_per_op"] = t.ns_per_op;
    j["replays"] = t.replays;
    std::cout << json_text(j) << '\n';
    return;
  }
  std::cout << fmt::format("trace        {}\n", o.trace)
            << fmt::format("allocator    {} (alignment {})\n", o.allocator, o.alignment)
            << fmt::format("buffers      {}\n", buffers.size())
            << fmt::format("lower bound  {} bytes ({}), sizes rounded up to {} B\n", lb, human_bytes(lb), o.alignment)
            << fmt::format("high water   {} bytes ({})\n", r.high_water,
                           human_bytes(r.high_water))
            << fmt::format("ratio        {}\n", ratio_text(r.high_water, lb))
            << fmt::format("ns per op    {:.1f} (median of {} replays)\n", t.ns_per_op, t.replays);
}

}  // namespace

void add_replay_command(CLI::App& app) {
  auto opts = std::make_shared<replay_options>();
  CLI::App* cmd = app.add_subcommand(
      "replay", "Replay a trace (id,lower,upper,size) through an online allocator");
  cmd->add_option("trace", opts->trace, "trace CSV file")->required()->check(path_given());
  cmd->add_option("--allocator", opts->allocator, "best-fit or o1")
      ->check(CLI::IsMember({"best-fit", "o1"}));
  cmd->add_option("--alignment", opts->alignment, "size alignment in bytes (power of two)")
      ->check(power_of_two_count());
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->callback([opts] { run_replay(*opts); });
}

}  // namespace tensormem::cli
