// Fuzz target: the trace reader, and the planner on every trace it accepts. Any input must
// end in a trace_error or in a plan that the independent validator accepts.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>

#include "tensormem/core/planner.hpp"
#include "tensormem/trace/trace_io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::vector<tensormem::core::buffer> buffers;
  try {
    buffers = tensormem::trace::read_trace(in, "fuzz");
  } catch (const tensormem::trace::trace_error&) {
    return 0;
  }
  tensormem::core::plan_options o;
  o.search = false;  // the greedy phase only: bounded time per input
  o.threads = 1;
  tensormem::core::plan_result r;
  try {
    r = tensormem::core::plan(buffers, o);
  } catch (const std::invalid_argument&) {
    return 0;  // sizes past 2^64: refused, as documented
  }
  if (!tensormem::core::validate(buffers, r.offsets, r.arena_bytes).empty()) std::abort();
  if (r.arena_bytes < r.lower_bound) std::abort();
  return 0;
}
