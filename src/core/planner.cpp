// The planner: greedy phase, then search, keeping the smallest arena.

#include "tensormem/core/planner.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <vector>

#include "planner_detail.hpp"
#include "tensormem/core/align.hpp"
#include "tensormem/core/tlsf_allocator.hpp"
#include "tensormem/core/replay.hpp"
#include "tensormem/core/detail/thread_start.hpp"

namespace tensormem::core {

namespace {

using detail::candidate_plan;
using detail::clock;
using detail::plan_problem;

double seconds_since(clock::time_point t) {
  return std::chrono::duration<double>(clock::now() - t).count();
}

struct order_key {
  const char* name;
  double (*key)(const plan_problem&, std::uint32_t);
};

constexpr order_key order_keys[] = {
    {"size", [](const plan_problem& p, std::uint32_t i) { return static_cast<double>(p.bytes[i]); }},
    {"length", [](const plan_problem& p, std::uint32_t i) { return static_cast<double>(p.length[i]); }},
    {"area",
     [](const plan_problem& p, std::uint32_t i) {
       return static_cast<double>(p.bytes[i]) * static_cast<double>(p.length[i]);
     }},
};

enum class tie_break { size_then_length, start };

/// Decreasing key; ties by decreasing size, then decreasing length (or, with
/// tie_break::start, increasing start: among buffers of one size, first fit in order of start
/// is the optimal interval colouring), then index.
std::vector<std::uint32_t> order_by(const plan_problem& p, const std::vector<double>& key,
                                    tie_break ties = tie_break::size_then_length) {
  std::vector<std::uint32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0U);
  std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
    if (key[a] != key[b]) return key[a] > key[b];
    if (p.bytes[a] != p.bytes[b]) return p.bytes[a] > p.bytes[b];
    if (ties == tie_break::start) {
      if (p.lo[a] != p.lo[b]) return p.lo[a] < p.lo[b];
    } else if (p.length[a] != p.length[b]) {
      return p.length[a] > p.length[b];
    }
    return a < b;
  });
  return order;
}

std::vector<double> keys_of(const plan_problem& p, const order_key& k) {
  std::vector<double> key(p.size());
  for (std::uint32_t i = 0; i < p.size(); ++i) key[i] = k.key(p, i);
  return key;
}

class planner_run {
 public:
  // `start`: when plan() was called; the time limit counts from there.
  planner_run(const plan_problem& p, const plan_options& o, clock::time_point start)
      : p_(p), o_(o), start_(start), deadline_(deadline_after(start_, o.time_limit_seconds)),
        rng_(o.seed), setup_cost_(clock::now() - start) {}

