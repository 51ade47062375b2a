#pragma once
// The check every entry point that takes a file or folder path makes before using it.

#include <string_view>

namespace tensormem::io {

/// Refuses a path that would name no file, or another file than the one given: an empty
/// path, and a path holding a NUL byte (the system reads a path up to its first NUL, so
/// "a\0b" would name "a"). Throws std::invalid_argument "<who>: ...".
void check_path_argument(std::string_view who, std::string_view path);

}  // namespace tensormem::io
