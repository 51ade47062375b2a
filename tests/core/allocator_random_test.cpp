// Randomized operation sequences checked against simple references after every step.
// Seed: TENSORMEM_SEED (default fixed); operations: TENSORMEM_RANDOM_OPS (default 1,000,000).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "tensormem/core/align.hpp"
#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/tlsf_allocator.hpp"

namespace tensormem::core {
namespace {

std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v == nullptr ? fallback : std::strtoull(v, nullptr, 10);
}

// Under sanitizers the default run is a tenth as long (TENSORMEM_RANDOM_OPS still rules).
#ifdef TENSORMEM_SANITIZED
constexpr std::uint64_t default_ops = 100'000;
#else
constexpr std::uint64_t default_ops = 1'000'000;
#endif

/// The LazyAllocator policy written the slow, obvious way: a vector of free blocks scanned
/// linearly.
class naive_best_fit {
 public:
  naive_best_fit(std::uint64_t capacity, std::uint64_t alignment)
      : capacity_(capacity), alignment_(alignment) {}

  std::optional<std::uint64_t> allocate(std::uint64_t bytes) {
    const std::uint64_t need = *align_up(bytes, alignment_);
    std::size_t best = free_.size();
    for (std::size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].second < need) continue;
      if (best == free_.size() || free_[i].second < free_[best].second) best = i;
    }
    std::uint64_t offset = 0;
    if (best != free_.size()) {
      offset = free_[best].first;
      if (free_[best].second == need) {
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
      } else {
        free_[best].first += need;
        free_[best].second -= need;
      }
    } else {
      offset = peak_;
      std::uint64_t tail = 0;
      if (!free_.empty() && free_.back().first + free_.back().second == peak_) {
        offset = free_.back().first;
        tail = free_.back().second;
      }
      if (need - tail > capacity_ - peak_) return std::nullopt;
      if (tail != 0) free_.pop_back();
      peak_ += need - tail;
    }
    return offset;
  }

  void free(std::uint64_t offset, std::uint64_t bytes) {
    free_.emplace_back(offset, *align_up(bytes, alignment_));
    std::sort(free_.begin(), free_.end());
    std::vector<std::pair<std::uint64_t, std::uint64_t>> merged;
    for (const auto& f : free_) {
      if (!merged.empty() && merged.back().first + merged.back().second == f.first) {
        merged.back().second += f.second;
      } else {
        merged.push_back(f);
      }
    }
    free_ = std::move(merged);
  }

  std::uint64_t peak() const { return peak_; }
  std::size_t free_blocks() const { return free_.size(); }

 private:
  std::uint64_t capacity_;
  std::uint64_t alignment_;
  std::uint64_t peak_ = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> free_;  // sorted by offset
};

struct random_config {
  std::uint64_t capacity;
  std::uint64_t alignment;
  std::uint64_t max_bytes;
  std::size_t target_live;
};

