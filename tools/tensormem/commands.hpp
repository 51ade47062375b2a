#pragma once
// Sub-commands of the `tensormem` command-line tool.

#include <CLI/CLI.hpp>

namespace tensormem::cli {

void add_replay_command(CLI::App& app);
void add_demo_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_pinned_bench_command(CLI::App& app);
void add_arena_command(CLI::App& app);
void add_swap_bench_command(CLI::App& app);

}  // namespace tensormem::cli
