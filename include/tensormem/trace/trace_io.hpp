#pragma once
// Reading and writing lifetime traces: CSV with the header `id,lower,upper,size[,offset]`.

#include <cstddef>
#include <fstream>
#include <iosfwd>
#include <string_view>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensormem/core/lifetime.hpp"

namespace tensormem::trace {

/// A malformed trace. The message reads `file:line: what is wrong`.
class trace_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Longest line a trace or script may have; a longer one is an error, never buffered whole.
inline constexpr std::size_t max_line_bytes = 64 * 1024;

/// Opens `path` for reading text input, accepting only a regular file or a pipe (a
/// directory, /dev/zero or a terminal would never end or is not data): trace_error
/// `path:0: why` otherwise. A file that cannot be opened (missing, no permission) throws
/// std::system_error with its errno, "path:0: cannot open: <strerror>" (Python: OSError,
/// FileNotFoundError or PermissionError).
std::ifstream open_input(const std::string& path);

/// Reads one line (without its '\n') of at most `max_bytes` bytes. Returns false at the end
/// of input; throws trace_error `name:line: ...` for a longer line (it is not kept).
bool read_line(std::istream& in, std::string& line, std::size_t max_bytes, const std::string& name,
               std::size_t line_number);

/// Whether the first line of a text file begins with a UTF-8 byte order mark (as some
/// editors and spreadsheet programs write); the readers skip it.
inline bool starts_with_byte_order_mark(std::string_view line) noexcept {
  return line.starts_with("\xEF\xBB\xBF");
}

/// The index of the first byte of `text` that is not part of UTF-8 text without control
/// characters (C0 codes and DEL; a byte of a malformed, overlong or surrogate sequence, or
/// of a code point above U+10FFFF), or text.size() when there is none.
std::size_t first_non_text_byte(std::string_view text) noexcept;

/// Walks `text` in order: `run(part)` for each longest stretch of text (first_non_text_byte),
/// empty ones included, and `byte(b)` for each byte between them that is not text.
template <class Run, class Byte>
void for_each_text_run(std::string_view text, Run&& run, Byte&& byte) {
  for (std::size_t i = 0;;) {
    const std::size_t bad = i + first_non_text_byte(text.substr(i));
    run(text.substr(i, bad - i));
    if (bad == text.size()) return;
    byte(static_cast<unsigned char>(text[bad]));
    i = bad + 1;
  }
}

/// A field quoted briefly for an error message: at most 40 bytes, then how long it was; a
/// byte that is not text (first_non_text_byte) is written \xNN, so the message is UTF-8.
std::string brief(std::string_view field);

/// Reads a whole trace. `id` is UTF-8 text without a comma or control characters (it names
/// the buffer in reports, pictures and Python strings); the other columns are unsigned
/// 64-bit integers; lifetimes are half-open, so `lower < upper` is required. An `offset`
/// column, when the header has it, must be filled on every line. Blank lines are ignored, as
/// is a UTF-8 byte order mark before the header; fields are not quoted.
/// Throws trace_error on the first problem (missing or extra column, an id that is not text,
/// non-numeric, negative or out-of-range value, lower >= upper, duplicate id, no buffers);
/// nothing is returned then.
std::vector<core::buffer> read_trace(std::istream& in, const std::string& name);
/// As above, from a file; a file that cannot be opened is a std::system_error naming it
/// with its errno (open_input), a directory or device a trace_error; an empty path or one
/// holding a NUL byte is std::invalid_argument (io::check_path_argument).
std::vector<core::buffer> read_trace(const std::string& path);

/// Writes `buffers` with a header; the offset column is written when every buffer has one.
void write_trace(std::ostream& out, const std::vector<core::buffer>& buffers);
/// As above, to a file; throws std::system_error when it cannot be written, and
/// std::invalid_argument for an empty path or one holding a NUL byte. A regular file there
/// is replaced only once the new one is whole (written beside it, synced, renamed onto it):
/// a write that fails keeps it. The picture writers (plan_svg.hpp, arena_svg.hpp) do the same.
void write_trace(const std::string& path, const std::vector<core::buffer>& buffers);

}  // namespace tensormem::trace
