// `tensormem arena`: run an allocation script against a contiguous arena.

#include <fstream>
#include <iostream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "arena_ops.hpp"
#include "commands.hpp"
#include "report.hpp"
#include "tensormem/memory/host_resource.hpp"
#include "tensormem/trace/arena_svg.hpp"
#include "tensormem/trace/trace_io.hpp"

namespace tensormem::cli {

namespace {

struct arena_cli_options {
  std::uint64_t capacity = 0;
  std::string ops;
  std::string scenario;
  std::string policy = "minimal";
  std::uint64_t alignment = 256;
  std::size_t resolution = 64;
  std::string svg;
  bool verify = false;
  bool json = false;
};

// Exit status 2 when the script ran but some steps failed or contents changed.
void fail_if_needed(const arena_run_result& r) {
  if (r.verified && !*r.verified) throw command_failed(2, "verification failed: tensor contents changed");
  if (!r.failed_lines.empty()) {
    throw command_failed(2, std::to_string(r.failed_lines.size()) + " of " + std::to_string(r.steps) +
                                " steps failed");
  }
}

void run_arena(const arena_cli_options& o, bool alignment_given, bool capacity_given) {
  std::vector<arena_op> ops;
  std::uint64_t capacity = o.capacity;
  std::uint64_t alignment = o.alignment;
  if (!o.scenario.empty()) {
    const auto sc = find_arena_scenario(o.scenario);
    if (!sc) {
      std::string names;
      for (const auto& n : arena_scenario_names()) names += " " + n;
      throw std::invalid_argument("unknown scenario '" + o.scenario + "' (known:" + names + ")");
    }
    std::istringstream in(sc->script);
    ops = parse_arena_ops(in, o.scenario);
    if (!capacity_given) capacity = sc->capacity;
    if (!alignment_given) alignment = sc->alignment;
  } else {
    std::ifstream in = trace::open_input(o.ops);
    ops = parse_arena_ops(in, o.ops);
  }
  if (capacity == 0) throw std::invalid_argument("--capacity is required with --ops");
  check_output_path("--svg", o.svg);
  memory::host_resource host;
  arena::contiguous_arena a(host, capacity,
                            {.alignment = alignment,
                             .policy = o.policy == "full" ? arena::defrag_policy::full_compaction
                                                          : arena::defrag_policy::minimal_move});
  const arena_run_result r = run_arena_ops(a, ops, o.verify, o.resolution);
  const arena::arena_stats s = a.stats();
  const std::string map = a.print_allocation(o.resolution);
  if (!o.svg.empty()) trace::write_arena_svg(o.svg, r.snapshots, capacity);
  if (o.json) {
    nlohmann::json j;
    j["steps"] = r.steps;
    j["failed_steps"] = r.failed_lines;
    j["max_allocated"] = a.max_allocated();
    j["defragmentations"] = s.defragmentations;
    j["bytes_moved"] = s.bytes_moved;
    j["verified"] = r.verified ? nlohmann::json(*r.verified) : nlohmann::json(nullptr);
    j["map"] = map;
    std::cout << json_text(j) << '\n';
    fail_if_needed(r);
    return;
  }
  std::cout << fmt::format("arena: {} bytes, alignment {}, policy {}\n", capacity, alignment,
                           o.policy);
  for (std::size_t i = 0; i < r.maps_after_defrag.size(); ++i) {
    std::cout << fmt::format("after defragmentation {}: [{}]\n", i + 1, r.maps_after_defrag[i]);
  }
  for (const std::string& f : r.failures) std::cout << "failed " << f << '\n';
  std::cout << fmt::format("at the end:              [{}]\n", map)
            << fmt::format("steps {}, failed {}, max allocated {} ({}), defragmentations {}, "
                           "bytes moved {} in {} moves, largest hole {}\n",
                           r.steps, r.failed_lines.size(), a.max_allocated(),
                           human_bytes(a.max_allocated()), s.defragmentations, s.bytes_moved,
                           s.moves, s.largest_free_bytes);
  if (r.verified) std::cout << "verified: " << (*r.verified ? "yes" : "NO") << '\n';
  fail_if_needed(r);
}

}  // namespace

void add_arena_command(CLI::App& app) {
  auto o = std::make_shared<arena_cli_options>();
  CLI::App* cmd = app.add_subcommand("arena", "Run alloc/free steps against a contiguous arena");
  auto* capacity = cmd->add_option("--capacity", o->capacity, "arena bytes")->check(positive_count());
  auto* ops = cmd->add_option("--ops", o->ops, "script: 'alloc ID BYTES' / 'free ID' per line")
                  ->check(path_given());
  auto* scenario = cmd->add_option("--scenario", o->scenario, "built-in script: fp16-compactions, zero3");
  ops->excludes(scenario);
  cmd->add_option("--policy", o->policy, "defragmentation: minimal (default) or full")
      ->check(CLI::IsMember({"minimal", "full"}));
  auto* alignment = cmd->add_option("--alignment", o->alignment, "bytes (default 256; scenarios set their own)")
      ->check(power_of_two_count());
  cmd->add_option("--resolution", o->resolution, "cells in the map (1 to 1000000)")
      ->check(CLI::Range(std::size_t{1}, arena::contiguous_arena::max_resolution));
  cmd->add_option("--svg", o->svg, "draw the map after each defragmentation and at the end as SVG")
      ->check(path_given());
  cmd->add_flag("--verify", o->verify, "fill tensors with patterns; after every step check each one the step could have changed");
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->callback([o, alignment, capacity, ops, scenario] {
    if (ops->count() == 0 && scenario->count() == 0) {
      throw std::invalid_argument("arena needs --ops FILE or --scenario NAME");
    }
    run_arena(*o, alignment->count() != 0, capacity->count() != 0);
  });
}

}  // namespace tensormem::cli
