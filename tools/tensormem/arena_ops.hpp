#pragma once
// Arena operation scripts: `alloc ID BYTES` / `free ID` per line, run against an arena.

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "tensormem/arena/contiguous_arena.hpp"
#include "tensormem/trace/arena_svg.hpp"

namespace tensormem::cli {

struct arena_op {
  bool allocate = false;
  std::string name;
  std::uint64_t bytes = 0;
  std::size_t line = 0;
};

/// Parses a script; '#' starts a comment, blank lines are skipped. A malformed line throws
/// std::runtime_error naming `source:line`.
std::vector<arena_op> parse_arena_ops(std::istream& in, const std::string& source);

struct arena_run_result {
  std::size_t steps = 0;
  std::vector<std::size_t> failed_lines;
  std::vector<std::string> failures;  ///< "line N: what", one per failed step
  std::optional<bool> verified;       ///< set when verification ran
  std::vector<std::string> maps_after_defrag;
  /// The arena after each defragmentation and at the end, tensors named as in the script.
  std::vector<trace::arena_snapshot> snapshots;
};

/// Runs the steps. A step that cannot be satisfied (out of memory, unknown or live name) is
/// recorded and the run goes on. With `verify`, each tensor is filled with a pattern derived
/// from its name and every live tensor is checked after every step.
arena_run_result run_arena_ops(arena::contiguous_arena& arena, const std::vector<arena_op>& ops,
                               bool verify, std::size_t resolution);

/// Built-in scenarios: name -> (script, capacity in bytes, alignment).
struct arena_scenario {
  std::string script;
  std::uint64_t capacity = 0;
  std::uint64_t alignment = 1;
  std::string description;
};
std::optional<arena_scenario> find_arena_scenario(const std::string& name);
std::vector<std::string> arena_scenario_names();

/// A ZeRO-3-like training step over `layers` layers: parameter partitions gathered before
/// each layer's forward and backward and released after, a few kept, gradients allocated
/// in backward. Sizes vary per layer; the capacity returned leaves little slack.
arena_scenario zero3_scenario(std::uint32_t layers, std::uint64_t seed);

}  // namespace tensormem::cli
