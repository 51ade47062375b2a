#pragma once
// The contiguous arena's map as an SVG picture: one bar per snapshot, offsets on x.

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <span>
#include <string>
#include <vector>

#include "tensormem/arena/contiguous_arena.hpp"

namespace tensormem::trace {

/// A live tensor in a snapshot: its name, where it starts, the bytes asked for and the bytes
/// the arena reserves for it (aligned).
struct arena_block {
  std::string name;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t reserved = 0;
};

/// The arena at one moment ("after defragmentation 1", "at the end").
struct arena_snapshot {
  std::string label;
  std::vector<arena_block> blocks;
};

/// A snapshot of `arena` now; tensors are named by `name_of(id)`, or by their ids.
arena_snapshot snapshot(const arena::contiguous_arena& arena, std::string label,
                        const std::function<std::string(std::uint64_t)>& name_of = {});

/// Draws the snapshots one bar under the other over [0, capacity): each tensor a rectangle
/// (its alignment padding paler) with its name, offset and size as a tooltip, free space
/// white; per bar the bytes used and free and the largest hole; an axis in binary units.
/// Throws std::invalid_argument when a block lies outside the capacity.
void write_arena_svg(std::ostream& out, std::span<const arena_snapshot> snapshots, std::uint64_t capacity);
/// As above, to a file; throws std::system_error when it cannot be written, and
/// std::invalid_argument for an empty path or one holding a NUL byte. A file there is replaced
/// only once the new one is whole, as trace::write_trace does.
void write_arena_svg(const std::string& path, std::span<const arena_snapshot> snapshots,
                     std::uint64_t capacity);

}  // namespace tensormem::trace
