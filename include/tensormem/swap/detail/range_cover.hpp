#pragma once
// How many of a set of address ranges cover each byte: the memory of unwaited transfers.

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <utility>
#include <vector>

namespace tensormem::swap::detail {

/// A multiset of half-open address ranges [begin, end), kept as the steps of its coverage
/// count: a key is an address where the count changes, its value the count from there up to
/// the next key. Adjacent keys never hold equal values (and no leading key holds 0), so
/// `overlaps` looks at no more than three keys. add and remove: O(log n + keys inside the
/// range); overlaps: O(log n). add and remove change nothing when they throw (std::bad_alloc
/// for a new key); after `reserve(k)` the next k new keys allocate nothing. Not thread-safe.
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
  /// Makes `keys` new keys ahead (each of add and remove makes at most two), so that the
  /// changes that follow cannot fail: a swapper's wait collects its transfers that way.
  void reserve(std::size_t keys) {
    spare_.reserve(keys);
    while (spare_.size() < keys) {
      steps made;
      spare_.push_back(made.extract(made.try_emplace(0, 0).first));
    }
  }
  /// Keys kept: one per address where the count changes, no more.
  std::size_t keys() const noexcept { return steps_.size(); }

 private:
  using steps = std::map<std::uintptr_t, std::int64_t>;
  steps::iterator key_at(std::uintptr_t x) {
    auto it = steps_.lower_bound(x);
    if (it != steps_.end() && it->first == x) return it;
    const std::int64_t count = it == steps_.begin() ? 0 : std::prev(it)->second;
    if (spare_.empty()) return steps_.emplace_hint(it, x, count);
    steps::node_type node = std::move(spare_.back());
    spare_.pop_back();
    node.key() = x;
    node.mapped() = count;
    return steps_.insert(it, std::move(node));
  }
  // Drops the key at `it` when it no longer changes the count.
  void tidy(steps::iterator it) {
    const std::int64_t before = it == steps_.begin() ? 0 : std::prev(it)->second;
    if (it->second != before) return;
    if (spare_.size() < spare_.capacity()) {
      spare_.push_back(steps_.extract(it));  // kept for a later key (room made by reserve)
    } else {
      steps_.erase(it);
    }
  }
  void change(std::uintptr_t begin, std::uintptr_t end, std::int64_t delta) {
    if (begin >= end) return;
    const auto first = key_at(begin);
    steps::iterator last;
    try {
      last = key_at(end);
    } catch (...) {
      tidy(first);  // a key made for `begin` alone changes no count: gone again
      throw;
    }
    for (auto it = first; it != last; ++it) it->second += delta;
    tidy(last);
    tidy(first);
  }
  steps steps_;
  std::vector<steps::node_type> spare_;  // keys made by reserve, not in use
};

}  // namespace tensormem::swap::detail