/// Runs `ops` random operations (allocations, frees of a random live block, and misuse) on
/// allocator A, checking invariants after every step and non-overlap against an interval map.
/// When `exact` is set, offsets must equal the naive best-fit reference.
template <class A>
void run_random(const random_config& cfg, std::uint64_t seed, std::uint64_t ops, bool exact) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " (set TENSORMEM_SEED to replay)");
  std::mt19937_64 rng(seed);
  A a(cfg.capacity, cfg.alignment);
  naive_best_fit ref(cfg.capacity, cfg.alignment);
  struct live_block {
    allocation handle;
    std::uint64_t asked;
  };
  std::vector<live_block> live;
  std::deque<allocation> freed;  // the handles of the last blocks freed: stale from then on
  std::map<std::uint64_t, std::uint64_t> intervals;  // offset -> aligned bytes
  std::uint64_t used = 0;
  std::uniform_real_distribution<double> log_size(0.0, std::log2(static_cast<double>(cfg.max_bytes)));

  for (std::uint64_t step = 0; step < ops; ++step) {
    const unsigned dice = static_cast<unsigned>(rng() % 100);
    const bool want_alloc = live.empty() || (live.size() < cfg.target_live ? dice < 60 : dice < 40);
    if (dice == 99 && !live.empty()) {
      // Misuse: wrong size, unknown offset, and a stale handle; nothing may change.
      const live_block& b = live[rng() % live.size()];
      const auto before = a.stats();
      ASSERT_EQ(a.try_free(b.handle.offset, b.handle.bytes + cfg.alignment),
                free_status::size_mismatch);
      ASSERT_EQ(a.try_free(a.peak() + cfg.alignment, 1), free_status::not_allocated);
      // A freed block's node may since be free, merged away or live again (often at the same
      // offset and size): its old handle is refused in every case.
      for (const allocation& stale : freed) ASSERT_EQ(a.try_deallocate(stale), free_status::stale_handle);
      ASSERT_EQ(a.stats().used_bytes, before.used_bytes);
      ASSERT_EQ(a.stats().free_blocks, before.free_blocks);
    } else if (want_alloc) {
      const std::uint64_t bytes =
          dice < 2 ? 0 : static_cast<std::uint64_t>(std::exp2(log_size(rng)));
      const auto got = a.allocate(bytes);
      if (exact) {
        const auto want = ref.allocate(bytes == 0 ? 0 : bytes);
        if (bytes != 0) {
          ASSERT_EQ(got.has_value(), want.has_value()) << "step " << step;
          if (got) {
            ASSERT_EQ(got->offset, *want) << "step " << step << " bytes " << bytes;
          }
        }
      }
      if (got && bytes != 0) {
        ASSERT_EQ(got->bytes, *align_up(bytes, cfg.alignment));
        ASSERT_TRUE(is_aligned(got->offset, cfg.alignment));
        ASSERT_LE(got->offset + got->bytes, a.peak());
        ASSERT_LE(a.peak(), cfg.capacity);
        auto next = intervals.lower_bound(got->offset);
        if (next != intervals.end()) {
          ASSERT_LE(got->offset + got->bytes, next->first);
        }
        if (next != intervals.begin()) {
          const auto prev = std::prev(next);
          ASSERT_LE(prev->first + prev->second, got->offset) << "overlap at step " << step;
        }
        intervals.emplace(got->offset, got->bytes);
        used += got->bytes;
        live.push_back({*got, bytes});
      } else if (!got) {
        ASSERT_GT(bytes, 0U);
        ASSERT_NE(cfg.capacity, growing);
        // Failing is only allowed when no single free range could hold it under best fit.
        if (exact) {
          ASSERT_LT(a.stats().largest_free_bytes, *align_up(bytes, cfg.alignment));
        }
      }
    } else {
      const std::size_t i = rng() % live.size();
      const live_block b = live[i];
      live[i] = live.back();
      live.pop_back();
      if (step % 2 == 0) a.free(b.handle.offset, b.asked);
      else a.deallocate(b.handle);
      if (exact) ref.free(b.handle.offset, b.asked);
      if (b.asked != 0) freed.push_back(b.handle);
      if (freed.size() > 16) freed.pop_front();
      intervals.erase(b.handle.offset);
      used -= b.handle.bytes;
    }
    ASSERT_EQ(a.used(), used) << "step " << step;
    if (exact) {
      ASSERT_EQ(a.peak(), ref.peak()) << "step " << step;
    }
    const std::string problem = a.check_invariants();
    ASSERT_EQ(problem, "") << "step " << step;
  }
  if (exact) {
    EXPECT_EQ(a.stats().free_blocks, ref.free_blocks());
  }
}

constexpr std::uint64_t default_seed = 20261122;

TEST(allocator_random, best_fit_matches_reference_growing) {
  run_random<best_fit_allocator>({growing, 256, 1 << 20, 64}, env_or("TENSORMEM_SEED", default_seed),
                                 env_or("TENSORMEM_RANDOM_OPS", default_ops), true);
}

TEST(allocator_random, best_fit_matches_reference_fixed_capacity) {
  run_random<best_fit_allocator>({1 << 22, 1, 1 << 18, 48}, env_or("TENSORMEM_SEED", default_seed) + 1,
                                 env_or("TENSORMEM_RANDOM_OPS", default_ops) / 2, true);
}

TEST(allocator_random, tlsf_is_consistent_growing) {
  run_random<tlsf_allocator>({growing, 256, 1 << 24, 64}, env_or("TENSORMEM_SEED", default_seed) + 2,
                             env_or("TENSORMEM_RANDOM_OPS", default_ops), false);
}

TEST(allocator_random, tlsf_is_consistent_fixed_capacity) {
  run_random<tlsf_allocator>({1 << 22, 1, 1 << 18, 48}, env_or("TENSORMEM_SEED", default_seed) + 3,
                             env_or("TENSORMEM_RANDOM_OPS", default_ops) / 2, false);
}

/// tlsf_allocator's documented policy written plainly (alignment 1: a unit is a byte): one
/// list per size below exact_units and one LIFO list per size class above (front = most
/// recently freed). A block joining an exact list goes first if its offset is below the
/// front's, else second. A request below exact_units takes the front of the smallest listed
/// size that holds it, else a block of the first non-empty class; a larger one scans the
/// first `scan_limit` blocks of its own class, then of the first non-empty class at or above
/// its rounded-up class; then a free tail, then growth. Classes come from the allocator's own
/// size_class_floor/ceil (tested against a model in contract_test).
class naive_tlsf {
 public:
  explicit naive_tlsf(const tlsf_allocator& classes) : classes_(classes) {}

