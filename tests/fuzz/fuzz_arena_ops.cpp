// Fuzz target: the arena script parser, and the arena on every script it accepts. Any input
// must end in a parse error or in a run whose contents verify after every step.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>

#include "arena_ops.hpp"
#include "tensormem/memory/host_resource.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::vector<tensormem::cli::arena_op> ops;
  try {
    ops = tensormem::cli::parse_arena_ops(in, "fuzz");
  } catch (const std::runtime_error&) {
    return 0;
  }
  tensormem::memory::host_resource host;
  for (const auto policy : {tensormem::arena::defrag_policy::minimal_move,
                            tensormem::arena::defrag_policy::full_compaction}) {
    tensormem::arena::contiguous_arena arena(host, 1 << 16, {.alignment = 64, .policy = policy});
    const auto r = tensormem::cli::run_arena_ops(arena, ops, true, 16);
    if (r.verified && !*r.verified) std::abort();
  }
  return 0;
}
