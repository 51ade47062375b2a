// Plans three tensors with known lifetimes, places them online with best fit, and moves
// one through pinned memory: the installed library, from the outside.

#include <cstdio>
#include <vector>

#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/planner.hpp"
#include "tensormem/memory/pinned_pool.hpp"

int main() {
  using namespace tensormem;
  const std::vector<core::buffer> buffers = {{"a", 0, 2, 1024, {}}, {"b", 1, 3, 2048, {}}, {"c", 2, 4, 1024, {}}};
  const core::plan_result plan = core::plan(buffers, {.time_limit_seconds = 1});
  core::best_fit_allocator online;
  const auto a = online.allocate(1024);
  memory::pinned_pool pool;
  void* p = pool.allocate(4096, 4096);
  pool.free(p);
  std::printf("planned arena %llu bytes (lower bound %llu); online offset %llu\n",
              static_cast<unsigned long long>(plan.arena_bytes),
              static_cast<unsigned long long>(plan.lower_bound),
              static_cast<unsigned long long>(a ? a->offset : 0));
  return plan.arena_bytes == plan.lower_bound ? 0 : 1;
}
