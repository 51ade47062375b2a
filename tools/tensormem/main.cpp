// tensormem: command-line front end of the tensormem library.

#include <exception>
#include <iostream>

#include <CLI/CLI.hpp>

#include "commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"tensormem: tensor memory planning, arenas, pinned memory and swapping"};
  app.require_subcommand(1);
  tensormem::cli::add_demo_command(app);
  tensormem::cli::add_plan_command(app);
  tensormem::cli::add_arena_command(app);
  tensormem::cli::add_swap_bench_command(app);
  tensormem::cli::add_pinned_bench_command(app);
  tensormem::cli::add_replay_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "tensormem: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
