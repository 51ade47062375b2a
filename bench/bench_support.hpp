#pragma once
// Helpers shared by the benchmark executables.

#include <benchmark/benchmark.h>

#include <filesystem>
#include <string>

namespace tensormem::bench {

/// A public trace: ../shared/traces when it is there, else the copy under tests/data/traces.
inline std::string trace_file(const std::string& name) {
  const std::string shared = std::string(TENSORMEM_SOURCE_DIR) + "/../shared/traces/" + name;
  if (std::filesystem::exists(shared)) return shared;
  return std::string(TENSORMEM_SOURCE_DIR) + "/tests/data/traces/" + name;
}

/// main() for benchmarks registered at run time by `register_all`.
inline int run_benchmarks(int argc, char** argv, void (*register_all)()) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace tensormem::bench
