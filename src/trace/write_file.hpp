#pragma once
// Writes a text file through a callback; a file that cannot be opened or written is a
// std::system_error naming it; an empty path or one holding a NUL byte is
// std::invalid_argument.

#include <cerrno>
#include <fstream>
#include <string>
#include <system_error>

#include "tensormem/io/path_argument.hpp"

namespace tensormem::trace::detail {

template <class Write>
void write_file(const std::string& path, Write&& write) {
  io::check_path_argument("cannot write", path);
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw std::system_error(errno, std::generic_category(), "cannot write " + path);
  write(out);
  out.flush();
  if (!out) throw std::system_error(errno, std::generic_category(), "cannot write " + path);
}

}  // namespace tensormem::trace::detail
