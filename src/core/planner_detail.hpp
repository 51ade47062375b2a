#pragma once
// Private pieces of the planner, shared by its translation units and its tests.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "tensormem/core/lifetime.hpp"
#include "tensormem/core/detail/thread_start.hpp"

namespace tensormem::core::detail {

/// A planner thread the system would not start (EAGAIN: a limit on threads or on the address
/// space, for the new thread's stack). plan() then plans again on the calling thread alone,
/// within the same time limit, and says so in plan_result::fallback.
class thread_refused : public std::system_error {
 public:
  using std::system_error::system_error;
};

/// std::jthread(args...), or thread_refused where the system will not start one.
template <class... Args>
std::jthread start_thread(Args&&... args) {
  try {
    return std::jthread(std::forward<Args>(args)...);
  } catch (const std::system_error& e) {
    throw thread_refused(e.code(), "a planner thread could not be started");
  }
}

/// A planning instance in compressed time: time points are renumbered so that buffer i is
/// alive in the sections [lo[i], hi[i]) (a section lies between two consecutive distinct
/// lifetime ends).
struct plan_problem {
  std::vector<std::uint64_t> bytes;   // rounded up to the alignment
  std::vector<std::uint64_t> length;  // upper - lower, in the trace's time units
  std::vector<std::uint32_t> lo;
  std::vector<std::uint32_t> hi;
  std::uint32_t sections = 0;
  std::uint32_t longest = 0;  // the most sections one buffer spans
  std::uint64_t lower_bound = 0;
  /// Lifetime events in time order, ends before starts at equal times, then by buffer:
  /// a buffer index, with `start_event` set for a start.
  std::vector<std::uint32_t> events;
  static constexpr std::uint32_t start_event = 0x80000000U;
  std::size_t size() const noexcept { return bytes.size(); }
};

plan_problem make_problem(std::span<const buffer> buffers, std::uint64_t alignment);

struct candidate_plan {
  std::vector<std::uint64_t> offsets;
  std::uint64_t arena = std::numeric_limits<std::uint64_t>::max();
  std::string strategy;
};

std::uint64_t arena_of(const plan_problem& p, std::span<const std::uint64_t> offsets);

/// For each buffer, the most bytes alive in one section of its span: the bytes of the
/// buffers alive in each section, then a range maximum over [lo, hi) (a segment tree,
/// O(n log S)). The lower bound is the largest of them.
std::vector<std::uint64_t> peak_live_over_span(const plan_problem& p);

/// How strongly the contention-weighted orders favour buffers that meet a busy section: a
/// buffer's weight is its size times (peak_live_over_span / lower bound)^contention_exponent,
/// so one whose busiest section holds 95.8 % of the lower bound counts half its size.
inline constexpr double contention_exponent = 16.0;

/// The contention weights in log scale (never overflow, zero sizes give -inf, no NaN):
/// ln(bytes) + contention_exponent * ln(peak over the span / lower bound). Needs a lower
/// bound above zero.
std::vector<double> contention_keys(const plan_problem& p);

/// One step of contention-guided first fit ("squeaky wheel"): every buffer whose end in
/// `offsets` lies above the lower bound doubles its weight (its log-scale key grows by
/// ln 2), so that the buffers that stuck out of the last plan are placed earlier next time.
void raise_buffers_above(const plan_problem& p, std::span<const std::uint64_t> offsets,
                         std::vector<double>& key);

/// Blocks of 2^k ranges carved from chunks (4 KiB at first, doubling to 1 MiB, or one block
/// if larger), with a free list for each k: a block given back goes to the next take of its
/// size. Chunks are freed only with the pool, all at once. A moved-from pool is empty.
class range_blocks {
 public:
  using range = std::pair<std::uint64_t, std::uint64_t>;  // an occupancy_index's [offset, end)
  range_blocks() = default;
  range_blocks(range_blocks&& other) noexcept { *this = std::move(other); }
  range_blocks& operator=(range_blocks&& other) noexcept;
  range* take(unsigned log_capacity);
  void give(range* block, unsigned log_capacity) noexcept;
  /// Ranges carved from chunks so far (not counting blocks taken again from a free list).
  std::size_t carved() const noexcept { return carved_; }

