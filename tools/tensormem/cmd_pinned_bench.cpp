// `tensormem pinned-bench`: pooled vs per-allocation page-locked memory.

#include <iostream>
#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "report.hpp"
#include "tensormem/memory/errors.hpp"
#include "tensormem/memory/pinned_benchmark.hpp"

namespace tensormem::cli {

void add_pinned_bench_command(CLI::App& app) {
  struct options {
    memory::pinned_benchmark_options bench;
    bool json = false;
  };
  auto o = std::make_shared<options>();
  CLI::App* cmd = app.add_subcommand(
      "pinned-bench", "Allocate/free pairs (4 KiB-64 MiB) from the pinned pool vs mmap+mlock each");
  cmd->add_option("--pool-pairs", o->bench.pool_pairs, "pairs through the pool")
      ->check(positive_count());
  cmd->add_option("--mlock-pairs", o->bench.mlock_pairs, "pairs of one locked mapping each")
      ->check(positive_count());
  cmd->add_option("--seed", o->bench.seed, "seed of the size sequence")->check(whole_number("SEED>=0"));
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->callback([o] {
    memory::pinned_benchmark_result r;
    try {
      r = memory::run_pinned_benchmark(o->bench);
    } catch (const memory::lock_limit_error& e) {  // the measure is of locked memory: no fallback
      throw e.without_fallback(" (pinned-bench measures page-locked memory, so it has no unlocked fallback)");
    }
    if (o->json) {
      nlohmann::json j;
      j["pool_ns_per_pair"] = r.pool_ns_per_pair;
      j["mlock_ns_per_pair"] = r.mlock_ns_per_pair;
      j["speedup"] = r.speedup;
      j["locked_bytes_after_release"] = r.locked_bytes_after_release;
      j["pool_system_calls"] = r.pool_system_calls;
      j["mlock_system_calls"] = r.mlock_system_calls;
      std::cout << json_text(j) << '\n';
      return;
    }
    std::cout << fmt::format("pinned pool           {:>12.1f} ns per allocate/free pair ({} system calls)\n",
                             r.pool_ns_per_pair, r.pool_system_calls)
              << fmt::format("mmap + mlock each     {:>12.1f} ns per pair ({} system calls)\n", r.mlock_ns_per_pair,
                             r.mlock_system_calls)
              << fmt::format("speedup               {:>12.1f} x\n", r.speedup)
              << fmt::format("locked bytes left     {:>12}\n", r.locked_bytes_after_release);
  });
}

}  // namespace tensormem::cli
