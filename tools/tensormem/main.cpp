// tensormem: command-line front end of the tensormem library.

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <string>

#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "huge_pages.hpp"
#include "progress.hpp"
#include "tensormem/memory/cuda_resources.hpp"
#include "tensormem/memory/errors.hpp"
#include "tensormem/trace/trace_io.hpp"

namespace {

int run(int argc, char** argv) {
  CLI::App app{"tensormem: tensor memory planning, arenas, pinned memory and swapping"};
  app.require_subcommand(1);
  // Help shows every option's default value (inherited by the subcommands added below).
  app.option_defaults()->always_capture_default();
  // Options of the tool itself may also follow the command's name ("tensormem plan T -q").
  app.fallthrough();
  app.add_flag("-q,--quiet", tensormem::cli::quiet_flag(),
               "no progress line (it is shown only when stderr is a terminal)");
  // The version, and whether the CUDA resources can be used here (and why not).
  app.set_version_flag("--version", [] {
    std::string text = std::string("tensormem ") + TENSORMEM_VERSION + "\nCUDA resources: ";
    if (!tensormem::memory::cuda_built()) text += "not built";
    else if (const std::string why = tensormem::memory::cuda_unavailable_reason(); why.empty()) text += "available";
    else text += "unavailable (" + why + ")";
    return text + "\nheap on huge pages: " + tensormem::cli::huge_pages_status();
  });
  tensormem::cli::add_demo_command(app);
  tensormem::cli::add_plan_command(app);
  tensormem::cli::add_arena_command(app);
  tensormem::cli::add_swap_bench_command(app);
  tensormem::cli::add_pinned_bench_command(app);
  tensormem::cli::add_replay_command(app);
  // A first word that is neither an option nor a command is named as such (CLI11 would
  // only say that a subcommand is required).
  if (argc > 1 && argv[1][0] != '-') {
    const std::string word = argv[1];
    std::string known;
    bool found = false;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
      known += (known.empty() ? "" : ", ") + sub->get_name();
      found = found || sub->get_name() == word;
    }
    if (!found) {
      std::cerr << "tensormem: unknown command " << tensormem::trace::brief(word) << " (commands: " << known
                << "; see --help)\n";
      return 1;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const tensormem::cli::command_failed& e) {
    std::cerr << "tensormem: " << e.what() << '\n';
    return e.code();
  } catch (const std::bad_alloc& e) {
    // The library's out_of_memory says what was asked for; the standard one only its name.
    const bool named = dynamic_cast<const tensormem::memory::out_of_memory*>(&e) != nullptr;
    std::cerr << "tensormem: " << (named ? e.what() : "out of memory") << '\n';
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "tensormem: " << e.what() << '\n';
    return 1;
  }
  return 0;
}

// What a command printed reaches its file only when the standard output is flushed: a full
// disk (or any failed write) is reported here, and the exit status says so, instead of a
// success with a truncated result.
int finish_standard_output(int code) {
  errno = 0;
  std::cout.flush();  // the stream writes through stdout's buffer, so this is where a write fails
  const bool flush_failed = std::fflush(stdout) != 0;
  const int error = errno;
  if (flush_failed || std::ferror(stdout) != 0 || std::cout.fail()) {
    std::cerr << "tensormem: cannot write the standard output"
              << (error != 0 ? std::string(": ") + std::strerror(error) : std::string()) << '\n';
    return code != 0 ? code : 1;
  }
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  tensormem::cli::use_huge_pages(argv);
  return finish_standard_output(run(argc, argv));
}
