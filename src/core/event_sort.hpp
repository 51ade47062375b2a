#pragma once
// Sorting large event arrays by time. Private to core/.

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <utility>
#include <vector>

namespace tensormem::core::detail {

/// Stable sort of `(time, payload)` events by time: elements with equal times keep their
/// order, so a caller gets any order among them by how it lays them out (the planner's and
/// the validator's events: every end, then every start, each in buffer order). An LSD radix
/// sort on the time minus the smallest time, 11 bits per pass, only over the bits where the
/// times differ, and a pass skipped when all times share its digit: about 2 passes for a
/// million events over a million steps, 6 at most. O(n) per pass, one extra array of n
/// events. Small inputs go to std::stable_sort.
template <class T>
void stable_sort_by_time(std::vector<std::pair<std::uint64_t, T>>& v) {
  using event = std::pair<std::uint64_t, T>;
  constexpr unsigned digit_bits = 11;
  constexpr std::size_t radix = std::size_t{1} << digit_bits;
  const std::size_t n = v.size();
  if (n < 1024) {
    std::stable_sort(v.begin(), v.end(), [](const event& a, const event& b) { return a.first < b.first; });
    return;
  }
  std::uint64_t lo = v[0].first;
  std::uint64_t hi = v[0].first;
  for (const event& e : v) {
    lo = std::min(lo, e.first);
    hi = std::max(hi, e.first);
  }
  const auto bits = static_cast<unsigned>(std::bit_width(hi - lo));
  const unsigned passes = (bits + digit_bits - 1) / digit_bits;
  if (passes == 0) return;  // all times equal
  // The histograms of every pass in one read of the events.
  std::vector<std::array<std::size_t, radix>> count(passes);
  for (auto& c : count) c.fill(0);
  for (const event& e : v) {
    const std::uint64_t key = e.first - lo;
    for (unsigned p = 0; p < passes; ++p) ++count[p][(key >> (p * digit_bits)) & (radix - 1)];
  }
  std::vector<event> other;
  for (unsigned p = 0; p < passes; ++p) {
    auto& c = count[p];
    if (std::find(c.begin(), c.end(), n) != c.end()) continue;  // one digit value: nothing moves
    if (other.empty()) other.resize(n);
    std::size_t sum = 0;
    for (std::size_t& slot : c) sum += std::exchange(slot, sum);  // each digit's first position
    const unsigned shift = p * digit_bits;
    for (const event& e : v) other[c[((e.first - lo) >> shift) & (radix - 1)]++] = e;
    v.swap(other);
  }
}

}  // namespace tensormem::core::detail
