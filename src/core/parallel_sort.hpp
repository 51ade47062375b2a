#pragma once
// Sorting large event arrays on two threads. Private to core/.

#include <algorithm>
#include <thread>
#include <vector>

namespace tensormem::core::detail {

/// std::sort of `v`, the two halves on two threads when there are enough elements and more
/// than one hardware thread, then one merge. Same result as std::sort for a strict weak order
/// on distinct elements (every caller's keys are unique).
template <class T>
void sort_on_two_threads(std::vector<T>& v) {
  constexpr std::size_t worth_a_thread = std::size_t{1} << 16;
  if (v.size() < worth_a_thread || std::thread::hardware_concurrency() < 2) {
    std::sort(v.begin(), v.end());
    return;
  }
  const auto middle = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  {
    std::jthread first([&v, middle] { std::sort(v.begin(), middle); });
    std::sort(middle, v.end());
  }
  std::inplace_merge(v.begin(), middle, v.end());
}

}  // namespace tensormem::core::detail