  std::uint64_t allocate(std::uint64_t need) {
    std::optional<std::uint64_t> pick;
    if (need < tlsf_allocator::exact_units) {
      if (const auto it = exact_.lower_bound(need); it != exact_.end()) {
        pick = it->second.front();
      } else if (const auto c = lists_.lower_bound(classes_.size_class_floor(tlsf_allocator::exact_units));
                 c != lists_.end()) {
        pick = best_in(c->first, need);
        ++small_from_classes;
      }
    } else {
      const unsigned down = classes_.size_class_floor(need);
      const unsigned up = classes_.size_class_ceil(need);
      if (down != up && lists_.contains(down)) pick = best_in(down, need);
      if (!pick) {
        const auto it = lists_.lower_bound(up);
        if (it != lists_.end()) pick = best_in(it->first, need);
      }
    }
    if (!pick && !blocks_.empty()) {
      const auto& [offset, b] = *blocks_.rbegin();
      if (b.free && b.bytes >= need) pick = offset;
    }
    if (pick) {
      const std::uint64_t offset = *pick;
      block& b = blocks_.at(offset);
      unlist(offset);
      if (b.bytes > need) {
        blocks_[offset + need] = {b.bytes - need, true};
        list(offset + need);
        b.bytes = need;
      }
      b.free = false;
      return offset;
    }
    std::uint64_t offset = peak_;
    if (!blocks_.empty() && blocks_.rbegin()->second.free) {
      offset = blocks_.rbegin()->first;
      unlist(offset);
      peak_ = offset;
    }
    blocks_[offset] = {need, false};
    peak_ += need;
    return offset;
  }

  void free(std::uint64_t offset) {
    auto it = blocks_.find(offset);
    std::uint64_t start = offset;
    std::uint64_t bytes = it->second.bytes;
    if (it != blocks_.begin() && std::prev(it)->second.free) {
      const auto p = std::prev(it);
      unlist(p->first);
      start = p->first;
      bytes += p->second.bytes;
      blocks_.erase(p);
    }
    if (const auto q = std::next(it); q != blocks_.end() && q->second.free) {
      unlist(q->first);
      bytes += q->second.bytes;
      blocks_.erase(q);
    }
    blocks_.erase(offset);
    blocks_[start] = {bytes, true};
    list(start);
  }

  std::uint64_t peak() const { return peak_; }
  std::uint64_t largest_free() const {
    std::uint64_t most = 0;
    for (const auto& [offset, b] : blocks_) most = b.free ? std::max(most, b.bytes) : most;
    return most;
  }

 private:
  struct block {
    std::uint64_t bytes;
    bool free;
  };
  std::optional<std::uint64_t> best_in(unsigned cls, std::uint64_t need) const {
    std::optional<std::uint64_t> best;
    unsigned steps = 0;
    for (const std::uint64_t offset : lists_.at(cls)) {
      if (steps++ == tlsf_allocator::scan_limit) break;
      const std::uint64_t bytes = blocks_.at(offset).bytes;
      if (bytes < need) continue;
      if (!best || bytes < blocks_.at(*best).bytes || (bytes == blocks_.at(*best).bytes && offset < *best)) best = offset;
    }
    return best;
  }
  void list(std::uint64_t offset) {
    const std::uint64_t bytes = blocks_.at(offset).bytes;
    if (bytes < tlsf_allocator::exact_units) {
      auto& l = exact_[bytes];
      l.insert(l.empty() || offset < l.front() ? l.begin() : l.begin() + 1, offset);
    } else lists_[classes_.size_class_floor(bytes)].push_front(offset);
  }
  template <class Lists, class Key>
  static void unlist_from(Lists& lists, Key key, std::uint64_t offset) {
    auto& l = lists.at(key);
    l.erase(std::find(l.begin(), l.end(), offset));
    if (l.empty()) lists.erase(key);
  }
  void unlist(std::uint64_t offset) {
    const std::uint64_t bytes = blocks_.at(offset).bytes;
    if (bytes < tlsf_allocator::exact_units) unlist_from(exact_, bytes, offset);
    else unlist_from(lists_, classes_.size_class_floor(bytes), offset);
  }

  const tlsf_allocator& classes_;
  std::uint64_t peak_ = 0;
  std::map<std::uint64_t, block> blocks_;                     // offset -> block, below the peak
  std::map<std::uint64_t, std::deque<std::uint64_t>> exact_;  // non-empty exact sizes only
  std::map<unsigned, std::deque<std::uint64_t>> lists_;       // non-empty classes only

 public:
  std::uint64_t small_from_classes = 0;  // small requests served by a class block
};

