#pragma once
// Reading and writing lifetime traces: CSV with the header `id,lower,upper,size[,offset]`.

#include <iosfwd>
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

/// Reads a whole trace. `id` is any text without a comma; the other columns are unsigned
/// 64-bit integers; lifetimes are half-open, so `lower < upper` is required. An `offset`
/// column, when the header has it, must be filled on every line. Blank lines are ignored.
/// Throws trace_error on the first problem (missing or extra column, non-numeric, negative or
/// out-of-range value, lower >= upper, duplicate id, no buffers); nothing is returned then.
std::vector<core::buffer> read_trace(std::istream& in, const std::string& name);
/// As above, from a file; a file that cannot be opened is a trace_error naming it.
std::vector<core::buffer> read_trace(const std::string& path);

/// Writes `buffers` with a header; the offset column is written when every buffer has one.
void write_trace(std::ostream& out, const std::vector<core::buffer>& buffers);
/// As above, to a file; throws std::system_error when it cannot be written.
void write_trace(const std::string& path, const std::vector<core::buffer>& buffers);

}  // namespace tensormem::trace
