#pragma once
// Pictures of plans, time on x and offset on y: a static SVG, and an interactive HTML page.

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>

#include "tensormem/core/lifetime.hpp"

namespace tensormem::trace {

/// What is wrong with a plan to be drawn (core::validate's message), empty when it is valid.
/// Throws std::invalid_argument when there is not one offset per buffer.
std::string plan_problem(std::span<const core::buffer> buffers, std::span<const std::uint64_t> offsets,
                         std::uint64_t arena_bytes);

/// A plan's validation that its caller has made already (core::validate's message for these
/// buffers, offsets and arena, at any alignment; empty for a valid plan). Given to a picture,
/// it is shown as the picture's own would be, and the plan is not validated again (on 10^6
/// buffers that takes about as long as drawing it). Without it, the picture validates.
using known_problem = std::optional<std::string>;

/// Draws a plan: x is time, y is offset (0 at the bottom), one rectangle per buffer with its
/// id as a tooltip, a dashed line at the lower bound and a solid one at the arena size. A
/// plan that does not validate (plan_problem) is drawn as given, under a red line that says
/// what is wrong. Returns that message (empty for a valid plan). std::invalid_argument when
/// there is not one offset per buffer.
std::string write_plan_svg(std::ostream& out, std::span<const core::buffer> buffers,
                           std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                           std::uint64_t lower_bound, const known_problem& validated = std::nullopt);
/// As above, to a file; throws std::system_error when it cannot be written, and
/// std::invalid_argument for an empty path or one holding a NUL byte (io::check_path_argument).
/// A file there is replaced only once the new one is whole, as write_trace does.
std::string write_plan_svg(const std::string& path, std::span<const core::buffer> buffers,
                           std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                           std::uint64_t lower_bound, const known_problem& validated = std::nullopt);

/// An interactive page of a plan: one self-contained HTML file (no network), the buffers
/// drawn on a canvas by the page's own script; the wheel zooms about the pointer (shift: time
/// only, alt: bytes only), dragging pans, a double click resets, and hovering a buffer shows
/// its id, size, lifetime and offset. The number of buffers drawn in the current view is kept
/// in the element `#drawn`. Opened with `#selftest` at the end of its address, the page
/// hovers its largest buffer and zooms once by itself and writes what it saw into
/// `#selftest` (for a headless browser). Values are exact up to 2^53. A plan that does not
/// validate is drawn as given, and the bar says what is wrong (`#invalid`); returns that
/// message (empty for a valid plan).
/// std::invalid_argument when there is not one offset per buffer.
std::string write_plan_html(std::ostream& out, std::span<const core::buffer> buffers,
                            std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                            std::uint64_t lower_bound, const std::string& title,
                            const known_problem& validated = std::nullopt);
/// As above, to a file; throws std::system_error when it cannot be written, and
/// std::invalid_argument for an empty path or one holding a NUL byte (io::check_path_argument).
/// A file there is replaced only once the new one is whole, as write_trace does.
std::string write_plan_html(const std::string& path, std::span<const core::buffer> buffers,
                            std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                            std::uint64_t lower_bound, const std::string& title,
                            const known_problem& validated = std::nullopt);

}  // namespace tensormem::trace
