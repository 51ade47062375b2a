#pragma once
// Static memory planner: buffers with known lifetimes in, offsets in one arena out.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tensormem/core/graph.hpp"
#include "tensormem/core/lifetime.hpp"

namespace tensormem::core {

/// What the planner reports while it searches (called on the planner's thread).
struct plan_progress {
  double seconds = 0;
  std::uint64_t best_arena_bytes = 0;
  std::uint64_t lower_bound = 0;
  const char* phase = "";
};

struct plan_options {
  /// Wall-clock budget of the whole plan. The first plan (an online best-fit replay in time
  /// order, O(n log n)) is always completed; every later phase checks the deadline as it goes
  /// and the best valid plan found by then is returned.
  double time_limit_seconds = 10.0;
  /// Time the caller needs after the plan within the same budget, counted in costs of the
  /// first plan (one sort and one replay of the lifetime events): the phases after the first
  /// plan aim at a deadline earlier by that much. `tensormem plan` validates each plan (one
  /// sort and one sweep of the same events) and reserves 1. Must be a number >= 0.
  double reserve_first_plan_costs = 0.0;
  /// Every size is rounded up to this power of two and every offset is a multiple of it.
  std::uint64_t alignment = 1;
  /// Seed of the randomized search. Given the same seed, the plan is the same whenever the
  /// search ends before the time limit (it reached the lower bound or exhausted its steps).
  std::uint64_t seed = 1;
  /// false: the first plan and the greedy phase only.
  bool search = true;
  /// Threads for the greedy phase, the skylines, the canonical search and the perturbation
  /// rounds; 0 = one per hardware thread. The result does not depend on it, unless the time
  /// limit stops a placement or the canonical search runs: there, on two threads, the bound
  /// and the capacities above it are searched at once, and the plan kept is the one that
  /// reached the bound first (or the best found by the limit).
  unsigned threads = 0;
  /// Optional progress callback, called as the planning goes on, at most about ten times a
  /// second (a plan at the lower bound at once), from one of the planner's threads, never
  /// from two at once. A better plan that this limit held back is reported as the planning
  /// ends: the last call gives the plan returned. An exception it throws ends the planning
  /// (a way to cancel it): no phase starts after it, the callback is not called again, and
  /// plan() rethrows it on the caller's thread once every planner thread has ended (a
  /// placement already running ends first, by the time limit at the latest).
  std::function<void(const plan_progress&)> progress;
  /// Optional stop flag, read and never written by the planner. Once `*stop` is true (set
  /// from any thread, or from a signal handler: a store to a lock-free atomic), the planning
  /// ends as it does at its time limit: no phase starts, a running placement or search stops
  /// within 256 buffers (64 search nodes), and plan() returns the best valid plan found so
  /// far, with plan_result::stopped set. The first plan always completes, as with a time limit
  /// of zero. The flag must outlive the call.
  const std::atomic<bool>* stop = nullptr;
};

struct plan_result {
  std::vector<std::uint64_t> offsets;  ///< one per buffer, in input order
  std::uint64_t arena_bytes = 0;       ///< max over buffers of offset + aligned size
  std::uint64_t lower_bound = 0;       ///< most aligned bytes alive at once
  std::string strategy;                ///< which strategy produced the kept plan
  /// The arena is proven the least any plan can have: it equals the lower bound, or the
  /// canonical search (step 2) searched every smaller capacity's tree without finding a
  /// plan. The planning stops as soon as this holds, before its time limit.
  bool optimal = false;
  double seconds = 0;                  ///< total planning time
  /// From the start to the end of the greedy phase (the classic orders). Where the guided
  /// rounds run beside those orders (two threads, large inputs spread in time), when the
  /// orders ended: rounds may have run, and the returned plan come, before it.
  double greedy_seconds = 0;
  double first_plan_seconds = 0;       ///< when the first complete plan was found
  double best_plan_seconds = 0;        ///< when the returned plan was found
  /// plan_options::stop was set when plan() returned: the planning may have ended before its
  /// time limit, with a plan it would have improved.
  bool stopped = false;
  /// Empty, or why the plan was made on the calling thread alone where more threads were
  /// asked for: the system would not start one (a limit on threads or on the address space),
  /// and the planning started again on one thread, within the same time limit.
  std::string fallback;
  double ratio() const noexcept {
    return lower_bound == 0 ? 1.0
                            : static_cast<double>(arena_bytes) / static_cast<double>(lower_bound);
  }
};

/// The most buffers one plan takes (buffers are numbered in 31 bits).
inline constexpr std::size_t max_plan_buffers = (std::size_t{1} << 31) - 1;
/// About the memory `plan` takes per buffer at scale, in bytes: the peak RSS of `tensormem
/// plan --synthetic N` over N at 10^7 and 3 x 10^7 buffers, the least measured (the search
/// takes more where it runs long: about 490 at 10^6; docs/BENCHMARKS.md). The command line
/// and the Python module refuse, before planning, a plan of more buffers than the process's
/// memory holds at this rate.
inline constexpr std::uint64_t plan_bytes_per_buffer = 160;

/// Places every buffer so that no two buffers whose lifetimes overlap share a byte, in an
/// arena as small as the budget allows. Steps:
///  0. First plan: the buffers replayed in time order through tlsf_allocator (one sort of
///     the lifetime events, then O(1) per event), so that a plan exists early at any scale.
///     The time limit counts from the call, set-up included.
///  1. Greedy phase, within the time limit. First fit in decreasing size weighted by
///     contention (size x (the most bytes alive in one section of the buffer's span / the
///     lower bound)^16), then in decreasing size with equal sizes in order of start (first
///     fit by start is the optimal colouring of equal-size intervals): the two at once on
///     two threads; where under 1 % of the buffers live across the median start, each split
///     across two threads instead (same offsets), and the second is the first
///     contention-guided round (step 2) rather than decreasing size. Then, in parallel, six
///     classic variants: decreasing size, lifetime length and area (size x length), each
///     placed with best fit and with first fit among the gaps left by already placed
///     buffers that overlap in time (the space above the highest counts as a gap). The
///     smallest arena is kept.
///  2. Search phase, until the arena is proven optimal (`plan_result::optimal`) or the time
///     limit. First "skyline" orders: buffers placed in increasing offset order, each time
///     the buffer whose lowest feasible offset is lowest (ties by size, length or area; their
///     cost grows with the overlap, which is why they come after every classic order). Then, for instances
///     of up to a few thousand time sections, a depth-first search over canonical solutions
///     (every buffer sits at offset 0 or on top of another; after MiniMalloc, Moffitt,
///     ASPLOS 2023) at a target capacity, with capacity pruning per time section and
///     randomized restarts: first the lower bound, then halfway between the least capacity
///     not yet given up and the best arena (on one thread the bound gets half the time left;
///     on two, one thread searches the bound until the limit while the other bisects the
///     capacities above it, and whichever proves a plan optimal stops the other); a capacity
///     whose whole tree holds no plan
///     excludes every arena up to it, so the search can prove an arena above the lower bound
///     optimal; then iterated greedy: skylines in perturbed orders beside
///     contention-guided first fit, whose rounds go on from the contention order's plan,
///     each doubling the weight of the buffers that ended above the lower bound. Where the
///     split greedy pays (under 1 % of the buffers across the median start, 20,000 or more),
///     no perturbed skylines: the guided rounds alone, on one thread beside the classic
///     orders and the skylines on the other, then each split across two threads.
/// Greedy phase: O(n log n + P log P) per order, P the number of conflicting pairs. The
/// problem is NP-hard: the result is not guaranteed optimal unless it equals the lower bound.
/// Throws std::invalid_argument for a non-power-of-two alignment, an empty lifetime, a time
/// limit that is negative or NaN, or sizes that add up past 2^64 - 1 (a limit larger than
/// the clock can count means no limit); std::length_error for more than max_plan_buffers
/// buffers; std::bad_alloc without memory, from whichever of its threads ran out, once all
/// have ended; and what the progress callback throws.
plan_result plan(std::span<const buffer> buffers, const plan_options& options = {});

/// Plans the activations, inputs and outputs of a graph (see derive_lifetimes); the
/// offsets follow `derive_lifetimes(g).buffers`.
plan_result plan(const graph& g, const plan_options& options = {});

/// Independent check of a plan by a sweep over time: no two buffers overlap in time and in
/// their byte ranges (sizes rounded up to `alignment`), every offset is a multiple of
/// `alignment`, and every buffer ends within `arena_bytes` (a larger arena than needed is
/// valid). Zero-byte buffers and empty lifetimes (`lower >= upper`) occupy nothing. Returns
/// an empty string when the plan is valid, else what is wrong, naming the buffers. Exact on
/// any input: O(n log n).
std::string validate(std::span<const buffer> buffers, std::span<const std::uint64_t> offsets,
                     std::uint64_t arena_bytes, std::uint64_t alignment = 1);

}  // namespace tensormem::core
