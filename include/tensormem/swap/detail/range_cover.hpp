#pragma once
// How many of a set of address ranges cover each byte: the memory of unwaited transfers.

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>

namespace tensormem::swap::detail {

/// A multiset of half-open address ranges [begin, end), kept as the steps of its coverage
/// count: a key is an address where the count changes, its value the count from there up to
/// the next key. Adjacent keys never hold equal values (and no leading key holds 0), so
/// `overlaps` looks at no more than three keys. add and remove: O(log n + keys inside the
/// range); overlaps: O(log n). Not thread-safe.
class range_cover {
 public:
  /// Adds [begin, end); an empty range (begin >= end) is ignored.
  void add(std::uintptr_t begin, std::uintptr_t end) { change(begin, end, +1); }
  /// Removes one [begin, end) added before (the caller's contract: never one not added).
  void remove(std::uintptr_t begin, std::uintptr_t end) { change(begin, end, -1); }
  /// True if some byte of [begin, end) lies in a range of the set.
  bool overlaps(std::uintptr_t begin, std::uintptr_t end) const {
    if (begin >= end) return false;
    auto it = steps_.upper_bound(begin);
    if (it != steps_.begin() && std::prev(it)->second > 0) return true;
    for (; it != steps_.end() && it->first < end; ++it) {
      if (it->second > 0) return true;
    }
    return false;
  }
  bool empty() const noexcept { return steps_.empty(); }
  /// Keys kept: one per address where the count changes, no more.
  std::size_t keys() const noexcept { return steps_.size(); }

 private:
  using steps = std::map<std::uintptr_t, std::int64_t>;
  steps::iterator key_at(std::uintptr_t x) {
    auto it = steps_.lower_bound(x);
    if (it != steps_.end() && it->first == x) return it;
    const std::int64_t count = it == steps_.begin() ? 0 : std::prev(it)->second;
    return steps_.emplace_hint(it, x, count);
  }
  // Drops the key at `it` when it no longer changes the count.
  void tidy(steps::iterator it) {
    const std::int64_t before = it == steps_.begin() ? 0 : std::prev(it)->second;
    if (it->second == before) steps_.erase(it);
  }
  void change(std::uintptr_t begin, std::uintptr_t end, std::int64_t delta) {
    if (begin >= end) return;
    const auto first = key_at(begin);
    const auto last = key_at(end);
    for (auto it = first; it != last; ++it) it->second += delta;
    tidy(last);
    tidy(first);
  }
  steps steps_;
};

}  // namespace tensormem::swap::detail