// Step by step, tlsf_allocator places every block where the plain model of its policy does.
// Sizes come in a few narrow bands, below and above exact_units, so that lists grow past the
// scan limits and blocks move in and out of each list's scanned window; small requests are
// sometimes served by blocks of the classes.
TEST(allocator_random, tlsf_matches_a_plain_model_of_its_policy) {
  const std::uint64_t seed = env_or("TENSORMEM_SEED", default_seed) + 6;
  SCOPED_TRACE("seed " + std::to_string(seed) + " (set TENSORMEM_SEED to replay)");
  std::mt19937_64 rng(seed);
  tlsf_allocator a(growing, 1);
  naive_tlsf model(a);
  std::vector<allocation> live;
  const std::uint64_t ops = env_or("TENSORMEM_RANDOM_OPS", default_ops) / 10;
  for (std::uint64_t step = 0; step < ops; ++step) {
    if (live.empty() || (live.size() < 2000 && rng() % 100 < 52)) {
      const std::uint64_t band = (rng() % 2 == 0 ? std::uint64_t{64} : tlsf_allocator::exact_units) << (rng() % 2);
      const std::uint64_t bytes = band + rng() % (band / 8);
      const allocation got = *a.allocate(bytes);
      ASSERT_EQ(got.offset, model.allocate(bytes)) << "step " << step << " bytes " << bytes;
      live.push_back(got);
    } else {
      const std::size_t i = rng() % live.size();
      a.deallocate(live[i]);
      model.free(live[i].offset);
      live[i] = live.back();
      live.pop_back();
    }
    ASSERT_EQ(a.peak(), model.peak()) << "step " << step;
    if (step % 64 == 0) {
      ASSERT_EQ(a.stats().largest_free_bytes, model.largest_free()) << "step " << step;
    }
  }
  EXPECT_EQ(a.check_invariants(), "");
  EXPECT_GT(model.small_from_classes, 0U) << "no small request was served by a class block";
}

// allocate_at against an interval map: it succeeds exactly when the aligned range fits the
// capacity and overlaps no live allocation; the peak becomes max(peak, end); invariants hold
// after every step. Offsets are drawn near live blocks, inside them, in free gaps and past
// the high-water mark; half the steps allocate by size, some free.
void run_allocate_at(std::uint64_t capacity, std::uint64_t seed, std::uint64_t ops) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " (set TENSORMEM_SEED to replay)");
  constexpr std::uint64_t unit = 256;
  std::mt19937_64 rng(seed);
  best_fit_allocator a(capacity, unit);
  std::map<std::uint64_t, allocation> live;  // offset -> handle
  const auto overlaps = [&live](std::uint64_t offset, std::uint64_t end) {
    auto it = live.lower_bound(offset);
    if (it != live.end() && it->first < end) return true;
    return it != live.begin() && std::prev(it)->second.offset + std::prev(it)->second.bytes > offset;
  };
  for (std::uint64_t step = 0; step < ops; ++step) {
    const unsigned dice = static_cast<unsigned>(rng() % 10);
    const std::uint64_t bytes = 1 + rng() % (64 * unit);
    const std::uint64_t need = *align_up(bytes, unit);
    if (dice < 4) {
      const std::uint64_t offset = (rng() % (a.peak() / unit + 16)) * unit;
      const std::uint64_t peak = a.peak();
      const bool fits = offset <= capacity && need <= capacity - offset;
      const bool expected = fits && !overlaps(offset, offset + need);
      const auto got = a.allocate_at(offset, bytes);
      ASSERT_EQ(got.has_value(), expected) << "step " << step << " at " << offset << " bytes " << need;
      if (got) {
        ASSERT_EQ(got->offset, offset);
        ASSERT_EQ(got->bytes, need);
        ASSERT_EQ(a.peak(), std::max(peak, offset + need));
        live.emplace(offset, *got);
      } else {
        ASSERT_EQ(a.peak(), peak);
      }
    } else if (dice < 7 || live.empty()) {
      if (const auto got = a.allocate(bytes)) {
        ASSERT_FALSE(overlaps(got->offset, got->offset + got->bytes)) << "step " << step;
        live.emplace(got->offset, *got);
      }
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(rng() % live.size()));
      a.deallocate(it->second);
      live.erase(it);
    }
    ASSERT_EQ(a.stats().live_allocations, live.size());
    const std::string problem = a.check_invariants();
    ASSERT_EQ(problem, "") << "step " << step;
  }
}

TEST(allocator_random, best_fit_allocate_at_matches_an_interval_map) {
  run_allocate_at(growing, env_or("TENSORMEM_SEED", default_seed) + 4, env_or("TENSORMEM_RANDOM_OPS", default_ops) / 20);
  run_allocate_at(1 << 22, env_or("TENSORMEM_SEED", default_seed) + 5, env_or("TENSORMEM_RANDOM_OPS", default_ops) / 20);
}

}  // namespace
}  // namespace tensormem::core
