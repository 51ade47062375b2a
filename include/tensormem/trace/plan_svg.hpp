#pragma once
// Pictures of plans: one SVG rectangle per buffer, time on x and offset on y.

#include <cstdint>
#include <iosfwd>
#include <span>
#include <string>

#include "tensormem/core/lifetime.hpp"

namespace tensormem::trace {

/// Draws a plan: x is time, y is offset (0 at the bottom), one rectangle per buffer with its
/// id as a tooltip, a dashed line at the lower bound and a solid one at the arena size.
void write_plan_svg(std::ostream& out, std::span<const core::buffer> buffers,
                    std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                    std::uint64_t lower_bound);
/// As above, to a file; throws std::system_error when it cannot be written.
void write_plan_svg(const std::string& path, std::span<const core::buffer> buffers,
                    std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                    std::uint64_t lower_bound);

}  // namespace tensormem::trace
