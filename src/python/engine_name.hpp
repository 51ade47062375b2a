#pragma once
// The I/O engine named by a Python argument ("uring" or "threads"), for every binding that
// takes one, and the names themselves (tensormem.IO_ENGINES) for the Python layers that check
// their arguments before making an object.

#include <array>
#include <stdexcept>
#include <string>
#include <string_view>

#include "tensormem/io/io_engine.hpp"

namespace tensormem::python {

inline constexpr std::array<io::engine_kind, 2> engine_kinds = {io::engine_kind::uring, io::engine_kind::threads};

inline io::engine_kind engine_of(const std::string& name) {
  for (const io::engine_kind kind : engine_kinds) {
    if (name == io::to_string(kind)) return kind;
  }
  throw std::invalid_argument("engine must be '" + std::string(io::to_string(engine_kinds[0])) + "' or '" +
                              std::string(io::to_string(engine_kinds[1])) + "', not '" + name + "'");
}

}  // namespace tensormem::python