 private:
  std::vector<std::unique_ptr<range[]>> chunks_;
  range* next_ = nullptr;  // the unused rest of the last chunk
  range* end_ = nullptr;  // also the end of the last chunk, whose size sets the next one's
  std::size_t carved_ = 0;
  std::array<range*, 33> free_{};  // by log2 of the size (up to 2^32); linked through their first range
};

/// Byte ranges taken by placed buffers, indexed by time, to find the ranges taken by buffers
/// whose span meets a query span [lo, hi). Such a buffer is either alive in section lo or
/// starts in (lo, hi). Two segment trees over sections, each node holding a merged set of
/// ranges (sorted, disjoint; touching ranges fuse): `alive` gets a buffer's range at the
/// O(log S) nodes that cover its span, and is read on the path from lo's leaf up (a stabbing
/// query); `started` gets it on the path from its first section's leaf up, and is read at
/// the nodes that cover [lo + 1, hi). So a buffer is written to about log S + levels sets and
/// a query reads as many, all of them true conflicts, and every conflicting buffer's range is
/// covered by what is reported.
///
/// Memory: each set lives in a block of a range_blocks pool (above), given back a chunk at a
/// time: at 10^6 buffers an index holds millions of sets, and freeing each on its own took
/// half a second, past the planner's deadline.
class occupancy_index {
 public:
  using range = range_blocks::range;  // [offset, end)
  /// `longest`: no span inserted or queried is longer (levels above it stay empty and unread).
  occupancy_index(std::uint32_t sections, std::uint32_t longest);
  void clear();
  void insert(std::uint32_t lo, std::uint32_t hi, std::uint64_t offset, std::uint64_t end);
  /// Fills `out` with ranges sorted by offset (possibly overlapping) whose union is the union
  /// of the ranges of placed buffers alive in some section of [lo, hi).
  void collect(std::uint32_t lo, std::uint32_t hi, std::vector<range>& out);
  /// The lowest offset at or above `from` where `bytes` meet no placed range alive in
  /// [lo, hi): the first such gap of the union that collect() would give, found by merging
  /// the sets lazily from the bottom and stopping there.
  std::uint64_t first_fit(std::uint32_t lo, std::uint32_t hi, std::uint64_t bytes,
                          std::uint64_t from = 0);

