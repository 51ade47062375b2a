// Fuzz target: the trace reader, and the planner on every trace it accepts. Any input must
// end in a trace_error or in plans that pass plan_oracle.hpp's checks: the greedy phase
// alone and the search (on one or two threads by the input's length) both valid, and on a
// few buffers the search's arena proven optimal and equal to a brute-force optimum.

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan_oracle.hpp"
#include "tensormem/trace/trace_io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::vector<tensormem::core::buffer> buffers;
  try {
    buffers = tensormem::trace::read_trace(in, "fuzz");
  } catch (const tensormem::trace::trace_error&) {
    return 0;
  }
  try {
    tensormem::fuzz::check_plans(buffers, 1, 1 + static_cast<unsigned>(size % 2));
  } catch (const std::invalid_argument&) {
    return 0;  // sizes past 2^64: refused, as documented
  }
  return 0;
}
