#pragma once
// Helpers shared by the SVG pictures: escaping, binary units, round tick steps.

#include <cstdint>
#include <span>
#include <string>

#include "tensormem/trace/plan_svg.hpp"

namespace tensormem::trace::detail {

/// Text safe inside an SVG element or attribute; a byte that is not text (a control
/// character, or not UTF-8) becomes U+FFFD.
std::string escape(const std::string& s);
/// Bytes in the largest binary unit that keeps the number at least 1: "1.25 GiB".
std::string human(double bytes);
/// A round step (1, 2 or 5 times a power of `base`) giving about `ticks` ticks over `range`.
double tick_step(double range, double ticks, double base);
/// Tick step for a byte axis over [0, top]: round numbers of the largest binary unit that
/// fits, binary fractions of it (256 KiB, not 0.2 MiB) below one unit.
double byte_tick_step(double top, double ticks);
/// The problem a plan picture shows: the caller's validation where given (after the check of
/// one offset per buffer), else plan_problem's.
std::string picture_problem(std::span<const core::buffer> buffers, std::span<const std::uint64_t> offsets,
                            std::uint64_t arena_bytes, const known_problem& validated);

}  // namespace tensormem::trace::detail
