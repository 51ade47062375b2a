#pragma once
// pybind11 before 2.12 reads numpy's array descriptors with numpy 1's layout. Under numpy 2
// that layout moved, and such a build would read element sizes and flags from the wrong
// places: arrays would cross the boundary as wrong numbers, without an error. A module built
// that way refuses numpy 2 arrays with an error that says how to rebuild instead.

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

namespace tensormem::python {

inline constexpr bool pybind11_reads_numpy2 =
    PYBIND11_VERSION_MAJOR > 2 || (PYBIND11_VERSION_MAJOR == 2 && PYBIND11_VERSION_MINOR >= 12);

inline std::string pybind11_version() {
  return std::to_string(PYBIND11_VERSION_MAJOR) + "." + std::to_string(PYBIND11_VERSION_MINOR) + "." +
         std::to_string(PYBIND11_VERSION_PATCH);
}

/// Empty when this build reads the loaded numpy's arrays correctly, else why not. Read once,
/// when first asked (numpy is imported then, if it is not already).
inline std::string numpy_abi_problem() {
  if constexpr (pybind11_reads_numpy2) {
    return {};
  } else {
    static const std::string problem = [] {
      namespace py = pybind11;
      const std::string version = py::str(py::module_::import("numpy").attr("__version__")).cast<std::string>();
      const std::size_t digits = version.find_first_not_of("0123456789");
      const std::string major = version.substr(0, digits);
      if (major.empty() || std::stoul(major) < 2) return std::string();
      return "this tensormem was built with pybind11 " + pybind11_version() + ", which misreads the arrays of numpy " +
             version + " (numpy 2 needs pybind11 2.12 or later); rebuild tensormem with pybind11 >= 2.12, or use "
             "numpy < 2";
    }();
    return problem;
  }
}

/// Throws std::runtime_error (RuntimeError in Python), naming `what`, when numpy_abi_problem()
/// is not empty.
inline void require_numpy_abi(const char* what) {
  const std::string problem = numpy_abi_problem();
  if (!problem.empty()) throw std::runtime_error(std::string(what) + ": " + problem);
}

}  // namespace tensormem::python