  // A limit too long for the clock (about 292 years of nanoseconds) means no limit.
  static clock::time_point deadline_after(clock::time_point start, double seconds) {
    const double room = std::chrono::duration<double>(clock::time_point::max() - start).count();
    if (seconds >= room) return clock::time_point::max();
    return start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(seconds));
  }

  // The first plan: the buffers replayed in time order (the problem's sorted events) through
  // the O(1) online allocator, O(n) after that sort and kept whatever the time limit; then,
  // within the deadline, first fit in the contention-weighted and the decreasing-size
  // orders (usually much better). The O(1) allocator places like exact best fit on the
  // public traces at a third of its cost.
  void first_plan() {
    const auto t0 = clock::now();
    tlsf_allocator online(growing, o_.alignment);
    std::vector<allocation> handles(p_.size());
    candidate_plan c;
    c.offsets.resize(p_.size());
    // The replay reads and writes by buffer index in time order, a cache miss per event on a
    // large trace: each event's entries are fetched a few events ahead.
    constexpr std::size_t ahead = 16;
    for (std::size_t k = 0; k < p_.events.size(); ++k) {
      if (k + ahead < p_.events.size()) {
        const std::uint32_t later = p_.events[k + ahead];
        const std::uint32_t j = later & ~plan_problem::start_event;
        if ((later & plan_problem::start_event) != 0) {
          __builtin_prefetch(&p_.bytes[j]);
          __builtin_prefetch(&c.offsets[j], 1);
        }
        __builtin_prefetch(&handles[j], 1);
      }
      const std::uint32_t e = p_.events[k];
      const std::uint32_t i = e & ~plan_problem::start_event;
      if ((e & plan_problem::start_event) != 0) {
        handles[i] = *online.allocate(p_.bytes[i]);  // growing: never empty
        c.offsets[i] = handles[i].offset;
      } else {
        online.deallocate(handles[i]);
      }
    }
    c.arena = online.peak();
    offer(std::move(c), "online O(1) allocator");
    // The problem's set-up (one sort of the events) costs about as much again.
    first_cost_ = clock::now() - t0 + setup_cost_;
    // Sorts and the release of the placement indexes cannot be interrupted: later phases aim
    // at a deadline earlier by half the first plan's cost (negligible on small inputs), and
    // by what the caller reserved for its own work after the plan.
    if (deadline_ != clock::time_point::max()) {
      using seconds = std::chrono::duration<double>;
      const double early = seconds(first_cost_).count() * (0.5 + o_.reserve_first_plan_costs);
      deadline_ = early < seconds(deadline_ - start_).count()
                      ? deadline_ - std::chrono::duration_cast<clock::duration>(seconds(early))
                      : start_;
    }
    // Then first fit in two orders: decreasing size weighted by contention (usually best on
    // large inputs: the buffers that meet the busiest sections are packed first), then the
    // classic decreasing size, or, where few buffers are alive across the median start (the
    // split greedy pays), the first contention-guided round instead. With two threads, each
    // pass is split across both there, and elsewhere the two passes run at once.
    if (done() || !worth_starting()) return;
    const char* names[2] = {"greedy size x contention^16 (equal keys by start) first-fit",
                            "greedy size (equal sizes by start) first-fit"};
    auto order_of = [&](std::size_t which) {
      return order_by(p_, which == 0 ? contention_key() : keys_of(p_, order_keys[0]), tie_break::start);
    };
    const auto t1 = clock::now();
    if (threads() >= 2 && !split_pays()) {
      contention_key();  // computed once, before the threads share it
      std::array<candidate_plan, 2> plans;
      auto work = [&](std::size_t which, std::size_t) {
        detail::occupancy_index index(p_.sections, p_.longest);
        plans[which] = detail::place_in_order(p_, order_of(which), detail::fit::first, index, limit());
      };
      on_threads(2, work);
      placement_cost_ = clock::now() - t1;
      start_guided_rounds(plans[0]);
      for (std::size_t which = 0; which < 2; ++which) offer(std::move(plans[which]), names[which]);
      return;
    }
    candidate_plan contention = first_fit(order_of(0));
    placement_cost_ = clock::now() - t1;
    start_guided_rounds(contention);
    offer(std::move(contention), names[0]);
    if (done() || !worth_starting()) return;
    if (!split_pays()) {
      offer(first_fit(order_of(1)), names[1]);
      return;
    }
    // Inputs large and spread in time (few buffers alive across the cut), where (synthetic
    // family, 10^5 and 10^6 buffers) decreasing size never beat the contention order: the
    // first contention-guided round instead. Decreasing size still runs among the classic
    // orders. On one thread or two, the same passes in the same order.
    guided_round();
  }

  // The contention-guided rounds start from the contention order's plan: its buffers that
  // ended above the lower bound are raised once (an empty plan, stopped by the deadline,
  // raises none).
  void start_guided_rounds(const candidate_plan& contention) {
    guided_ = contention_key();
    if (!contention.offsets.empty()) detail::raise_buffers_above(p_, contention.offsets, guided_);
  }

  std::vector<std::uint32_t> guided_order() const { return order_by(p_, guided_, tie_break::start); }

  // One guided round by first fit (split across the threads where that pays), offered.
  // With `index`, first fit on this thread alone in that index (kept across rounds).
  void guided_round(detail::occupancy_index* index = nullptr) {
    candidate_plan c = index != nullptr
                           ? detail::place_in_order(p_, guided_order(), detail::fit::first, *index, limit())
                           : first_fit(guided_order());
    std::string name = end_guided_round(c);
    offer(std::move(c), std::move(name));
  }

  // Guided rounds, each split across the threads where that pays, until the bound or the
  // deadline (nothing else runs meanwhile).
  void guided_rounds_to_the_end() {
    while (!done() && worth_starting()) {
      guided_round();
      report("perturbed greedy");
    }
  }

  // After a guided round: raises the buffers that stuck out of its plan for the next round;
  // returns the round's name. (Only one thread runs guided rounds.)
  std::string end_guided_round(const candidate_plan& c) {
    if (!c.offsets.empty()) detail::raise_buffers_above(p_, c.offsets, guided_);
    return "contention-guided greedy (round " + std::to_string(++guided_rounds_) + ")";
  }

  // Whether first fit split across two threads pays: it waits at a barrier for every buffer
  // alive across the cut, and with more than 1 % of them (IOPDDL traces: 4-13 %) it was 2-4
  // times slower than one thread; with 0.5 % (the synthetic family) 1.6 times faster.
  bool split_pays() {
    if (!split_pays_) {
      split_pays_ = p_.size() >= split_from && detail::buffers_across_median_start(p_) * 100 < p_.size();
    }
    return *split_pays_;
  }

  // detail::contention_keys, computed at first use (there is a lower bound above zero once
  // the first plan is not done).
  const std::vector<double>& contention_key() {
    if (contention_key_.empty()) contention_key_ = detail::contention_keys(p_);
    return contention_key_;
  }

  // First fit in `order`, split over two threads where that pays (same offsets).
  candidate_plan first_fit(const std::vector<std::uint32_t>& order) {
    if (threads() >= 2 && split_pays()) return detail::place_first_fit_split(p_, order, limit());
    detail::occupancy_index index(p_.sections, p_.longest);
    return detail::place_in_order(p_, order, detail::fit::first, index, limit());
  }

  // Below this many buffers the second thread of the split greedy does not pay for itself.
  static constexpr std::size_t split_from = 20'000;

  std::size_t threads() const {
    return o_.threads != 0 ? o_.threads : std::max(1U, std::thread::hardware_concurrency());
  }

  // See detail::worth_starting. Nothing starts once a thread has failed or a stop is requested.
  bool worth_starting() const {
    return !halted() && detail::worth_starting(clock::now(), deadline_, first_cost_, placement_cost_);
  }

  // The deadline of placements and searches, with the caller's stop flag.
  detail::deadline_or_stop limit() const { return {deadline_, o_.stop}; }

  // Whether the caller asked the planning to stop (plan_options::stop).
  bool stop_requested() const { return limit().stop_requested(); }

  // Runs work(t, count) for t in [0, count): t = 0 on the calling thread, the others on their
  // own; returns when all have ended. An exception in any of them is kept (see guarded).
  template <class Work>
  void on_threads(std::size_t count, Work& work) {
    auto safe = [&](std::size_t t, std::size_t n) {
      detail::prepare_thread_for_exceptions();
      guarded([&] { work(t, n); });
    };
    std::vector<std::jthread> pool;
    pool.reserve(count);
    for (std::size_t t = 1; t < count; ++t) pool.push_back(detail::start_thread(safe, t, count));
    safe(0, count);
  }

  // Runs f; an exception it throws (the progress callback's, std::bad_alloc) is kept, the
  // first one only, and from then on no phase starts on any thread: plan() rethrows it once
  // every thread has ended. True when f returned.
  template <class F>
  bool guarded(F&& f) noexcept {
    try {
      f();
      return true;
    } catch (...) {
      const std::lock_guard lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true);
      return false;
    }
  }

  // Rethrows the first exception a planner thread threw, if any.
  void rethrow_failure() const {
    if (failed_.load()) std::rethrow_exception(error_);
  }

  // The six other classic variants, spread over up to `threads` threads. Each variant writes its
  // own slot; the winner is chosen afterwards in a fixed order, so the result does not
  // depend on scheduling. They run before any skyline: each costs O(n log n + P log P), while
  // a skyline's re-checks grow with the overlap and can take the whole limit.
  void greedy() { greedy_on(threads()); }

  // (Returns nothing: a copy of best_ here would race with guided rounds offering beside it.)
  void greedy_on(std::size_t thread_count) {
    struct variant {
      const order_key* key;
      detail::fit policy;
      tie_break ties = tie_break::size_then_length;
      candidate_plan result = {};
    };
    // Most often best first, so that a short limit still sees them: first fit before best
    // fit (which also costs more: it needs the whole union of conflicting ranges).
    // Decreasing size first fit with equal sizes by start was placed with the first plan.
    std::vector<variant> variants;
    for (const detail::fit policy : {detail::fit::first, detail::fit::best}) {
      for (const order_key& k : order_keys) variants.push_back({&k, policy});
    }
    auto work = [&](std::size_t first, std::size_t step) {
      if (!worth_starting()) return;  // the index alone is O(sections) to build and free
      detail::occupancy_index index(p_.sections, p_.longest);
      for (std::size_t v = first; v < variants.size(); v += step) {
        if (!worth_starting() || done()) return;  // (guided rounds beside them may reach the bound)
        const auto order = order_by(p_, keys_of(p_, *variants[v].key), variants[v].ties);
        variants[v].result = detail::place_in_order(p_, order, variants[v].policy, index, limit());
      }
    };
    on_threads(std::min(thread_count, variants.size()), work);
    for (variant& v : variants) {
      offer(std::move(v.result), std::string("greedy ") + v.key->name +
                                     (v.ties == tie_break::start ? " (equal sizes by start)" : "") +
                                     (v.policy == detail::fit::best ? " best-fit" : " first-fit"));
    }
  }

  // What the lanes of perturbation rounds share: the first position that reached the
  // bound, each lane's round in progress, and whether a round before it reached the bound
  // (a skyline then gives up early: it could not be kept).
  struct rounds_state {
    static constexpr std::uint64_t none = std::numeric_limits<std::uint64_t>::max();
    std::atomic<std::uint64_t> stop_at{none};
    std::array<std::atomic<std::uint64_t>, 2> current = {};
    std::array<std::atomic<bool>, 2> beaten = {};

    // A plan before every round reached the bound.
    void beat_all() {
      stop_at.store(0);
      for (auto& b : beaten) b.store(true);
    }
  };

  // One flag per skyline: stop it (a plan before it in their order reached the bound).
  using skyline_flags = std::array<std::atomic<bool>, 3>;

  void search() {
    if (done() || !worth_starting()) return;
    // Where no canonical search follows (more than 4,096 sections) and the perturbation
    // rounds run on two lanes, a thread with no skyline left to start goes on to the
    // rounds at once instead of waiting for the skylines still running (IOPDDL S_1: the
    // skyline by length runs about five times as long as the two others together).
    const bool overlap = p_.sections > canonical_sections && threads() >= 2 && !split_pays();
    if (overlap) {
      if (guided_.empty()) start_guided_rounds({});
      skyline_flags stop = {};
      rounds_state rounds;
      skylines(threads(), stop, 2, &rounds);
      return;
    }
    skyline_flags stop = {};
    skylines_and_canonical(threads(), stop);
    if (!done()) perturbation_phase();
  }

  // The skylines in their fixed order, then the canonical search where it applies.
  void skylines_and_canonical(std::size_t thread_count, skyline_flags& stop) {
    skylines(thread_count, stop, 0, nullptr);
    if (!done() && p_.sections <= canonical_sections) canonical_phase(thread_count);
  }

  // Skyline orders first: often far better than the classic orders. By length last: ties
  // to the longest buffers make it re-check several times more often (IOPDDL T: 141 M
  // re-checks, 20 s, against 14-15 M, 2 s, by size or area), and area is as good or
  // better on the traces measured.
  // On up to `thread_count` threads, each plan offered as soon as it is complete; of equal
  // arenas the earlier in this order is kept, so the plan does not depend on scheduling
  // (unless the deadline stops one). A skyline stops early once one before it in this
  // order has reached the lower bound (it could not be kept), or once its flag in `stop` is
  // set. With `lanes` (2, and `rounds`), each thread goes on to a lane of perturbation
  // rounds as soon as it finds no skyline left to start.
  void skylines(std::size_t thread_count, skyline_flags& stop, std::size_t lanes, rounds_state* rounds) {
    if (done() || !worth_starting()) return;
    const std::array<const order_key*, std::size_t{skyline_slots}> keys = {&order_keys[0], &order_keys[2], &order_keys[1]};
    auto skyline = [&](std::size_t i) {
      if (stop[i].load() || !worth_starting()) return false;  // so are the skylines after it
      return guarded([&] {
        candidate_plan c = detail::place_skyline(p_, keys_of(p_, *keys[i]), limit(), &stop[i]);
        if (!c.offsets.empty() && c.arena <= p_.lower_bound) {
          for (std::size_t j = i + 1; j < keys.size(); ++j) stop[j].store(true);
          if (rounds != nullptr) rounds->beat_all();  // every round comes after the skylines
        }
        offer(std::move(c), std::string("skyline ") + keys[i]->name, static_cast<int>(i));
      });
    };
    auto lane = [&](std::size_t l) { guarded([&] { perturbation_rounds(l, 2, *rounds); }); };
    detail::skylines_then_lanes(std::min(thread_count, keys.size()), keys.size(), skyline, lanes, lane);
  }

  // Whether the classic variants and the skylines run on one thread while the other goes
  // on with the contention-guided rounds (greedy_beside_guided_rounds).
  bool guided_rounds_beside_greedy() { return threads() >= 2 && split_pays(); }

  // Where the split greedy pays (large inputs spread in time) and two threads run: the
  // guided rounds beat every classic order and every skyline there (synthetic family), and
  // on a slow machine those took most of a 10 s limit before the second round. So one
  // thread runs the six classic variants, then the skylines (and the canonical search where
  // it applies), one after the other, while the calling thread goes on with the guided
  // rounds, each on one thread; once the other thread has ended, each round is split across
  // both as before. The guided rounds give the same plans either way. Returns the seconds
  // from the start to the end of the classic variants.
  double greedy_beside_guided_rounds() {
    std::atomic<bool> others_ended{false};
    skyline_flags stop = {};
    double greedy_seconds = 0;
    {
      const std::jthread others = detail::start_thread([&] {
        detail::prepare_thread_for_exceptions();
        guarded([&] {
          greedy_on(1);
          greedy_seconds = seconds_since(start_);
          skylines_and_canonical(1, stop);
        });
        others_ended.store(true);
      });
      guarded([&] {
        std::optional<detail::occupancy_index> index;
        while (!others_ended.load() && !done() && worth_starting()) {
          if (!index) index.emplace(p_.sections, p_.longest);
          guided_round(&*index);
          const std::lock_guard lock(offer_mutex_);
          report("perturbed greedy");
        }
      });
      if (done() || failed_.load()) {
        for (auto& flag : stop) flag.store(true);  // a skyline running could not be kept, or is not wanted
      }
    }
    guided_rounds_to_the_end();
    return greedy_seconds;
  }

  const candidate_plan& best() const { return best_; }
  double first_plan_seconds() const { return first_plan_seconds_; }
  double best_plan_seconds() const { return best_plan_seconds_; }

  // Whether best_ is proven optimal: at the lower bound, or at the floor the canonical search
  // has raised (see exclude_below). Read from any thread (set under the offer lock).
  bool done() const { return optimal_.load(); }

 private:
  // A thread failed or the caller asked to stop: nothing more is tried.
  bool halted() const { return failed_.load() || stop_requested(); }
  bool time_left() const { return !halted() && clock::now() < deadline_; }

  // Keeps `c` if it is smaller than the best plan so far, or an equal skyline earlier in
  // their fixed order (`slot`; see detail::replaces_best). Called from several threads while
  // the skylines run.
  void offer(candidate_plan c, std::string strategy, int slot = -1) {
    const std::lock_guard lock(offer_mutex_);
    // The first plan is always kept: an arena of 2^64 - 1 bytes is a real plan too.
    if (c.offsets.empty()) return;
    if (detail::replaces_best(!best_.offsets.empty(), best_.arena, best_slot_, c.arena, slot)) {
      if (best_.offsets.empty()) first_plan_seconds_ = seconds_since(start_);
      best_plan_seconds_ = seconds_since(start_);
      best_ = std::move(c);
      best_.strategy = std::move(strategy);
      best_slot_ = slot;
      if (best_.arena <= floor_) optimal_.store(true);
      report("search");
    }
  }

  // Calls the progress callback (under offer_mutex_ wherever other threads may offer). Once it
  // has thrown, it is not called again: the exception ends the planning (see guarded).
  // At most ten a second, but any that reaches the bound; a best arena held back by that limit
  // is reported when the planning ends (report_held_back).
  void report(const char* phase) {
    if (!o_.progress || failed_.load()) return;
    const double now = seconds_since(start_);
    if (now - last_report_ < 0.1 && best_.arena != p_.lower_bound) {
      if (best_.arena != reported_arena_) held_back_ = phase;
      return;
    }
    last_report_ = now;
    reported_arena_ = best_.arena;
    held_back_ = nullptr;
    guarded([&] { o_.progress({now, best_.arena, p_.lower_bound, phase}); });
  }

 public:
  // Once every planner thread has ended: the report of a best arena that the rate limit held
  // back, so that the last report gives the plan returned.
  void report_held_back() {
    const char* phase = std::exchange(held_back_, nullptr);
    if (phase == nullptr || !o_.progress || failed_.load()) return;
    reported_arena_ = best_.arena;
    guarded([&] { o_.progress({seconds_since(start_), best_.arena, p_.lower_bound, phase}); });
  }

 private:

  // Canonical DFS at a target capacity: first the lower bound itself, then halfway between
  // the lowest capacity not yet given up and the best arena. At each target, preorder
  // heuristics take turns with node budgets that double each round. On one thread the lower
  // bound gets half the time left and the targets above it the rest; with two threads
  // (`thread_count`), one searches the lower bound until the deadline while the other
  // bisects the capacities above it (minimalloc_A at T = 1: 1.036 on one thread, where the
  // bound needs about 0.75 s). Whichever proves a plan optimal stops the other.
  void canonical_phase(std::size_t thread_count) {
    if (detail::overlap_pairs(p_) > 20'000'000 || !time_left()) return;
    const detail::search_graph g = detail::make_search_graph(p_);
    if (thread_count < 2 || best_arena() <= p_.lower_bound + 1) {
      canonical_targets(g, p_.lower_bound, 0.5);
      return;
    }
    auto work = [&](std::size_t lane, std::size_t) {
      if (lane == 0) canonical_target(g, p_.lower_bound, deadline_);
      else canonical_targets(g, p_.lower_bound + 1, 0.5);
    };
    on_threads(2, work);
  }

  // Targets from `low` until the best arena, the lower bound first if `low` is it, each
  // given `share` of the time left.
  void canonical_targets(const detail::search_graph& g, std::uint64_t low, double share) {
    while (time_left() && !done() && low < best_arena()) {
      const std::uint64_t best = best_arena();
      const std::uint64_t target = low == p_.lower_bound ? low : low + (best - 1 - low) / 2;
      const double left = std::chrono::duration<double>(deadline_ - clock::now()).count();
      if (!canonical_target(g, target, clock::now() + std::chrono::duration_cast<clock::duration>(
                                                          std::chrono::duration<double>(left * share)))) {
        low = target + 1;
      }
    }
  }

  // Searches for a plan within `target` bytes until `slice_end`; true if one was found
  // (and offered). A target whose trees were searched whole without a plan is excluded.
  bool canonical_target(const detail::search_graph& g, std::uint64_t target, clock::time_point slice_end) {
    bool settled = false;  // a heuristic searched its whole tree without a plan
    for (std::uint64_t limit = 2 * p_.size(); !settled && !done() && time_left() && clock::now() < slice_end;
         limit *= 2) {
      for (const detail::preorder heuristic :
           {detail::preorder::length_area_total, detail::preorder::total_area_length,
            detail::preorder::total_length_area}) {
        std::vector<std::uint64_t> offsets;
        bool stopped = false;
        if (detail::canonical_search(p_, g, target, heuristic, {slice_end, o_.stop, &optimal_}, limit, offsets,
                                     stopped)) {
          candidate_plan c;
          c.arena = detail::arena_of(p_, offsets);
          c.offsets = std::move(offsets);
          offer(std::move(c), "canonical search");
          return true;
        }
        if (!stopped) {
          settled = true;
          break;
        }
        const std::lock_guard lock(offer_mutex_);  // guided rounds may run beside it
        report("canonical search");
      }
    }
    if (settled) exclude_below(target + 1);
    return false;
  }

  // The best arena so far (offered from several threads).
  std::uint64_t best_arena() {
    const std::lock_guard lock(offer_mutex_);
    return best_.arena;
  }

  // A canonical search settled `least - 1` without a plan: every plan can be pushed down
  // until each buffer sits at 0 or on another (a canonical plan) without growing, so no plan
  // has an arena below `least`.
  void exclude_below(std::uint64_t least) {
    const std::lock_guard lock(offer_mutex_);
    floor_ = std::max(floor_, least);
    if (best_.arena <= floor_) optimal_.store(true);
  }

  // Iterated greedy. Where the split greedy pays (large inputs spread in time), guided
  // rounds only, one after the other, each split across the threads. Elsewhere two kinds
  // of rounds take turns: skylines in orders whose keys (size,
  // area, length) are multiplied by random log-normal factors, and contention-guided first
  // fit ("squeaky wheel", detail::raise_buffers_above; they go on from the contention
  // order's plan and any guided round before). Round `position` is a skyline when even, a
  // guided round when odd; with two threads, one runs the skylines, the other the
  // guided rounds (where no canonical search comes first, each starts as soon as its thread
  // has no plain skyline left: see search()). Each kind's rounds depend only on its earlier ones and on the seed, a
  // round at the lower bound stops the rounds after it, and of equal arenas the earlier
  // position is kept: a search that reaches the bound returns the same plan every time, on
  // one thread or two.
  void perturbation_phase() {
    if (!worth_starting()) return;
    if (guided_.empty()) start_guided_rounds({});
    if (split_pays()) {
      // There the perturbed skylines cost two or three rounds each and never came near them
      // (synthetic family, 10^5 buffers: 1.09 x against 1.02-1.04; traces repeated in time
      // as a series of copies: no better than the plain skylines before them).
      guided_rounds_to_the_end();
      return;
    }
    rounds_state rounds;
    auto work = [&](std::size_t lane, std::size_t lanes) { perturbation_rounds(lane, lanes, rounds); };
    on_threads(std::min<std::size_t>(threads(), 2), work);
  }

  // The rounds at positions lane, lane + lanes, ... (lanes 1 or 2) until one at or past the
  // first that reached the bound, or the deadline.
  void perturbation_rounds(std::size_t lane, std::size_t lanes, rounds_state& rounds) {
    std::lognormal_distribution<double> noise(0.0, 0.15);
    std::optional<detail::occupancy_index> index;  // the guided rounds' when on a lane of their own
    for (std::uint64_t position = lane;; position += lanes) {
      rounds.current[lane].store(position);
      if (position >= rounds.stop_at.load() || !worth_starting()) break;
      const std::uint64_t round = position / 2;
      candidate_plan c;
      std::string name;
      if (position % 2 == 0) {
        const order_key& k = order_keys[round % std::size(order_keys)];
        std::vector<double> key = keys_of(p_, k);
        for (double& v : key) v *= noise(rng_);
        c = detail::place_skyline(p_, key, limit(), &rounds.beaten[lane]);
        name = std::string("perturbed skyline ") + k.name;
      } else {
        if (lanes == 1) {
          c = first_fit(guided_order());
        } else {
          if (!index) index.emplace(p_.sections, p_.longest);
          c = detail::place_in_order(p_, guided_order(), detail::fit::first, *index, limit());
        }
        name = end_guided_round(c);
      }
      if (!c.offsets.empty() && c.arena <= p_.lower_bound) {
        std::uint64_t seen = rounds.stop_at.load();
        while (position < seen && !rounds.stop_at.compare_exchange_weak(seen, position)) {
        }
        for (std::size_t t = 0; t < lanes; ++t) {
          if (rounds.current[t].load() > position) rounds.beaten[t].store(true);
        }
      }
      offer(std::move(c), std::move(name), perturbation_slot(position));
      const std::lock_guard lock(offer_mutex_);
      report("perturbed greedy");
    }
  }

  // The offer slot of a perturbation round: after the skylines' (see detail::replaces_best).
  static int perturbation_slot(std::uint64_t position) {
    constexpr std::uint64_t most = std::numeric_limits<int>::max() - skyline_slots;
    return skyline_slots + static_cast<int>(std::min(position, most));
  }
  static constexpr int skyline_slots = 3;
  // At most this many sections: the canonical search runs after the skylines.
  static constexpr std::uint32_t canonical_sections = 4096;

  const plan_problem& p_;
  const plan_options& o_;
  clock::time_point start_;
  clock::time_point deadline_;
  std::mt19937_64 rng_;
  candidate_plan best_;
  double last_report_ = -1;
  std::uint64_t reported_arena_ = 0;  // the best arena of the last report (0: none yet)
  const char* held_back_ = nullptr;   // the phase of a better arena not yet reported
  double first_plan_seconds_ = 0;
  double best_plan_seconds_ = 0;
  clock::duration setup_cost_{};
  clock::duration first_cost_{};
  clock::duration placement_cost_{};  // the first greedy after the first plan, zero until it has run
  std::vector<double> contention_key_;  // see contention_key()
  std::vector<double> guided_;          // the next guided round's keys (see start_guided_rounds)
  std::uint64_t guided_rounds_ = 0;     // guided rounds run so far
  std::optional<bool> split_pays_;      // see split_pays()
  std::mutex offer_mutex_;
  int best_slot_ = -1;  // the skyline slot of best_, -1 for other phases
  // Every arena below this is excluded: the lower bound, or a capacity the canonical search
  // settled without a plan, plus one (under the offer lock).
  std::uint64_t floor_ = p_.lower_bound;
  std::atomic<bool> optimal_{false};  // best_.arena <= floor_
  std::mutex error_mutex_;
  std::exception_ptr error_;         // the first exception of a planner thread (see guarded)
  std::atomic<bool> failed_{false};  // error_ is set
};