 private:
  // Sorted, disjoint ranges in a block of 2^log_capacity ranges (none while items is null).
  struct range_set {
    range* items = nullptr;
    std::uint32_t count = 0;  // at most one range per buffer, and buffer indexes are 32-bit
    std::uint8_t log_capacity = 0;
    std::size_t capacity() const noexcept { return items == nullptr ? 0 : std::size_t{1} << log_capacity; }
    bool empty() const noexcept { return count == 0; }
    const range* begin() const noexcept { return items; }
    const range* end() const noexcept { return items + count; }
  };
  void add(range_set& set, std::uint64_t offset, std::uint64_t end);
  // Calls visit(set) for each set a query of [lo, hi) reads.
  template <class Visit>
  void for_each_set(std::uint32_t lo, std::uint32_t hi, Visit&& visit) const;
  std::size_t leaves_;
  std::size_t levels_;  // levels that can hold a range: spans of at most `longest` sections
  std::vector<range_set> alive_;    // at the nodes that cover a buffer's span
  std::vector<range_set> started_;  // on the path up from a buffer's first section
  range_blocks blocks_;  // the sets' memory
  std::vector<std::size_t> runs_;
  std::vector<range> scratch_;
  struct cursor {
    std::uint64_t offset;  // next->first
    const range* next;
    const range* end;
  };
  std::vector<cursor> cursors_;
};

enum class fit { best, first };

using clock = std::chrono::steady_clock;

/// When a placement or a search must end: at `at` (clock::time_point::max(): never) or as
/// soon as `*stop` or `*enough` is true (null: never), whichever comes first. `stop` is the
/// caller's; `enough` says that no search is needed any more (another thread has proven a
/// plan optimal). A time point converts to one without flags.
struct deadline_or_stop {
  clock::time_point at = clock::time_point::max();
  const std::atomic<bool>* stop = nullptr;
  const std::atomic<bool>* enough = nullptr;
  deadline_or_stop(clock::time_point when = clock::time_point::max(),  // NOLINT: implicit on purpose
                   const std::atomic<bool>* flag = nullptr, const std::atomic<bool>* enough_flag = nullptr) noexcept
      : at(when), stop(flag), enough(enough_flag) {}
  bool stop_requested() const noexcept { return stop != nullptr && stop->load(std::memory_order_relaxed); }
  bool passed() const noexcept {
    return stop_requested() || (enough != nullptr && enough->load(std::memory_order_relaxed)) ||
           (at != clock::time_point::max() && clock::now() >= at);
  }
};

/// Classic greedy: places buffers in `order`, each in the best-fitting (or lowest) gap
/// among the placed buffers that overlap it in time. Once `deadline` has passed or its stop
/// flag is set (checked every 256 buffers) it stops and returns an empty plan (no offsets),
/// which the search ignores.
candidate_plan place_in_order(const plan_problem& p, std::span<const std::uint32_t> order,
                              fit policy, occupancy_index& index, deadline_or_stop deadline = {});

/// The number of buffers alive across the median start section: place_first_fit_split's
/// cut, where its two threads meet for each of them.
std::size_t buffers_across_median_start(const plan_problem& p);

/// place_in_order(p, order, fit::first, ...) on two threads, with the same result: the time
/// line is cut at the median start; a buffer before the cut only meets buffers before or
/// across it, so each side is placed by its own thread on its own index, and the two meet at
/// every buffer alive across the cut, which is placed in both. Stops past `deadline` as
/// place_in_order does.
candidate_plan place_first_fit_split(const plan_problem& p, std::span<const std::uint32_t> order,
                                     deadline_or_stop deadline = {});

/// Skyline greedy: repeatedly places, at its lowest feasible offset, the buffer whose lowest
/// feasible offset is smallest; ties go to the highest `priority`. Stops at `deadline` as
/// place_in_order does, or once `*stop` is set (checked as often).
candidate_plan place_skyline(const plan_problem& p, std::span<const double> priority,
                             deadline_or_stop deadline = {}, const std::atomic<bool>* stop = nullptr);

/// Runs skyline(i) for every i < `skylines` on `threads` threads (the calling thread one
/// of them), each thread taking the next skyline not yet started, until one returns false
/// (the skylines after it need not run). A thread that finds no skyline left to start runs
/// lane(l) for the next l < `lanes` not yet taken, at once: it does not wait for skylines
/// still running on other threads. Returns when every thread has ended.
template <class Skyline, class Lane>
void skylines_then_lanes(std::size_t threads, std::size_t skylines, const Skyline& skyline,
                         std::size_t lanes, const Lane& lane) {
  std::atomic<std::size_t> next_skyline{0};
  std::atomic<std::size_t> next_lane{0};
  auto work = [&] {
    prepare_thread_for_exceptions();
    for (std::size_t i; (i = next_skyline.fetch_add(1)) < skylines;) {
      if (!skyline(i)) {
        next_skyline.store(skylines);
        break;
      }
    }
    if (const std::size_t l = next_lane.fetch_add(1); l < lanes) lane(l);
  };
  std::vector<std::jthread> pool;
  pool.reserve(threads);
  for (std::size_t t = 1; t < threads; ++t) pool.push_back(start_thread(work));
  work();
}

/// Whether a plan of `arena` bytes offered from `slot` replaces the best plan so far
/// (`best_arena`, offered from `best_slot`; `has_best` false before the first plan). A
/// smaller arena always does. Skylines run in parallel and offer in whatever order they end:
/// `slot` is a skyline's place in their fixed order, -1 for every other phase, and of equal
/// arenas the skyline earlier in that order replaces a later one, while a plan of an earlier
/// phase is never replaced by an equal one. So the plan kept does not depend on the order in
/// which the skylines end.
inline bool replaces_best(bool has_best, std::uint64_t best_arena, int best_slot,
                          std::uint64_t arena, int slot) noexcept {
  if (!has_best || arena < best_arena) return true;
  return slot >= 0 && best_slot > slot && arena == best_arena;
}

/// Whether a placement may start at `now` before `deadline` (clock::time_point::max() for
/// none). A placement begins with a sort it cannot interrupt, about as long as the first plan
/// took (`first_cost`), and its index costs as much to release: it starts only when twice
/// that is left, and, once decreasing size first fit has run (`placement_cost` its time, zero
/// before), when at least that long is left (every other placement costs as much or more on
/// one thread), so that none starts that could not end in time.
inline bool worth_starting(clock::time_point now, clock::time_point deadline,
                           clock::duration first_cost, clock::duration placement_cost) noexcept {
  if (deadline == clock::time_point::max()) return true;
  return now + 2 * first_cost < deadline && now + placement_cost < deadline;
}

/// Static data of the canonical search: members of each section (CSR), their total bytes,
/// and for each buffer the buffers whose lifetimes overlap it (CSR).
struct search_graph {
  std::vector<std::uint32_t> section_begin;
  std::vector<std::uint32_t> section_members;
  std::vector<std::uint64_t> section_total;
  std::vector<std::uint32_t> overlap_begin;
  std::vector<std::uint32_t> overlaps;
};
search_graph make_search_graph(const plan_problem& p);
/// Number of pairs of buffers whose lifetimes overlap, in O(n log n).
std::uint64_t overlap_pairs(const plan_problem& p);

/// Static orders of buffers that could take the same offset in the canonical search
/// (MiniMalloc's default preorders): by decreasing (lifetime length, area, section total),
/// (section total, area, length) or (section total, length, area). The section total of a
/// buffer is the largest sum of unplaced sizes in one section of its lifetime, taken when
/// its part of the problem starts.
enum class preorder { length_area_total, total_area_length, total_length_area };

/// Depth-first search over canonical solutions at a fixed capacity. Returns true and fills `offsets` when a
/// plan with arena <= capacity is found. `stopped` tells whether it gave up at `deadline`
/// (its time or its stop flag, checked every 64 nodes) or after `node_limit` nodes (otherwise
/// a false result means this search space holds no plan at that capacity).
bool canonical_search(const plan_problem& p, const search_graph& g, std::uint64_t capacity,
                      preorder heuristic, deadline_or_stop deadline,
                      std::uint64_t node_limit, std::vector<std::uint64_t>& offsets,
                      bool& stopped);

}  // namespace tensormem::core::detail
