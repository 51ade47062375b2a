#pragma once
// Arena operation scripts: `alloc ID BYTES` / `free ID` per line, run against an arena.

#include <cstdint>
#include <cstddef>
#include <iosfwd>
#include <map>
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

/// Patterns written into tensors by name, and the check of the tensors a step could have
/// changed. Each tensor lives at `base + offset`; only its pattern and moves write there.
class pattern_check {
 public:
  explicit pattern_check(std::byte* base) : base_(base) {}
  /// Writes `name`'s pattern into [offset, offset + bytes) and returns the names of the live
  /// tensors that overlap it whose contents no longer match their patterns (none unless the
  /// placement was wrong). Tensors of 0 bytes are kept but never checked.
  std::vector<std::string> add(const std::string& name, std::uint64_t offset, std::uint64_t bytes);
  void remove(const std::string& name);
  /// A tensor's new offset after a move (its bytes are expected to have moved with it).
  void relocate(const std::string& name, std::uint64_t offset);
  /// The names of all live tensors whose contents do not match their patterns.
  std::vector<std::string> check_all() const;

 private:
  struct tensor {
    std::uint64_t offset = 0;
    std::vector<std::byte> pattern;
  };
  bool intact(const tensor& t) const;
  void unplace(const std::string& name, std::uint64_t offset);  // drops it from by_offset_
  std::byte* base_;
  std::map<std::string, tensor> tensors_;
  std::multimap<std::uint64_t, std::string> by_offset_;  // tensors of at least one byte
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
/// from its name, and after every step each tensor the step could have changed is checked:
/// every live tensor after a step that moved tensors, the tensors a new one overlaps after an
/// allocation (only moves and new tensors' patterns write to the arena). A run costs the bytes
/// written and moved plus one check of the live tensors per defragmentation, not the live
/// bytes at every step.
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
arena_scenario zero3_scenario(std::uint64_t layers, std::uint64_t seed);
/// The fewest bytes one layer's activations take in zero3_scenario (16 pages). Every layer's
/// activations are live at once at the end of the forward pass, so its arena holds at least
/// `layers` times this.
inline constexpr std::uint64_t zero3_least_activation_bytes = 16 * 4096;

}  // namespace tensormem::cli