// Refuses a negative or NaN option: invalid_argument naming its value between two parts.
void require_at_least_zero(double value, const char* before, const char* after) {
  if (value >= 0) return;
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  throw std::invalid_argument(std::string(before) + text + after);
}

// The planning itself, from `start` (its time limit counts from there).
plan_result plan_problem_from(const plan_problem& p, const plan_options& options, clock::time_point start) {
  plan_result r;
  planner_run run(p, options, start);
  run.first_plan();
  if (!run.done() && options.search && run.guided_rounds_beside_greedy()) {
    r.greedy_seconds = run.greedy_beside_guided_rounds();
  } else {
    if (!run.done()) run.greedy();
    r.greedy_seconds = seconds_since(start);
    if (options.search && !run.done()) run.search();
  }
  run.report_held_back();
  run.rethrow_failure();
  const candidate_plan& best = run.best();
  r.offsets = best.offsets;
  r.arena_bytes = best.arena;
  r.lower_bound = p.lower_bound;
  r.strategy = best.strategy;
  r.optimal = run.done();
  r.first_plan_seconds = run.first_plan_seconds();
  r.best_plan_seconds = run.best_plan_seconds();
  r.seconds = seconds_since(start);
  r.stopped = options.stop != nullptr && options.stop->load();
  return r;
}

}  // namespace

plan_result plan(std::span<const buffer> buffers, const plan_options& options) {
  if (!is_power_of_two(options.alignment)) {
    throw std::invalid_argument("plan: alignment " + std::to_string(options.alignment) +
                                " is not a power of two");
  }
  require_at_least_zero(options.time_limit_seconds, "plan: time limit ", " s is not a number of seconds >= 0");
  require_at_least_zero(options.reserve_first_plan_costs, "plan: reserve of ", " first-plan costs is not a number >= 0");
  // Every strategy places a buffer at or below the sum of the sizes of the others, so a
  // total that fits in 64 bits keeps every offset and end representable.
  std::uint64_t total = 0;
  for (const buffer& b : buffers) {
    if (b.lower >= b.upper) {
      throw std::invalid_argument("plan: buffer '" + b.id + "' has an empty lifetime [" +
                                  std::to_string(b.lower) + ", " + std::to_string(b.upper) + ")");
    }
    const auto bytes = align_up(b.bytes, options.alignment);
    if (!bytes) {
      throw std::invalid_argument("plan: buffer '" + b.id + "' of " + std::to_string(b.bytes) +
                                  " bytes does not fit in 64 bits once aligned to " +
                                  std::to_string(options.alignment));
    }
    if (*bytes > std::numeric_limits<std::uint64_t>::max() - total) {
      throw std::invalid_argument("plan: the buffer sizes add up to more than 2^64 - 1 bytes "
                                  "(at buffer '" + b.id + "'); plans use 64-bit offsets");
    }
    total += *bytes;
  }
  const auto start = clock::now();
  if (buffers.empty()) {
    plan_result r;
    r.strategy = "empty";
    r.optimal = true;
    return r;
  }
  const plan_problem p = detail::make_problem(buffers, options.alignment);
  try {
    return plan_problem_from(p, options, start);
  } catch (const detail::thread_refused& e) {  // (one thread starts none: not thrown then)
    plan_options alone = options;
    alone.threads = 1;
    plan_result r = plan_problem_from(p, alone, start);
    r.fallback = std::string(e.what()) + "; planned on the calling thread alone";
    return r;
  }
}

plan_result plan(const graph& g, const plan_options& options) {
  const graph_lifetimes life = derive_lifetimes(g, options.alignment);
  return plan(life.buffers, options);
}

}  // namespace tensormem::core
