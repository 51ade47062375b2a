// The offload layer: kernels that agree bit for bit across instruction sets and with a double
// oracle, a striped two-generation swap space, a prefetch pipeline that never exceeds its
// budget, and an optimizer whose failed steps change nothing.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "tensormem/memory/errors.hpp"
#include "tensormem/io/path_argument.hpp"
#include "tensormem/offload/offloaded_optimizer.hpp"
#include "../io/forked_child.hpp"
#include "../memory/limited_child.hpp"
#include "../swap/swap_test_support.hpp"

namespace tensormem::offload {
namespace {

using io::testing::in_forked_child;
using io::testing::refused_in_child;
using swap::testing::pattern;
using swap::testing::scratch_dir;
using swap::testing::next_temporary_names;
using swap::testing::temporary_files_in;

std::vector<float> randoms(std::size_t n, std::uint64_t seed, float lo = -1, float hi = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<simd_level> supported_levels() {
  std::vector<simd_level> out;
  for (auto l : {simd_level::scalar, simd_level::avx2, simd_level::avx512}) {
    if (simd_supported(l)) out.push_back(l);
  }
  return out;
}

// ------------------------------------------------------------------------------- kernels

// Every level gives the same bits as the scalar loop, for lengths around the vector widths,
// with and without a master copy; and the result is within 2e-6 relative of an AdamW step
// computed in double.
TEST(offload_kernels, adam_levels_agree_and_match_a_double_oracle) {
  for (const bool decoupled : {true, false}) {
    for (const std::size_t n : {0UL, 1UL, 7UL, 8UL, 15UL, 16UL, 17UL, 33UL, 1000UL, 4099UL}) {
      for (const bool with_master : {false, true}) {
        const auto p0 = randoms(n, 1), g = randoms(n, 2), m0 = randoms(n, 3, -0.1F, 0.1F),
                   v0 = randoms(n, 4, 0, 0.01F);
        const std::uint64_t step = 3;
        const auto s = make_adam_scalars(1e-2, 0.9, 0.999, 1e-8, 0.1, decoupled, step);
        std::vector<std::vector<float>> results;
        for (const simd_level level : supported_levels()) {
          auto p = p0, m = m0, v = v0;
          std::vector<float> master = p0;
          std::vector<float> param = with_master ? std::vector<float>(n, 123.0F) : p0;
          adam_update(param.data(), g.data(), with_master ? master.data() : nullptr, m.data(), v.data(), n, s, level);
          if (with_master) {
            EXPECT_EQ(param, master);
          }
          param.insert(param.end(), m.begin(), m.end());
          param.insert(param.end(), v.begin(), v.end());
          results.push_back(param);
        }
        for (const auto& r : results) EXPECT_EQ(r, results.front()) << "n=" << n;
        // The oracle, in double.
        for (std::size_t i = 0; i < n; ++i) {
          double x = p0[i], gi = g[i];
          if (decoupled) {
            x *= 1 - 1e-2 * 0.1;
          } else {
            gi += 0.1 * x;
          }
          const double m = 0.9 * m0[i] + 0.1 * gi, v = 0.999 * v0[i] + 0.001 * gi * gi;
          const double denom = std::sqrt(v) / std::sqrt(1 - std::pow(0.999, 3)) + 1e-8;
          x -= 1e-2 / (1 - std::pow(0.9, 3)) * m / denom;
          const float got = results.front()[i];
          EXPECT_NEAR(got, x, 2e-6 * std::max(1.0, std::fabs(x))) << "element " << i << " of " << n;
          // Relative to the terms: their sum may cancel.
          EXPECT_NEAR(results.front()[n + i], m, 1e-6 * (std::fabs(0.9 * m0[i]) + std::fabs(0.1 * gi)));
        }
      }
    }
  }
}

TEST(offload_kernels, sgd_levels_agree_and_match_a_double_oracle) {
  for (const bool nesterov : {false, true}) {
    for (const std::uint64_t step : {1UL, 2UL}) {
      const std::size_t n = 1003;
      const auto p0 = randoms(n, 5), g = randoms(n, 6), b0 = randoms(n, 7);
      const auto s = make_sgd_scalars(0.05, 0.9, nesterov ? 0.0 : 0.2, 0.01, nesterov, step);
      std::vector<std::vector<float>> results;
      for (const simd_level level : supported_levels()) {
        auto p = p0, b = b0;
        sgd_update(p.data(), g.data(), nullptr, b.data(), n, s, level);
        p.insert(p.end(), b.begin(), b.end());
        results.push_back(p);
      }
      for (const auto& r : results) EXPECT_EQ(r, results.front());
      for (std::size_t i = 0; i < n; ++i) {
        double d = g[i] + 0.01 * p0[i];
        const double b = step == 1 ? d : 0.9 * b0[i] + (nesterov ? 1.0 : 0.8) * d;
        d = nesterov ? d + 0.9 * b : b;
        const double x = p0[i] - 0.05 * d;
        EXPECT_NEAR(results.front()[i], x, 1e-6 * std::max(1.0, std::fabs(x)));
        EXPECT_NEAR(results.front()[n + i], b, 1e-6 * std::max(1.0, std::fabs(b)));
      }
    }
  }
}

// ---------------------------------------------------------------------------- swap space

struct aligned_floats {
  std::byte* data;
  explicit aligned_floats(std::size_t bytes)
      : data(static_cast<std::byte*>(std::aligned_alloc(4096, std::max<std::size_t>(4096, (bytes + 4095) / 4096 * 4096)))) {}
  ~aligned_floats() { std::free(data); }
  aligned_floats(const aligned_floats&) = delete;
  aligned_floats& operator=(const aligned_floats&) = delete;
};

swap_space_options three_folders(const scratch_dir& dir) {
  swap_space_options o;
  for (const char* f : {"a", "b", "c"}) {
    std::filesystem::create_directory(dir.path / f);
    o.folders.push_back((dir.path / f).string());
  }
  o.stripe_bytes = 8192;
  o.rank = 3;
  return o;
}

TEST(offload_swap_space, round_trips_over_three_folders_with_two_generations) {
  scratch_dir dir;
  swap_space s(three_folders(dir));
  const std::vector<std::uint64_t> sizes = {0, 1, 4096, 8192, 8193, 40000, 123457};
  std::vector<std::size_t> ids;
  for (std::size_t i = 0; i < sizes.size(); ++i) ids.push_back(s.add("t" + std::to_string(i), sizes[i]));
  const auto write_generation = [&](std::uint64_t seed) {
    for (const std::size_t id : ids) {
      aligned_floats b(s.padded_bytes(id));
      const auto bytes = pattern(s.padded_bytes(id), seed + id);
      if (!bytes.empty()) std::memcpy(b.data, bytes.data(), bytes.size());  // a 0-byte tensor has no data
      auto t = s.write(id, b.data);
      s.finish(t);
    }
  };
  const auto read_equals = [&](std::uint64_t seed) {
    for (const std::size_t id : ids) {
      aligned_floats b(s.padded_bytes(id));
      auto t = s.read(id, b.data);
      s.finish(t);
      const auto bytes = pattern(s.padded_bytes(id), seed + id);
      if (!bytes.empty() && std::memcmp(b.data, bytes.data(), bytes.size()) != 0) return false;
    }
    return true;
  };
  write_generation(100);
  for (const std::size_t id : ids) s.commit(id);
  EXPECT_TRUE(read_equals(100));
  write_generation(200);  // not committed: reads still see the first generation
  EXPECT_TRUE(read_equals(100));
  for (const std::size_t id : ids) s.commit(id);
  EXPECT_TRUE(read_equals(200));
  write_generation(300);  // over the first generation's files
  for (const std::size_t id : ids) s.commit(id);
  EXPECT_TRUE(read_equals(300));
  // Every folder holds stripes, under rank3/, and the bytes add up to both generations.
  const auto st = s.stats();
  std::uint64_t total = 0;
  for (std::size_t f = 0; f < 3; ++f) {
    EXPECT_GT(st.folder_bytes[f], 0U);
    total += st.folder_bytes[f];
    EXPECT_TRUE(std::filesystem::is_directory(dir.path / std::string(1, static_cast<char>('a' + f)) / "rank3"));
  }
  std::uint64_t padded = 0;
  for (const std::size_t id : ids) padded += s.padded_bytes(id);
  EXPECT_EQ(total, 2 * padded);
  std::uint64_t on_disk = 0;
  for (auto& e : std::filesystem::recursive_directory_iterator(dir.path)) {
    if (e.is_regular_file()) on_disk += e.file_size();
  }
  EXPECT_EQ(on_disk, total);
}

TEST(offload_swap_space, misuse_is_refused_and_changes_nothing) {
  scratch_dir dir;
  swap_space_options o = three_folders(dir);
  {
    swap_space_options bad = o;
    bad.folders.clear();
    EXPECT_THROW(swap_space{bad}, std::invalid_argument);
    bad = o;
    bad.stripe_bytes = 1000;
    EXPECT_THROW(swap_space{bad}, std::invalid_argument);
    bad = o;
    // Nothing there, a file there: each refused with its own errno.
    const std::string file_there = (dir.path / "a-file").string();
    std::ofstream(file_there) << "x";
    // And a link to itself, which cannot be looked at: the cause, not "missing".
    std::filesystem::create_symlink(dir.path / "loop", dir.path / "loop");
    const std::pair<std::string, int> cases[] = {
        {(dir.path / "missing").string(), ENOENT}, {file_there, ENOTDIR}, {(dir.path / "loop").string(), ELOOP}};
    for (const auto& [folder, error] : cases) {
      bad.folders.push_back(folder);
      try {
        swap_space refused{bad};
        ADD_FAILURE() << "made a swap space in " << folder;
      } catch (const std::system_error& e) {
        EXPECT_EQ(e.code().value(), error) << e.what();
        EXPECT_NE(std::string(e.what()).find("swap folder " + folder), std::string::npos) << e.what();
      }
      bad = o;
    }
    bad = o;
    bad.folders.push_back(o.folders[0]);
    EXPECT_THROW(swap_space{bad}, std::invalid_argument);
    bad = o;
    bad.capacity_bytes = {1};
    EXPECT_THROW(swap_space{bad}, std::invalid_argument);
    // "dir\0x" would be the folder "dir" at the system call: refused, no rank folder made there.
    for (const std::string& folder : {dir.path.string() + std::string(1, '\0') + "x", std::string()}) {
      bad = o;
      bad.folders.push_back(folder);
      EXPECT_THROW(swap_space{bad}, std::invalid_argument);
    }
    EXPECT_FALSE(std::filesystem::exists(dir.path / "rank3"));
  }
  o.capacity_bytes = {100000, 100000, 100000};
  swap_space s(o);
  EXPECT_THROW(s.add("", 10), std::invalid_argument);
  EXPECT_THROW(s.add("a/b", 10), std::invalid_argument);
  EXPECT_THROW(s.add("..", 10), std::invalid_argument);
  // The ends of the ranges of letters and digits, '.', '_' and '-' make a name; the characters
  // just outside those ranges do not.
  for (const char* bad : {"a`", "a{", "a@", "a[", "a/", "a:", "a b"}) {
    EXPECT_THROW(s.add(bad, 10), std::invalid_argument) << bad;
  }
  const std::size_t id = s.add("azAZ09._-x", 40000);
  EXPECT_THROW(s.add("azAZ09._-x", 10), std::invalid_argument);
  {
    std::ofstream(dir.path / "b" / "rank3" / "stale.g1") << "left by a killed run";
    try {
      s.add("stale", 10);
      FAIL() << "an existing file was not noticed";
    } catch (const offload_error& e) {
      EXPECT_EQ(e.error(), EEXIST);
      EXPECT_NE(e.path().find("stale.g1"), std::string::npos);
    }
  }
  {
    // A link where a swap file goes, even a dangling one, counts as a file there.
    const auto nowhere = dir.path / "b" / "nowhere";
    std::filesystem::create_symlink(nowhere, dir.path / "b" / "rank3" / "linked.g0");
    try {
      s.add("linked", 10);
      FAIL() << "a dangling link was not noticed";
    } catch (const offload_error& e) {
      EXPECT_EQ(e.error(), EEXIST);
      EXPECT_NE(std::string(e.what()).find("linked.g0 already exists (a symbolic link)"), std::string::npos)
          << e.what();
    }
    // One put there after the tensor was added is refused by the write, never followed.
    const std::size_t late = s.add("late", 10);
    for (unsigned slot = 0; slot < 2; ++slot) {
      for (std::size_t f = 0; f < o.folders.size(); ++f) std::filesystem::create_symlink(nowhere, s.path(late, slot, f));
    }
    aligned_floats buffer(s.padded_bytes(late) + 4096);
    try {
      auto t = s.write(late, buffer.data);
      s.finish(t);
      FAIL() << "written through a link";
    } catch (const offload_error& e) {
      EXPECT_EQ(e.error(), EINVAL);
      EXPECT_NE(std::string(e.what()).find("it is a symbolic link, not a regular file"), std::string::npos)
          << e.what();
    }
    EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(nowhere)));
  }
  try {
    s.add("big", 200000);  // two generations over three folders pass 100000 in one
    FAIL() << "capacity not enforced";
  } catch (const offload_error& e) {
    EXPECT_EQ(e.tensor(), "big");
    EXPECT_EQ(e.error(), ENOSPC);
    EXPECT_NE(std::string(e.what()).find("is full"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s.size(), 2U);
  aligned_floats b(s.padded_bytes(id) + 4096);
  EXPECT_THROW(s.read(id, b.data), offload_error);  // nothing committed yet
  EXPECT_THROW(s.commit(id), std::logic_error);      // nothing written
  EXPECT_THROW(s.write(id, b.data + 1), std::invalid_argument);
  EXPECT_THROW(s.read(7, b.data), std::out_of_range);
  EXPECT_THROW((void)s.name(s.size()), std::out_of_range);  // one past the last tensor
  EXPECT_THROW((void)s.committed(s.size()), std::out_of_range);
  // Sizes up to 2^62 bytes are taken (this one is then past the folders' capacity); above, refused.
  try {
    s.add("huge", std::uint64_t{1} << 62);
    ADD_FAILURE() << "2^62 bytes fitted in 300,000";
  } catch (const offload_error& e) {
    EXPECT_EQ(e.error(), ENOSPC) << e.what();
  }
  EXPECT_THROW(s.add("huger", (std::uint64_t{1} << 62) + 1), std::invalid_argument);
  // Committed from its first commit on (the generation in slot 0).
  EXPECT_FALSE(s.committed(id));
  auto written = s.write(id, b.data);
  s.finish(written);
  s.commit(id);
  EXPECT_TRUE(s.committed(id));
}

// A folder's capacity holds exactly two generations of its shares; a byte less does not.
TEST(offload_swap_space, a_capacity_of_exactly_two_generations_is_enough) {
  for (const std::uint64_t spare : {std::uint64_t{0}, std::uint64_t{1}}) {
    scratch_dir dir;
    swap_space_options o = three_folders(dir);
    // 3 x 8192 + 4096 bytes over three folders from tensor 0: shares of 12288, 8192 and 8192.
    o.capacity_bytes = {2 * 12288 - spare, 2 * 8192, 2 * 8192};
    swap_space s(o);
    if (spare == 0) {
      s.add("fits", 3 * 8192 + 4096);
      EXPECT_THROW(s.add("more", 1), offload_error);  // folder b is full now
    } else {
      EXPECT_THROW(s.add("fits", 3 * 8192 + 4096), offload_error);
      EXPECT_EQ(s.size(), 0U);
    }
  }
}

// Each folder's share of a tensor, from counts of stripes, equals the stripes dealt out one by
// one; a tensor of 2^62 bytes (2^39 stripes of 8 MiB) is counted at once.
TEST(offload_swap_space, folder_shares_equal_the_stripes_dealt_one_by_one) {
  constexpr std::uint64_t stripe = 4096;
  for (std::size_t folders = 1; folders <= 5; ++folders) {
    for (std::size_t id = 0; id < 7; ++id) {
      for (std::uint64_t pages = 0; pages <= 23; ++pages) {
        for (const std::uint64_t tail : {std::uint64_t{0}, std::uint64_t{1000}}) {
          const std::uint64_t padded = pages * stripe + tail;
          std::vector<std::uint64_t> dealt(folders, 0);
          for (std::uint64_t c = 0, at = 0; at < padded; ++c, at += stripe) {
            dealt[(id + c) % folders] += std::min(stripe, padded - at);
          }
          ASSERT_EQ(detail::stripe_shares(id, padded, stripe, folders), dealt)
              << folders << " folders, tensor " << id << ", " << padded << " bytes";
        }
      }
    }
  }
  const std::vector<std::uint64_t> huge = detail::stripe_shares(5, std::uint64_t{1} << 62, std::size_t{8} << 20, 3);
  EXPECT_EQ(huge[0] + huge[1] + huge[2], std::uint64_t{1} << 62);
}

// An engine that fails (ENOSPC) every write request to files whose name contains `needle`
// while armed.
class failing_writes final : public swap::testing::forwarding_engine {
 public:
  failing_writes(std::unique_ptr<io::io_engine> inner, std::string needle, std::shared_ptr<std::atomic<bool>> armed)
      : forwarding_engine(std::move(inner)), needle_(std::move(needle)), armed_(std::move(armed)) {}
  void submit(std::span<const io::io_request> requests) override {
    for (const auto& r : requests) {
      if (!r.write || !*armed_) continue;
      char link[64];
      std::snprintf(link, sizeof link, "/proc/self/fd/%d", r.fd);
      char target[4096] = {};
      if (::readlink(link, target, sizeof target - 1) > 0 && std::string(target).find(needle_) != std::string::npos) {
        const std::lock_guard lock(mutex_);
        failing_.insert(r.user_data);
      }
    }
    inner_->submit(requests);
  }
  std::vector<io::io_completion> wait(std::size_t min_completions) override {
    auto done = inner_->wait(min_completions);
    const std::lock_guard lock(mutex_);
    for (auto& c : done) {
      if (failing_.count(c.user_data) != 0) c.result = -ENOSPC;
    }
    return done;
  }

 private:
  std::string needle_;
  std::shared_ptr<std::atomic<bool>> armed_;
  std::mutex mutex_;
  std::set<std::uint64_t> failing_;
};

io::file_io_options failing_io(const std::string& needle, std::shared_ptr<std::atomic<bool>> armed) {
  io::file_io_options io;
  io.make_engine = [needle, armed](unsigned qd) {
    return std::make_unique<failing_writes>(io::make_thread_engine(qd, 2), needle, armed);
  };
  return io;
}

// ------------------------------------------------------------------------------ pipeline

// Adds `count` tensors of `bytes` named prefix0, prefix1... and commits a first generation
// of each (zeros); returns their ids.
std::vector<std::size_t> committed_tensors(swap_space& s, const std::string& prefix, int count, std::size_t bytes) {
  std::vector<std::size_t> ids;
  for (int i = 0; i < count; ++i) {
    ids.push_back(s.add(prefix + std::to_string(i), bytes));
    aligned_floats b(bytes);
    auto t = s.write(ids.back(), b.data);
    s.finish(t);
    s.commit(ids.back());
  }
  return ids;
}

// With the collector thread, and without it (the calls collect the write-backs).
class offload_pipeline_collector : public ::testing::TestWithParam<bool> {};

TEST_P(offload_pipeline_collector, random_sizes_never_exceed_the_budget_and_land_every_write) {
  const bool collector = GetParam();
  scratch_dir dir;
  swap_space s(three_folders(dir));
  std::mt19937_64 rng(5);
  std::vector<std::size_t> ids;
  std::uint64_t largest = 0;
  for (int i = 0; i < 40; ++i) {
    ids.push_back(s.add("p" + std::to_string(i), 1 + rng() % 60000));
    largest = std::max(largest, s.padded_bytes(ids.back()));
  }
  memory::pinned_pool pool({.alignment = 4096});
  const auto fill_committed = [&](std::uint64_t seed) {
    for (const std::size_t id : ids) {
      aligned_floats b(s.padded_bytes(id));
      std::memcpy(b.data, pattern(s.padded_bytes(id), seed + id).data(), s.padded_bytes(id));
      auto t = s.write(id, b.data);
      s.finish(t);
      s.commit(id);
    }
  };
  fill_committed(10);
  const std::uint64_t budget = 3 * largest + 100;
  std::vector<bool> dirty(ids.size());
  {
    prefetch_pipeline p(s, pool, ids, {budget, 0, collector});
    EXPECT_EQ(p.stats().collector_thread, collector);
    EXPECT_EQ(p.buffer_count(), 3U);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      std::byte* b = p.acquire(i);
      const auto n = s.padded_bytes(ids[i]);
      ASSERT_EQ(std::memcmp(b, pattern(n, 10 + ids[i]).data(), n), 0) << i;
      EXPECT_LE(pool.stats().in_use_bytes, budget);
      dirty[i] = rng() % 3 != 0;
      if (dirty[i]) std::memcpy(b, pattern(n, 20 + ids[i]).data(), n);
      p.release(i, dirty[i]);
    }
    p.finish();
    const auto written = p.written();
    EXPECT_EQ(written.size(), static_cast<std::size_t>(std::count(dirty.begin(), dirty.end(), true)));
    for (const std::size_t id : written) s.commit(id);
    EXPECT_LE(p.stats().pinned_bytes, budget);
    EXPECT_GT(p.stats().bytes_written, 0U);
  }
  EXPECT_LE(pool.stats().peak_in_use_bytes, budget);
  EXPECT_EQ(pool.stats().in_use_bytes, 0U);  // every buffer back
  prefetch_pipeline again(s, pool, ids, {budget, 2, collector});
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto n = s.padded_bytes(ids[i]);
    std::byte* b = again.acquire(i);
    EXPECT_EQ(std::memcmp(b, pattern(n, (dirty[i] ? 20 : 10) + ids[i]).data(), n), 0) << i;
    again.release(i, false);
  }
  again.finish();
}

INSTANTIATE_TEST_SUITE_P(offload_pipeline, offload_pipeline_collector, ::testing::Bool(),
                         [](const auto& param_info) { return param_info.param ? "thread" : "calls"; });

TEST(offload_pipeline, misuse_is_refused) {
  scratch_dir dir;
  swap_space s(three_folders(dir));
  const std::vector<std::size_t> ids = committed_tensors(s, "m", 4, 8192);
  memory::pinned_pool pool({.alignment = 4096});
  EXPECT_THROW(prefetch_pipeline(s, pool, ids, {8192, 0}), std::invalid_argument);  // one buffer
  EXPECT_THROW(prefetch_pipeline(s, pool, {99}, {1 << 20, 0}), std::out_of_range);
  prefetch_pipeline p(s, pool, ids, {2 * 8192, 0});
  EXPECT_THROW(p.acquire(1), std::logic_error);  // out of order
  EXPECT_THROW(p.release(0, false), std::logic_error);  // not acquired
  p.acquire(0);
  p.acquire(1);
  EXPECT_THROW(p.acquire(2), std::logic_error);  // both buffers held: would wait forever
  p.release(0, true);
  p.acquire(2);  // the write-back frees a buffer
  p.release(1, false);
  p.release(2, false);
  p.acquire(3);
  p.release(3, false);
  EXPECT_THROW(p.acquire(4), std::logic_error);  // past the last position
  EXPECT_THROW(p.release(4, false), std::logic_error);
  p.finish();
  // A single tensor needs one buffer: exactly its cost is enough, a byte less is not.
  const std::vector<std::size_t> one = {ids[0]};
  EXPECT_THROW(prefetch_pipeline(s, pool, one, {8192 - 1, 0}), std::invalid_argument);
  prefetch_pipeline single(s, pool, one, {8192, 0});
  single.acquire(0);
  single.release(0, false);
  single.finish();
}

// Once position i is acquired, positions up to i + max_ahead are read (with max_ahead 0, as
// far as the budget's buffers allow), whether i is released clean or dirty. The swap space
// counts each request when it is queued (one per tensor of a stripe), so the count after every
// call is exact: positions read so far, plus the write-backs queued. (Before, an acquire
// started no read: with max_ahead 1 the next position's read started only when the caller
// released the one it held, so it never overlapped the caller's work, and after a dirty
// release only when the caller waited for it.)
TEST(offload_pipeline, reads_run_at_most_max_ahead_positions_ahead) {
  scratch_dir dir;
  swap_space s(three_folders(dir));
  const std::vector<std::size_t> ids = committed_tensors(s, "r", 7, 8192);
  memory::pinned_pool pool({.alignment = 4096});
  for (const unsigned ahead : {1U, 2U, 3U}) {
    const std::uint64_t before = s.stats().io.requests;
    const auto queued = [&] { return s.stats().io.requests - before; };
    prefetch_pipeline p(s, pool, ids, {7 * 8192, ahead, false});
    EXPECT_EQ(queued(), ahead);  // positions 0 to ahead - 1
    std::uint64_t writes = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      p.acquire(i);
      const std::uint64_t read = std::min<std::size_t>(i + 1 + ahead, ids.size());
      EXPECT_EQ(queued(), read + writes) << ahead << " " << i;
      const bool dirty = i % 2 == 0;
      p.release(i, dirty);
      writes += dirty ? 1 : 0;
      EXPECT_EQ(queued(), read + writes) << ahead << " " << i;
    }
    p.finish();
  }
  const std::uint64_t before = s.stats().io.requests;
  prefetch_pipeline budget_bound(s, pool, ids, {3 * 8192, 0, false});
  EXPECT_EQ(s.stats().io.requests - before, 3U);  // one read per buffer
  budget_bound.acquire(0);
  budget_bound.release(0, false);
  EXPECT_EQ(s.stats().io.requests - before, 4U);
  budget_bound.finish();
}

// A collector that cannot be started (EAGAIN: a limit on threads): the caller's calls collect
// the write-backs where they would wait for them. Two buffers for three dirty tensors, so that
// the third acquire has a buffer only once it has collected the first write-back itself; every
// write lands, the stats say so, and the buffers go back to the pool. (Before, the
// constructor threw; before that, the process ended.)
TEST(offload_pipeline, a_collector_that_cannot_start_leaves_the_collection_to_the_caller) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's runtime needs threads of its own in the limited child";
#endif
  scratch_dir dir;
  std::filesystem::permissions(dir.path, std::filesystem::perms::all);  // the child is a user of its own
  // The swap space's ring thread and its engine's worker only (io_uring's kernel workers
  // count against the limit too: the thread engine, whose threads are known).
  const int status = swap::testing::with_thread_limit(2, [&] {
    swap_space_options o;
    o.folders = {dir.path.string()};
    o.io.engine = io::engine_kind::threads;
    o.io.queue_depth = 1;  // one worker
    swap_space s(o);
    const std::vector<std::size_t> ids = committed_tensors(s, "c", 3, 8192);
    try {
      memory::pinned_pool pool({.slab_bytes = std::size_t{1} << 20, .alignment = 4096});
      {
        prefetch_pipeline p(s, pool, ids, {2 * 8192, 0});
        if (p.stats().collector_thread) return 1;  // the collector started: the limit did not hold
        for (std::size_t i = 0; i < ids.size(); ++i) {
          auto* f = reinterpret_cast<float*>(p.acquire(i));  // the third: after collecting the first write
          for (std::size_t k = 0; k < 2048; ++k) f[k] = static_cast<float>(i * 10000 + k);
          p.release(i, true);
        }
        p.finish();
        if (p.written().size() != ids.size()) return 2;
      }
      if (pool.stats().in_use_bytes != 0) return 3;
      for (const std::size_t t : ids) s.commit(t);
      prefetch_pipeline back(s, pool, ids, {2 * 8192, 0});
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto* f = reinterpret_cast<const float*>(back.acquire(i));
        for (std::size_t k = 0; k < 2048; ++k) {
          if (f[k] != static_cast<float>(i * 10000 + k)) return 4;
        }
        back.release(i, false);
      }
      return 0;
    } catch (const memory::out_of_memory&) {
      return 76;  // this user may not lock even 1 MiB here
    }
  });
  if (status == 76 || status == 77) GTEST_SKIP() << "the limited child could not be set up (" << status << ")";
  EXPECT_EQ(status, 0);  // 98: a wait for a write-back that no one collects
}

TEST(offload_pipeline, a_failed_write_back_names_its_tensor_and_commits_nothing_for_it) {
  scratch_dir dir;
  auto armed = std::make_shared<std::atomic<bool>>(false);
  swap_space_options o = three_folders(dir);
  o.io = failing_io("w2.g", armed);
  swap_space s(o);
  std::vector<std::size_t> ids;
  for (int i = 0; i < 5; ++i) {
    ids.push_back(s.add("w" + std::to_string(i), 20000));
    aligned_floats b(s.padded_bytes(ids.back()));
    std::memset(b.data, 1, s.padded_bytes(ids.back()));
    auto t = s.write(ids.back(), b.data);
    s.finish(t);
    s.commit(ids.back());
  }
  armed->store(true);
  memory::pinned_pool pool({.alignment = 4096});
  prefetch_pipeline p(s, pool, ids, {3 * 20480, 0});
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::byte* b = p.acquire(i);
    std::memset(b, 2, 20480);
    p.release(i, true);
  }
  try {
    p.finish();
    FAIL() << "the failed write was not reported";
  } catch (const offload_error& e) {
    EXPECT_EQ(e.tensor(), "w2");
    EXPECT_EQ(e.error(), ENOSPC);
    EXPECT_NE(e.path().find("w2.g"), std::string::npos);
  }
  const auto written = p.written();
  EXPECT_EQ(written.size(), 4U);
  EXPECT_EQ(std::count(written.begin(), written.end(), ids[2]), 0);
  for (const std::size_t id : written) s.commit(id);
  aligned_floats b(20480);
  auto t = s.read(ids[2], b.data);
  s.finish(t);
  EXPECT_EQ(b.data[100], std::byte{1});  // the committed generation is untouched
}

// ----------------------------------------------------------------------------- optimizer

optimizer_options small_options(const scratch_dir& dir) {
  optimizer_options o;
  o.swap = three_folders(dir);
  o.group_bytes = 8192;
  o.pipeline.pinned_budget = 4 * 3 * 8192;
  return o;
}

// For the children under a memory-lock limit of 1 MiB: groups of 1 MiB, so records of 3 MiB
// (AdamW with a master copy), above the limit; and what a child reports without a scratch folder.
optimizer_options one_mib_groups(const scratch_dir& dir, std::uint64_t pinned_budget) {
  optimizer_options o = small_options(dir);
  o.group_bytes = std::uint64_t{1} << 20;
  o.pipeline.pinned_budget = pinned_budget;
  return o;
}
int no_scratch_folder(std::string& out) {
  out = "no scratch folder";
  return 3;
}

// Under a memory-lock limit too small for two records of its largest group, the optimizer's
// first step of locking says which option makes them smaller and which allows unlocked
// memory, in the optimizer's words rather than the pool's.
TEST(offload_optimizer, a_memory_lock_limit_too_small_names_group_bytes) {
  const auto [code, message] = memory::testing::in_limited_child([](std::string& out) {
    const scratch_dir dir;  // made by the limited user
    if (dir.path.empty()) return no_scratch_folder(out);
    const optimizer_options o = one_mib_groups(dir, std::uint64_t{64} << 20);
    try {
      offloaded_optimizer opt({std::uint64_t{1} << 18}, o);
      const std::vector<float> params(std::size_t{1} << 18, 1.0F);
      const float* p = params.data();
      opt.initialize(std::span<const float* const>(&p, 1));
      out = "initialized past the limit";
      return 1;
    } catch (const memory::lock_limit_error& e) {
      out = e.what();
      return 0;
    } catch (const std::exception& e) {
      out = std::string("another error: ") + e.what();
      return 2;
    }
  });
  ASSERT_EQ(code, 0) << message;
  EXPECT_NE(message.find("RLIMIT_MEMLOCK is 1048576 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("run with CAP_IPC_LOCK. The offloaded optimizer locks at least two records of its largest "
                         "group (3145728 bytes each, within a pinned budget of 67108864 bytes): a smaller "
                         "group_bytes makes them smaller, or allow_unlocked_fallback (Python: allow_unlocked=True) "
                         "uses unlocked memory"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("unlocked fallback"), std::string::npos) << message;
}

struct model_params {
  std::vector<std::vector<float>> values, grads;
  explicit model_params(const std::vector<std::uint64_t>& numels) {
    for (std::size_t i = 0; i < numels.size(); ++i) {
      values.push_back(randoms(numels[i], 10 + i));
      grads.push_back(randoms(numels[i], 20 + i));
    }
  }
  std::vector<float*> p() {
    std::vector<float*> out;
    for (auto& v : values) out.push_back(v.data());
    return out;
  }
  std::vector<const float*> cp() const {
    std::vector<const float*> out;
    for (const auto& v : values) out.push_back(v.data());
    return out;
  }
  std::vector<const float*> g() const {
    std::vector<const float*> out;
    for (const auto& v : grads) out.push_back(v.data());
    return out;
  }
};

const std::vector<std::uint64_t> numels = {5000, 3, 0, 2048, 9000};

// The parameters after two steps of an optimizer that never failed nor stopped.
std::vector<std::vector<float>> values_after_two_clean_steps() {
  scratch_dir dir;
  offloaded_optimizer clean(numels, small_options(dir));
  model_params b(numels);
  clean.initialize(b.cp());
  const std::vector<param_hyper> hyper(numels.size());
  clean.step(b.p(), b.g(), hyper);
  clean.step(b.p(), b.g(), hyper);
  return b.values;
}

// With allow_unlocked_fallback, the same limit leaves the staging unlocked instead: the steps
// give the kernel's values in memory, and the stats count the unlocked slabs.
TEST(offload_optimizer, a_memory_lock_limit_with_the_unlocked_fallback_steps_from_unlocked_memory) {
  const auto [code, message] = memory::testing::in_limited_child([](std::string& out) {
    const scratch_dir dir;  // made by the limited user
    if (dir.path.empty()) return no_scratch_folder(out);
    optimizer_options o = one_mib_groups(dir, std::uint64_t{16} << 20);
    o.allow_unlocked_fallback = true;
    const std::vector<std::uint64_t> sizes = {300'000, 7, 200'000};
    offloaded_optimizer opt(sizes, o);
    model_params a(sizes), ref(sizes);
    opt.initialize(a.cp());
    const std::vector<param_hyper> hyper(sizes.size());
    std::vector<std::vector<float>> m, v;
    for (const auto n : sizes) {
      m.emplace_back(n, 0.0F);
      v.emplace_back(n, 0.0F);
    }
    step_stats st;
    for (std::uint64_t step = 1; step <= 2; ++step) {
      st = opt.step(a.p(), a.g(), hyper);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        adam_update(ref.values[i].data(), ref.grads[i].data(), nullptr, m[i].data(), v[i].data(), sizes[i],
                    make_adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0, true, step), simd_level::scalar);
      }
    }
    out = "unlocked slabs " + std::to_string(st.unlocked_slabs);
    if (st.unlocked_slabs == 0) return 1;
    return a.values == ref.values ? 0 : 2;
  });
  EXPECT_EQ(code, 0) << message;
}

TEST(offload_optimizer, matches_the_kernels_in_memory_and_pieces_cover_every_element) {
  scratch_dir dir;
  offloaded_optimizer o(numels, small_options(dir));
  std::vector<std::uint64_t> covered(numels.size(), 0);
  for (const auto& g : o.groups()) {
    for (const auto& pc : g.pieces) covered[pc.param] += pc.count;
  }
  EXPECT_EQ(covered, numels);
  model_params a(numels), ref(numels);
  o.initialize(a.cp());
  std::vector<std::vector<float>> m, v;
  for (auto n : numels) {
    m.emplace_back(n, 0.0F);
    v.emplace_back(n, 0.0F);
  }
  const std::vector<param_hyper> hyper(numels.size());
  for (std::uint64_t step = 1; step <= 3; ++step) {
    const auto st = o.step(a.p(), a.g(), hyper);
    EXPECT_LE(st.pinned_high_water, o.options().pipeline.pinned_budget);
    for (std::size_t i = 0; i < numels.size(); ++i) {
      adam_update(ref.values[i].data(), ref.grads[i].data(), nullptr, m[i].data(), v[i].data(), numels[i],
                  make_adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0, true, step), simd_level::scalar);
    }
  }
  EXPECT_EQ(a.values, ref.values);
  // The zero-element parameter's gradient pointer is null: skipped.
  EXPECT_EQ(o.steps(), (std::vector<std::uint64_t>{3, 3, 0, 3, 3}));
}

TEST(offload_optimizer, a_failed_step_restores_the_parameters_and_keeps_the_state) {
  scratch_dir dir;
  auto armed = std::make_shared<std::atomic<bool>>(false);
  optimizer_options opts = small_options(dir);
  opts.swap.io = failing_io("failing.group3.g", armed);
  opts.name = "failing";
  offloaded_optimizer o(numels, opts);
  model_params a(numels);
  o.initialize(a.cp());
  const std::vector<param_hyper> hyper(numels.size());
  o.step(a.p(), a.g(), hyper);
  const auto before = a.values;
  std::vector<float> state_before;
  o.visit([&](const auto& g, const float* r) { state_before.insert(state_before.end(), r, r + 3 * g.stride); });
  armed->store(true);
  try {
    o.step(a.p(), a.g(), hyper);
    FAIL() << "the failed write was not reported";
  } catch (const offload_error& e) {
    EXPECT_EQ(e.tensor(), "failing.group3");
    EXPECT_EQ(e.error(), ENOSPC);
  }
  EXPECT_EQ(a.values, before);  // rolled back from the committed master copy
  EXPECT_EQ(o.steps(), (std::vector<std::uint64_t>{1, 1, 0, 1, 1}));
  std::vector<float> state_after;
  o.visit([&](const auto& g, const float* r) { state_after.insert(state_after.end(), r, r + 3 * g.stride); });
  EXPECT_EQ(state_after, state_before);
  // Retried once the fault is gone: the same as an optimizer that never failed.
  armed->store(false);
  o.step(a.p(), a.g(), hyper);
  EXPECT_EQ(a.values, values_after_two_clean_steps());
}

std::vector<char> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string file_text(const std::string& path) {
  const std::vector<char> bytes = file_bytes(path);
  return {bytes.begin(), bytes.end()};
}

void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// An optimizer stepped once, and where its checkpoint goes.
class offload_checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    o.initialize(a.cp());
    o.step(a.p(), a.g(), hyper);
  }
  scratch_dir dir;
  model_params a{numels};
  const std::vector<param_hyper> hyper = std::vector<param_hyper>(numels.size());
  offloaded_optimizer o{numels, small_options(dir)};
  const std::string ck = (dir.path / "ck").string();
};

std::vector<float> all_records(offloaded_optimizer& o) {
  std::vector<float> out;
  o.visit([&](const auto& g, const float* rec) { out.insert(out.end(), rec, rec + 3 * g.stride); });
  return out;
}

// A step told to stop before its k-th group (k = 0 .. groups) is undone as a failed one:
// step_interrupted, the parameters and the state as before it, the step counts unchanged,
// and the next step equal to an optimizer's that was never stopped. Without the master copy
// offloaded, the step is stopped only while no parameter has changed.
TEST(offload_optimizer, a_stopped_step_is_undone_while_it_can_be) {
  const auto records = [](offloaded_optimizer& o) {
    std::vector<float> out;
    const std::size_t fields = o.fields().size();
    o.visit([&](const auto& g, const float* r) { out.insert(out.end(), r, r + fields * g.stride); });
    return out;
  };
  const std::vector<param_hyper> hyper(numels.size());
  const auto clean = values_after_two_clean_steps();
  for (const bool master : {true, false}) {
    scratch_dir dir;
    optimizer_options opts = small_options(dir);
    opts.offload_master = master;
    offloaded_optimizer o(numels, opts);
    ASSERT_GE(o.groups().size(), 3U);
    model_params a(numels);
    o.initialize(a.cp());
    o.step(a.p(), a.g(), hyper);
    for (std::size_t k = 0; k <= o.groups().size(); ++k) {
      SCOPED_TRACE("master " + std::to_string(master) + ", stopped before group " + std::to_string(k));
      const auto before = a.values;
      const std::vector<float> state_before = records(o);
      std::size_t asked = 0;
      const std::function<bool()> stop = [&] { return asked++ == k; };
      // Without the master copy only the first group's question comes before a change.
      const bool undone = k < o.groups().size() && (master || k == 0);
      if (undone) {
        EXPECT_THROW(o.step(a.p(), a.g(), hyper, stop), step_interrupted);
        EXPECT_EQ(a.values, before);
        EXPECT_EQ(records(o), state_before);
        EXPECT_EQ(o.steps(), (std::vector<std::uint64_t>{1, 1, 0, 1, 1}));
        EXPECT_EQ(asked, k + 1);
      } else {
        EXPECT_NO_THROW(o.step(a.p(), a.g(), hyper, stop));
        EXPECT_EQ(asked, master ? o.groups().size() : 1U);
        break;  // the step ran to its end: two steps taken, as the clean optimizer's
      }
    }
    EXPECT_EQ(o.steps(), (std::vector<std::uint64_t>{2, 2, 0, 2, 2}));
    EXPECT_EQ(a.values, clean);  // the arithmetic is the same with the master copy or without
  }
}

TEST_F(offload_checkpoint, round_trips_and_bad_ones_are_refused) {
  o.save(ck);
  EXPECT_EQ(temporary_files_in(dir.path), std::vector<std::string>{});
  offloaded_optimizer r(numels, small_options(dir));
  EXPECT_THROW(r.step(a.p(), a.g(), hyper), std::logic_error);  // neither initialized nor loaded
  r.load(ck);
  EXPECT_EQ(r.steps(), o.steps());
  EXPECT_EQ(all_records(r), all_records(o));
  model_params b = a;
  o.step(a.p(), a.g(), hyper);
  r.step(b.p(), b.g(), hyper);
  EXPECT_EQ(a.values, b.values);

  std::vector<std::uint64_t> other = numels;
  other[1] = 4;
  offloaded_optimizer mismatch(other, small_options(dir));
  EXPECT_THROW(mismatch.load(ck), std::runtime_error);
  other = numels;
  other[0] = 4999;  // the first parameter's size, named as such
  offloaded_optimizer first(other, small_options(dir));
  try {
    first.load(ck);
    ADD_FAILURE() << "a checkpoint of other sizes was loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "checkpoint " + ck + " does not match this optimizer: parameter 0 has 5000 "
                                     "elements, expected 4999");
  }
  optimizer_options sgd = small_options(dir);
  sgd.kind = optimizer_kind::sgd;
  offloaded_optimizer kind(numels, sgd);
  EXPECT_THROW(kind.load(ck), std::runtime_error);
  std::filesystem::resize_file(ck, std::filesystem::file_size(ck) - 100);
  offloaded_optimizer truncated(numels, small_options(dir));
  EXPECT_THROW(truncated.load(ck), std::runtime_error);
  EXPECT_THROW(truncated.load((dir.path / "none").string()), std::system_error);
  // Not a regular file: refused without waiting for a pipe's writer, naming what it is.
  const std::string pipe = (dir.path / "pipe").string();
  ASSERT_EQ(mkfifo(pipe.c_str(), 0600), 0);
  for (const std::string& path : {pipe, std::string("/dev/zero"), dir.path.string()}) {
    const swap::testing::hang_guard guard("loading a checkpoint from " + path, std::chrono::seconds(20));
    try {
      truncated.load(path);
      ADD_FAILURE() << "loaded " << path;
    } catch (const std::system_error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot open checkpoint " + path + ": it is a"), std::string::npos)
          << e.what();
    }
  }

  // "ck\0x" would save over, or load, the file "ck": refused, and ck keeps its bytes.
  const auto size = std::filesystem::file_size(ck);
  for (const std::string& path : {ck + std::string(1, '\0') + "x", std::string()}) {
    EXPECT_THROW(o.save(path), std::invalid_argument);
    EXPECT_THROW(truncated.load(path), std::invalid_argument);
  }
  EXPECT_EQ(std::filesystem::file_size(ck), size);
  EXPECT_EQ(temporary_files_in(dir.path), std::vector<std::string>{});
  // A folder that is not there: the save says so by the checkpoint's name.
  const std::string nowhere = (dir.path / "missing" / "ck").string();
  try {
    o.save(nowhere);
    ADD_FAILURE() << "saved into a missing folder";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOENT);
    EXPECT_NE(std::string(e.what()).find("cannot save checkpoint " + nowhere + ": cannot create its temporary file " +
                                         nowhere + ".tensormem-tmp."),
              std::string::npos)
        << e.what();
  }

  // Both where the file is unnamed until it is whole (its name taken as it is renamed into
  // place) and where it is named from the start.
  std::vector<char> before;
  for (const bool named : {false, true}) {
    const swap::testing::named_temporaries mode(named);
    // Nothing beside the checkpoint is opened or changed: the save makes its temporary file
    // under a name no file has (O_EXCL). The next names it would try hold a symbolic link to a
    // user's file, a link to /dev/full, a pipe, a folder, a user's file and (where root may
    // make one) a node of the null device: the save passes over them, each stays as it was,
    // and the checkpoint is whole. A file at `ck.tmp` is a user's like any other.
    const std::string notes = (dir.path / "notes").string();
    const std::string users = "a user's own bytes";
    std::ofstream(notes) << users;
    std::ofstream(ck + ".tmp") << users;
    auto names = next_temporary_names(ck, 6);
    std::filesystem::create_symlink(notes, names[0]);
    std::filesystem::create_symlink("/dev/full", names[1]);
    ASSERT_EQ(mkfifo(names[2].c_str(), 0600), 0);
    std::filesystem::create_directory(names[3]);
    std::ofstream(names[4]) << users;
    const bool node = mknod(names[5].c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0;
    {
      const swap::testing::hang_guard guard("saving a checkpoint beside a pipe", std::chrono::seconds(20));
      o.save(ck, "past six names");
    }
    EXPECT_EQ(file_text(notes), users);
    EXPECT_EQ(file_text(ck + ".tmp"), users);
    EXPECT_EQ(file_text(names[4]), users);
    EXPECT_EQ(std::filesystem::read_symlink(names[0]), notes);
    EXPECT_EQ(std::filesystem::read_symlink(names[1]), "/dev/full");
    EXPECT_TRUE(std::filesystem::is_fifo(names[2]));  // not opened: no wait for a reader
    EXPECT_TRUE(std::filesystem::is_directory(names[3]));
    EXPECT_EQ(std::filesystem::is_character_file(names[5]), node);
    EXPECT_FALSE(std::filesystem::is_symlink(ck));
    {
      offloaded_optimizer saved(numels, small_options(dir));
      EXPECT_EQ(saved.load(ck), "past six names");
      EXPECT_EQ(all_records(saved), all_records(o));
    }
    for (const std::string& name : names) std::filesystem::remove(name);
    std::filesystem::remove(ck + ".tmp");
    EXPECT_EQ(temporary_files_in(dir.path), std::vector<std::string>{});
    // A hundred names in a row taken: the save gives up (EEXIST) naming the last it tried,
    // writes nothing, and the checkpoint and the files there keep their bytes.
    before = file_bytes(ck);
    names = next_temporary_names(ck, 100);
    for (const std::string& name : names) std::ofstream(name) << users;
    try {
      o.save(ck);
      ADD_FAILURE() << "saved with every name taken";
    } catch (const std::system_error& e) {
      EXPECT_EQ(e.code().value(), EEXIST) << e.what();
      const std::string refusal = named ? "cannot save checkpoint " + ck + ": cannot create its temporary file " + names.back()
                                        : "cannot save checkpoint " + ck + ": cannot give its new file a name beside it";
      EXPECT_EQ(std::string(e.what()).find(refusal), 0U) << e.what();
    }
    EXPECT_EQ(file_bytes(ck), before);
    for (const std::string& name : names) {
      EXPECT_EQ(file_text(name), users) << name;
      std::filesystem::remove(name);
    }
  }
  before = file_bytes(ck);
  // What the save would replace is a regular file or nothing: a pipe, or a node of the null
  // device (where root may make one; saving to /dev/null replaced the machine's), is refused
  // before anything is written, and stays.
  const std::string fifo = (dir.path / "fifo").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  std::vector<std::pair<std::string, std::string>> not_files = {{fifo, "a pipe"}};
  const std::string null_node = (dir.path / "null").string();
  if (mknod(null_node.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0) not_files.emplace_back(null_node, "a device");
  for (const auto& [target, what] : not_files) {
    try {
      o.save(target);
      ADD_FAILURE() << "saved over " << what;
    } catch (const std::system_error& e) {
      EXPECT_EQ(e.code().value(), EINVAL) << e.what();
      EXPECT_NE(std::string(e.what()).find("cannot save checkpoint " + target + ": it is " + what +
                                           "; a checkpoint replaces only a regular file"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(temporary_files_in(dir.path), std::vector<std::string>{});
    EXPECT_EQ(std::filesystem::is_fifo(target), what == "a pipe");
    EXPECT_EQ(std::filesystem::is_character_file(target), what == "a device");
  }
  o.save(ck);  // O_NONBLOCK is not left on the file: a whole checkpoint, loaded back
  offloaded_optimizer reloaded(numels, small_options(dir));
  reloaded.load(ck);
  EXPECT_EQ(all_records(reloaded), all_records(o));
  const std::string folder = (dir.path / "folder").string();
  std::filesystem::create_directory(folder);
  std::filesystem::create_directory(folder + "/inside");
  EXPECT_THROW(o.save(folder), std::system_error);
  EXPECT_EQ(temporary_files_in(dir.path), std::vector<std::string>{});
  EXPECT_TRUE(std::filesystem::is_directory(folder + "/inside"));
}

// A save that fails for a full disk (a small tmpfs over the checkpoints' folder, in a child's
// own mount namespace; root only) raises ENOSPC, removes its temporary file and leaves the
// previous checkpoint whole.
TEST(offload_checkpoint_disk, a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint) {
  scratch_dir dir;     // the swap files
  scratch_dir folder;  // the checkpoints
  const std::vector<std::uint64_t> sizes = {40000, 3000};
  const std::vector<param_hyper> hyper(sizes.size());
  std::uintmax_t bytes = 0;  // of one checkpoint, measured here
  {
    offloaded_optimizer o(sizes, small_options(dir));
    model_params a(sizes);
    o.initialize(a.cp());
    o.save((dir.path / "probe").string());
    bytes = std::filesystem::file_size(dir.path / "probe");
  }
  ASSERT_GE(bytes, std::uintmax_t{16} << 10);
  // Room for one checkpoint and half of another.
  const std::string size = "size=" + std::to_string((bytes * 3 / 2 + 4095) / 4096 * 4096);
  const std::string ck = (folder.path / "ck").string();
  EXPECT_FULL_DISK_CHILD(swap::testing::in_small_tmpfs(folder.path, size.c_str(), [&] {
    offloaded_optimizer o(sizes, small_options(dir));
    model_params a(sizes);
    o.initialize(a.cp());
    o.save(ck);
    const std::vector<char> first = file_bytes(ck);
    o.step(a.p(), a.g(), hyper);
    int error = 0;
    try {
      o.save(ck);
    } catch (const std::system_error& e) {
      error = e.code().value();
    }
    offloaded_optimizer back(sizes, small_options(dir));
    back.load(ck);
    return error == ENOSPC && swap::testing::temporary_files_in(folder.path).empty() && file_bytes(ck) == first &&
           back.steps() == std::vector<std::uint64_t>(sizes.size(), 0);
  }));
}
// A process killed while it saves a checkpoint leaves nothing beside it: the new file has no
// name until it is whole (O_TMPFILE). The child saves again and again; once one of its open
// files is in the checkpoints' folder under another name than the checkpoint's (the file
// being written), it is killed. The checkpoint there is whole.
TEST(offload_checkpoint_kill, a_process_killed_while_it_saves_leaves_nothing_beside_the_checkpoint) {
  const scratch_dir swaps;
  const scratch_dir folder;
  const std::vector<std::uint64_t> sizes = {std::uint64_t{3} << 20};  // 36 MiB of state to save
  const std::string ck = (folder.path / "ck").string();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    try {
      offloaded_optimizer o(sizes, small_options(swaps));
      model_params a(sizes);
      o.initialize(a.cp());
      o.save(ck, "first");
      if (::write(ready[1], "r", 1) != 1) ::_exit(2);
      for (;;) o.save(ck, "later");
    } catch (...) {
      ::_exit(3);
    }
  }
  ::close(ready[1]);
  char byte = 0;
  const bool saved_once = ::read(ready[0], &byte, 1) == 1;
  ::close(ready[0]);
  std::string seen;  // the link of the child's file being written
  const std::string fds = "/proc/" + std::to_string(child) + "/fd";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (saved_once && seen.empty() && std::chrono::steady_clock::now() < deadline) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(fds, ec)) {
      std::error_code gone;
      const std::string to = std::filesystem::read_symlink(e.path(), gone).string();
      if (!gone && to.rfind(folder.path.string() + "/", 0) == 0 && to != ck) seen = to;
    }
  }
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(saved_once) << "the child failed before its first save, status " << status;
  ASSERT_FALSE(seen.empty()) << "no file of the child's seen being written";
  EXPECT_NE(seen.find(" (deleted)"), std::string::npos) << seen;  // unnamed: "<folder>/#<inode> (deleted)"
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(folder.path)) left.push_back(e.path().string());
  EXPECT_EQ(left, std::vector<std::string>{ck});
  offloaded_optimizer back(sizes, small_options(swaps));
  const std::string note = back.load(ck);
  EXPECT_TRUE(note == "first" || note == "later") << note;
}

// Where the file system has no unnamed files (O_TMPFILE refused as by NFS, EOPNOTSUPP, or by
// a kernel without the flag, EISDIR), a save writes a named temporary file instead: the
// checkpoint is whole and nothing is left beside it.
TEST(offload_checkpoint_disk, without_unnamed_files_a_save_writes_a_named_file_and_leaves_nothing) {
  const scratch_dir swaps;
  const scratch_dir folder;
  const std::string ck = (folder.path / "ck").string();
  for (const int refusal : {EOPNOTSUPP, EISDIR}) {
    const int status = swap::testing::without_unnamed_files(folder.path, [&] {
      offloaded_optimizer o(numels, small_options(swaps));
      model_params a(numels);
      o.initialize(a.cp());
      o.save(ck, "named");
      offloaded_optimizer back(numels, small_options(swaps));
      return back.load(ck) == "named" && all_records(back) == all_records(o) &&
             temporary_files_in(folder.path).empty();
    }, refusal);
    if (status == 77) GTEST_SKIP() << "no seccomp filter here";
    EXPECT_EQ(status, 0) << refusal;
    std::filesystem::remove(ck);
  }
}

// The two halves of load: a staged checkpoint changes neither the records nor the step counts
// until it is committed; a call that writes the state in between, or a drop, leaves nothing
// to commit; a damaged file stages nothing.
TEST_F(offload_checkpoint, a_staged_load_changes_nothing_until_it_is_committed) {
  o.save(ck);
  const std::vector<float> saved = all_records(o);
  const std::vector<std::uint64_t> saved_steps = o.steps();
  o.step(a.p(), a.g(), hyper);
  const std::vector<float> later = all_records(o);
  ASSERT_NE(later, saved);
  EXPECT_FALSE(o.load_staged());
  EXPECT_THROW(o.commit_load(), std::logic_error);  // nothing staged

  EXPECT_EQ(o.stage_load(ck), "");
  EXPECT_TRUE(o.load_staged());
  EXPECT_EQ(all_records(o), later);  // the state in use, not the staged one
  EXPECT_EQ(o.steps(), (std::vector<std::uint64_t>{2, 2, 0, 2, 2}));
  o.save((dir.path / "meanwhile").string());  // a save reads the state in use
  o.commit_load();
  EXPECT_FALSE(o.load_staged());
  EXPECT_EQ(all_records(o), saved);
  EXPECT_EQ(o.steps(), saved_steps);
  EXPECT_THROW(o.commit_load(), std::logic_error);  // committed once

  // A step between the halves takes the staged generation: nothing left to commit.
  o.stage_load((dir.path / "meanwhile").string());
  o.step(a.p(), a.g(), hyper);
  const std::vector<float> stepped = all_records(o);
  EXPECT_FALSE(o.load_staged());
  EXPECT_THROW(o.commit_load(), std::logic_error);
  EXPECT_EQ(all_records(o), stepped);
  EXPECT_EQ(o.steps(), (std::vector<std::uint64_t>{2, 2, 0, 2, 2}));
  // So do rewrite and initialize; a drop leaves nothing either.
  o.stage_load(ck);
  o.rewrite([](const auto&, float*) {});
  EXPECT_THROW(o.commit_load(), std::logic_error);
  o.stage_load(ck);
  o.initialize(a.cp());
  EXPECT_THROW(o.commit_load(), std::logic_error);
  const std::vector<float> initialized = all_records(o);
  // Any write to the swap space takes it, one made through space() too; a step that writes
  // nothing (no gradients) leaves it.
  o.stage_load(ck);
  {
    const std::uint64_t padded = o.space().padded_bytes(0);
    std::unique_ptr<void, decltype(&std::free)> buffer(std::aligned_alloc(4096, padded), &std::free);
    std::memset(buffer.get(), 0, padded);
    swap_space::transfer t = o.space().write(0, buffer.get());
    EXPECT_FALSE(o.load_staged());  // as soon as it is queued
    o.space().finish(t);
  }
  EXPECT_THROW(o.commit_load(), std::logic_error);
  EXPECT_EQ(all_records(o), initialized);
  o.stage_load(ck);
  const std::vector<const float*> no_gradients(numels.size(), nullptr);
  o.step(a.p(), no_gradients, hyper);
  EXPECT_TRUE(o.load_staged());
  EXPECT_EQ(all_records(o), initialized);
  o.commit_load();
  EXPECT_EQ(all_records(o), saved);
  EXPECT_EQ(o.steps(), saved_steps);
  o.initialize(a.cp());
  o.stage_load(ck);
  o.drop_staged_load();
  EXPECT_FALSE(o.load_staged());
  EXPECT_THROW(o.commit_load(), std::logic_error);
  EXPECT_EQ(all_records(o), initialized);

  // A damaged file: refused when staged, nothing to commit, the state as it was; and a
  // staged checkpoint that another stage_load replaces is that one's.
  std::vector<char> bytes = file_bytes(ck);
  bytes[bytes.size() / 2] ^= 1;
  write_bytes((dir.path / "damaged").string(), bytes);
  o.stage_load((dir.path / "meanwhile").string());
  EXPECT_THROW(o.stage_load((dir.path / "damaged").string()), std::runtime_error);
  EXPECT_FALSE(o.load_staged());
  EXPECT_THROW(o.commit_load(), std::logic_error);
  EXPECT_EQ(all_records(o), initialized);
  o.stage_load((dir.path / "meanwhile").string());
  o.stage_load(ck);
  o.commit_load();
  EXPECT_EQ(all_records(o), saved);
  EXPECT_EQ(o.steps(), saved_steps);

  // Stepping on from a committed staged load equals stepping on from a plain load.
  offloaded_optimizer plain(numels, small_options(dir));
  plain.load(ck);
  model_params b = a;
  o.step(a.p(), a.g(), hyper);
  plain.step(b.p(), b.g(), hyper);
  EXPECT_EQ(a.values, b.values);
  EXPECT_EQ(all_records(o), all_records(plain));
}


// A new checkpoint is its owner's alone (0600); one that replaces a file keeps that file's
// permission bits, as an editor keeps them; through a link the link itself is replaced.
TEST_F(offload_checkpoint, a_replaced_checkpoint_keeps_the_mode_of_the_file_it_replaces) {
  const auto mode = [](const std::string& path) {
    struct stat st {};
    EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
    return st.st_mode & 07777;
  };
  o.save(ck);
  EXPECT_EQ(mode(ck), 0600U);
  for (const mode_t wanted : {0640U, 0444U, 0604U}) {
    ASSERT_EQ(::chmod(ck.c_str(), wanted), 0);
    o.save(ck);
    EXPECT_EQ(mode(ck), wanted);
  }
  const std::string link = (dir.path / "latest").string();
  std::filesystem::create_symlink(ck, link);
  o.save(link);
  EXPECT_FALSE(std::filesystem::is_symlink(link));
  EXPECT_EQ(mode(link), 0600U);
  EXPECT_EQ(mode(ck), 0604U);
  offloaded_optimizer back(numels, small_options(dir));
  back.load(ck);
  EXPECT_EQ(all_records(back), all_records(o));
  // The mode cannot be set (fchmod fails, a seccomp filter in a child), or the whole new file
  // cannot be given a name (linkat refused, as on a file system without hard links, and then
  // the copy under a name fails), or the named file cannot be renamed onto the checkpoint:
  // the save fails naming the step, removes its new file, and the checkpoint keeps its bytes.
  // With linkat refused alone, the copy is the checkpoint, with the mode of the file it replaces.
  const std::vector<char> before = file_bytes(ck);
  struct refusal {
    std::vector<std::pair<long, int>> failing;
    std::string message;  // empty: saved
  };
  for (const refusal& r : {refusal{{{SYS_fchmod, EPERM}}, "cannot set the mode of " + ck + " (its new file, not yet named)"},
                           refusal{{{SYS_linkat, EPERM}, {SYS_copy_file_range, EIO}},
                                   "cannot give its new file a name beside it"},
                           refusal{{{SYS_rename, EXDEV}}, "cannot rename "},
                           refusal{{{SYS_linkat, EPERM}}, ""}}) {
    const int status = swap::testing::with_failing_syscalls(r.failing, [&] {
      try {
        offloaded_optimizer child(numels, small_options(dir));  // (an optimizer is its process's own)
        child.load(ck);
        try {
          child.save(ck, "copied");
          offloaded_optimizer copied(numels, small_options(dir));
          return r.message.empty() && copied.load(ck) == "copied" && mode(ck) == 0604U &&
                 temporary_files_in(dir.path).empty();
        } catch (const std::system_error& e) {
          return e.code().value() == r.failing.back().second &&
                 std::string(e.what()).rfind("cannot save checkpoint " + ck + ": " + r.message, 0) == 0 &&
                 file_bytes(ck) == before && temporary_files_in(dir.path).empty();
        }
      } catch (...) {
        return false;
      }
    });
    if (status == 77) GTEST_SKIP() << "no seccomp filter here";
    EXPECT_EQ(status, 0) << r.message;
    if (!r.message.empty()) {
      EXPECT_EQ(file_bytes(ck), before);
    }
  }
}

// Two optimizers of other states saving to one path at once (ranks that all save, threads
// here; processes differ only in the name's pid): every save succeeds, and the file there
// after each round is one of the two checkpoints whole, never a mix of their bytes.
TEST_F(offload_checkpoint, saves_to_one_path_at_once_each_leave_a_whole_file) {
  scratch_dir other_dir;
  model_params b{numels};
  offloaded_optimizer other(numels, small_options(other_dir));
  other.initialize(b.cp());
  for (int k = 0; k < 3; ++k) other.step(b.p(), b.g(), hyper);
  const std::vector<float> mine = all_records(o);
  const std::vector<float> theirs = all_records(other);
  ASSERT_NE(mine, theirs);
  std::set<std::string> seen;
  for (int round = 0; round < 30; ++round) {
    std::exception_ptr failed[2];
    swap::testing::gate start;
    std::thread t([&] {
      start.pass();
      try {
        other.save(ck, "theirs");
      } catch (...) {
        failed[1] = std::current_exception();
      }
    });
    start.open();
    try {
      o.save(ck, "mine");
    } catch (...) {
      failed[0] = std::current_exception();
    }
    t.join();
    for (const std::exception_ptr& e : failed) {
      if (e) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& x) {
          ADD_FAILURE() << "round " << round << ": " << x.what();
        }
      }
    }
    offloaded_optimizer back(numels, small_options(dir));
    const std::string note = back.load(ck);  // whole: the checksum holds
    ASSERT_TRUE(note == "mine" || note == "theirs") << note;
    EXPECT_EQ(all_records(back), note == "mine" ? mine : theirs) << "round " << round;
    seen.insert(note);
  }
  EXPECT_EQ(temporary_files_in(dir.path), std::vector<std::string>{});
  RecordProperty("last_writers", static_cast<int>(seen.size()));
}

// The note is kept with the state; any byte changed, cut or added is refused and the loaded
// state stays as it was.
TEST_F(offload_checkpoint, keeps_its_note_and_damage_is_refused_without_loading) {
  const std::string note = std::string("{\"lr\": 0.001}") + std::string(1, '\0') + "binary";
  o.save(ck, note);
  offloaded_optimizer r(numels, small_options(dir));
  EXPECT_EQ(r.load(ck), note);
  const std::vector<float> saved = all_records(o);
  EXPECT_EQ(all_records(r), saved);
  o.step(a.p(), a.g(), hyper);  // o moves on; r keeps the checkpoint's state
  const std::vector<float> kept = all_records(r);
  const std::vector<std::uint64_t> kept_steps = r.steps();
  ASSERT_NE(all_records(o), kept);

  const std::vector<char> good = file_bytes(ck);
  const std::string bad = (dir.path / "bad").string();
  // A byte of the header, of a record, of the note and of the tail.
  for (const std::size_t at : {std::size_t{8 + 7 * 8 + 8}, std::size_t{4096 + 5}, good.size() / 2,
                               good.size() - 24 - 3, good.size() - 24 + 2, good.size() - 1}) {
    std::vector<char> damaged = good;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x10);
    write_bytes(bad, damaged);
    EXPECT_THROW(r.load(bad), std::runtime_error) << "byte " << at;
    EXPECT_EQ(all_records(r), kept) << "byte " << at;
    EXPECT_EQ(r.steps(), kept_steps) << "byte " << at;
  }
  try {
    std::vector<char> damaged = good;
    damaged[4096 + 5] = static_cast<char>(damaged[4096 + 5] ^ 1);
    write_bytes(bad, damaged);
    r.load(bad);
    ADD_FAILURE() << "a changed record was loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("is damaged: its checksum does not match"), std::string::npos) << e.what();
  }
  std::vector<char> longer = good;
  longer.push_back('x');
  write_bytes(bad, longer);
  EXPECT_THROW(r.load(bad), std::runtime_error);
  write_bytes(bad, std::vector<char>(good.begin(), good.end() - 10));
  EXPECT_THROW(r.load(bad), std::runtime_error);
  EXPECT_EQ(all_records(r), kept);

  // A version 1 file (no note, no checksum) still loads; with a byte more it is refused.
  std::vector<char> v1(good.begin(), good.end() - 24 - static_cast<std::ptrdiff_t>(note.size()));
  const std::uint64_t one = 1;
  std::memcpy(v1.data() + 8, &one, 8);
  write_bytes(bad, v1);
  offloaded_optimizer old(numels, small_options(dir));
  EXPECT_EQ(old.load(bad), "");
  EXPECT_EQ(all_records(old), saved);
  v1.push_back('x');
  write_bytes(bad, v1);
  EXPECT_THROW(old.load(bad), std::runtime_error);
  const std::uint64_t three = 3;
  std::memcpy(longer.data() + 8, &three, 8);
  write_bytes(bad, longer);
  try {
    old.load(bad);
    ADD_FAILURE() << "version 3 was loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("has version 3"), std::string::npos) << e.what();
  }
}

// Whole steps from two threads on the same parameters give what the same number of steps
// in one thread gives (each step adds the same gradients), while a third thread reads the
// step counts: they only grow.
TEST(offload_optimizer, steps_from_several_threads_run_one_at_a_time) {
  scratch_dir dir, dir2;
  offloaded_optimizer o(numels, small_options(dir));
  offloaded_optimizer serial(numels, small_options(dir2));
  model_params a(numels), b(numels);
  o.initialize(a.cp());
  serial.initialize(b.cp());
  const std::vector<param_hyper> hyper(numels.size());
  constexpr int per_thread = 15;
  std::atomic<bool> done{false};
  std::vector<std::string> errors;
  std::mutex errors_lock;
  auto stepper = [&] {
    try {
      for (int i = 0; i < per_thread; ++i) o.step(a.p(), a.g(), hyper);
    } catch (const std::exception& e) {
      const std::lock_guard lock(errors_lock);
      errors.emplace_back(e.what());
    }
  };
  std::uint64_t last_seen = 0;
  bool counts_only_grow = true;
  std::thread reader([&] {
    while (!done.load()) {
      const std::vector<std::uint64_t> s = o.steps();
      counts_only_grow = counts_only_grow && s[0] >= last_seen && s[0] == s[1] && s[2] == 0 && o.initialized();
      last_seen = s[0];
    }
  });
  std::thread t1(stepper), t2(stepper);
  t1.join();
  t2.join();
  done.store(true);
  reader.join();
  EXPECT_TRUE(errors.empty()) << errors.front();
  EXPECT_TRUE(counts_only_grow);
  for (int i = 0; i < 2 * per_thread; ++i) serial.step(b.p(), b.g(), hyper);
  EXPECT_EQ(o.steps(), serial.steps());
  EXPECT_EQ(a.values, b.values);
  EXPECT_EQ(all_records(o), all_records(serial));
}

// A callback of visit or rewrite that calls the optimizer again would change the records
// being streamed (or wait for its own call): every such call is refused, changes nothing, and
// the optimizer takes calls again once visit or rewrite has returned, or thrown.
TEST_F(offload_checkpoint, calls_from_inside_a_callback_are_refused_and_change_nothing) {
  o.save(ck);
  const std::vector<float> records = all_records(o);
  const std::vector<std::uint64_t> steps = o.steps();
  const auto values = a.values;
  const std::vector<std::function<void()>> calls = {
      [&] { o.initialize(a.cp()); },
      [&] { o.step(a.p(), a.g(), hyper); },
      [&] { o.visit([](const auto&, const float*) {}); },
      [&] { o.rewrite([](const auto&, float*) {}); },
      [&] { o.save(ck + "2"); },
      [&] { o.load(ck); },
  };
  std::size_t refused = 0;
  std::size_t groups = 0;
  auto call_each = [&] {
    ++groups;
    EXPECT_EQ(o.steps(), steps);  // read directly from inside the callback
    EXPECT_TRUE(o.initialized());
    for (const auto& call : calls) {
      try {
        call();
      } catch (const std::logic_error& e) {
        EXPECT_NE(std::string(e.what()).find("from inside the callback"), std::string::npos) << e.what();
        ++refused;
      }
    }
  };
  o.visit([&](const auto&, const float*) { call_each(); });
  o.rewrite([&](const auto&, float*) { call_each(); });
  EXPECT_EQ(refused, calls.size() * groups);
  EXPECT_EQ(groups, 2 * o.groups().size());
  EXPECT_FALSE(std::filesystem::exists(ck + "2"));
  EXPECT_EQ(all_records(o), records);
  EXPECT_EQ(o.steps(), steps);
  EXPECT_EQ(a.values, values);
  // A callback that throws lets go of the optimizer too.
  EXPECT_THROW(o.visit([](const auto&, const float*) { throw std::runtime_error("callback"); }), std::runtime_error);
  o.step(a.p(), a.g(), hyper);
  EXPECT_EQ(o.steps()[0], steps[0] + 1);
  o.load(ck);
  EXPECT_EQ(all_records(o), records);
}

TEST(offload_optimizer, bad_arguments_are_refused) {
  scratch_dir dir;
  optimizer_options o = small_options(dir);
  o.group_bytes = 100;
  EXPECT_THROW(offloaded_optimizer(numels, o), std::invalid_argument);
  o = small_options(dir);
  o.pipeline.pinned_budget = 3 * 8192;  // one record
  EXPECT_THROW(offloaded_optimizer(numels, o), std::invalid_argument);
  o = small_options(dir);
  o.simd = 7;
  EXPECT_THROW(offloaded_optimizer(numels, o), std::invalid_argument);
  // At the edges: 4096-byte groups are the smallest taken, a budget of exactly two records
  // is enough (small_options' records are 3 x 8192 bytes), and each level of SIMD is taken
  // as asked where the processor has it and refused where it has not; -1 picks the best.
  o = small_options(dir);
  o.group_bytes = 4095;
  EXPECT_THROW(offloaded_optimizer(numels, o), std::invalid_argument);
  o.group_bytes = 4096;
  EXPECT_NO_THROW(offloaded_optimizer(numels, o));
  o = small_options(dir);
  o.pipeline.pinned_budget = 2 * 3 * 8192 - 1;
  EXPECT_THROW(offloaded_optimizer(numels, o), std::invalid_argument);
  o.pipeline.pinned_budget = 2 * 3 * 8192;
  EXPECT_NO_THROW(offloaded_optimizer(numels, o));
  for (const simd_level level : {simd_level::scalar, simd_level::avx2, simd_level::avx512}) {
    o = small_options(dir);
    o.simd = static_cast<int>(level);
    if (simd_supported(level)) {
      EXPECT_EQ(offloaded_optimizer(numels, o).simd(), level);
    } else {
      EXPECT_THROW(offloaded_optimizer(numels, o), std::invalid_argument);
    }
  }
  o.simd = -1;
  EXPECT_EQ(offloaded_optimizer(numels, o).simd(), best_simd_level());
  offloaded_optimizer ok(numels, small_options(dir));
  model_params a(numels);
  const std::vector<param_hyper> hyper(numels.size());
  EXPECT_THROW(ok.initialize({}), std::invalid_argument);
  ok.initialize(a.cp());
  EXPECT_THROW(ok.step(a.p(), a.g(), {}), std::invalid_argument);
  auto p = a.p();
  p[0] = nullptr;
  EXPECT_THROW(ok.step(p, a.g(), hyper), std::invalid_argument);
  // restore_parameters: the same checks, and nothing written where one fails.
  const auto before = a.values;
  EXPECT_THROW(ok.restore_parameters(p), std::invalid_argument);  // a null parameter
  EXPECT_THROW(ok.restore_parameters(std::vector<float*>(numels.size() - 1)), std::invalid_argument);
  EXPECT_EQ(a.values, before);
  // rewrite with step counts for another number of parameters: refused before any record is
  // read or edited; the records and step counts stay.
  const std::vector<float> records = all_records(ok);
  const std::vector<std::uint64_t> steps = ok.steps();
  bool edited = false;
  try {
    ok.rewrite([&](const auto&, float* r) { edited = true; r[0] += 1; }, std::vector<std::uint64_t>(numels.size() + 1, 7));
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "offloaded_optimizer::rewrite: " + std::to_string(numels.size() + 1) +
                                         " step counts for " + std::to_string(numels.size()) + " parameters");
  }
  EXPECT_FALSE(edited);
  EXPECT_EQ(all_records(ok), records);
  EXPECT_EQ(ok.steps(), steps);
  offloaded_optimizer fresh(numels, small_options(dir));
  EXPECT_THROW(fresh.restore_parameters(a.p()), std::logic_error);  // before initialize
  optimizer_options no_master = small_options(dir);
  no_master.offload_master = false;
  offloaded_optimizer without(numels, no_master);
  without.initialize(a.cp());
  EXPECT_THROW(without.restore_parameters(a.p()), std::logic_error);
  EXPECT_EQ(a.values, before);
}

// ------------------------------------------------------------------------------ fork

// Every regular file under `root`, with a hash of its contents.
std::map<std::string, std::size_t> files_under(const std::filesystem::path& root) {
  std::map<std::string, std::size_t> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out[e.path().string()] = std::hash<std::string>{}(std::string(std::istreambuf_iterator<char>(in), {}));
  }
  return out;
}

TEST(offload_fork, a_forked_child_is_refused_and_leaves_the_parents_files_and_transfers_alone) {
  scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  // An optimizer after one step, and a swap space of its own with a committed tensor and a
  // write of its next generation in flight across the fork, read through a pipeline.
  auto o = std::make_unique<offloaded_optimizer>(numels, small_options(dir));
  model_params a(numels);
  const std::vector<param_hyper> hyper(numels.size());
  o->initialize(a.cp());
  o->step(a.p(), a.g(), hyper);
  swap_space_options so;
  so.folders = {(dir.path / "space").string()};
  std::filesystem::create_directory(so.folders[0]);
  so.stripe_bytes = 1 << 20;
  auto space = std::make_unique<swap_space>(so);
  constexpr std::size_t bytes = std::size_t{24} << 20;
  const std::size_t id = space->add("big", bytes);
  aligned_floats first(bytes), second(bytes);
  std::memcpy(first.data, pattern(bytes, 1).data(), bytes);
  std::memcpy(second.data, pattern(bytes, 2).data(), bytes);
  auto t = space->write(id, first.data);
  space->finish(t);
  space->commit(id);
  memory::pinned_pool pool({.alignment = 4096});
  auto pipeline = std::make_unique<prefetch_pipeline>(*space, pool, std::vector<std::size_t>{id},
                                                      pipeline_options{2 * bytes, 0});
  auto in_flight = space->write(id, second.data);
  const auto before = files_under(dir.path);

  const int rc = in_forked_child([&] {
    const char* sp = "a swap space";
    aligned_floats b(4096);
    int bad = refused_in_child(sp, [&] { space->add("child", 4096); });
    bad |= refused_in_child(sp, [&] { space->size(); });
    bad |= refused_in_child(sp, [&] { space->name(id); });
    bad |= refused_in_child(sp, [&] { space->bytes(id); });
    bad |= refused_in_child(sp, [&] { space->padded_bytes(id); });
    bad |= refused_in_child(sp, [&] { space->committed(id); });
    bad |= refused_in_child(sp, [&] { space->read(id, first.data); });
    bad |= refused_in_child(sp, [&] { space->write(id, first.data); });
    bad |= refused_in_child(sp, [&] { space->finish(in_flight); });
    bad |= refused_in_child(sp, [&] { space->commit(id); });
    bad |= refused_in_child(sp, [&] { space->stats(); });
    bad |= refused_in_child(sp, [&] { space->path(id, 0, 0); });
    const char* pl = "a prefetch pipeline";
    bad |= refused_in_child(pl, [&] { pipeline->acquire(0); }) << 1;
    bad |= refused_in_child(pl, [&] { pipeline->release(0, false); }) << 1;
    bad |= refused_in_child(pl, [&] { pipeline->finish(); }) << 1;
    bad |= refused_in_child(pl, [&] { pipeline->written(); }) << 1;
    bad |= refused_in_child(pl, [&] { pipeline->stats(); }) << 1;
    const char* op = "an offloaded optimizer";
    bad |= refused_in_child(op, [&] { o->initialize(a.cp()); }) << 2;
    bad |= refused_in_child(op, [&] { o->step(a.p(), a.g(), hyper); }) << 2;
    bad |= refused_in_child(op, [&] { o->steps(); }) << 2;
    bad |= refused_in_child(op, [&] { o->initialized(); }) << 2;
    bad |= refused_in_child(op, [&] { o->visit([](const auto&, const float*) {}); }) << 2;
    bad |= refused_in_child(op, [&] { o->rewrite([](const auto&, float*) {}); }) << 2;
    bad |= refused_in_child(op, [&] { o->save((dir.path / "child.ckpt").string()); }) << 2;
    bad |= refused_in_child(op, [&] { o->load((dir.path / "child.ckpt").string()); }) << 2;
    // Dropped here: nothing waited for, no swap file removed.
    pipeline.reset();
    space.reset();
    o.reset();
    return bad;
  });
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(files_under(dir.path), before);  // every file the parent's, unchanged

  {
    const swap::testing::hang_guard guard("the parent's write after the fork", std::chrono::seconds(60));
    space->finish(in_flight);
  }
  space->commit(id);
  aligned_floats back(bytes);
  auto r = space->read(id, back.data);
  space->finish(r);
  EXPECT_EQ(std::memcmp(back.data, second.data, bytes), 0);
  o->step(a.p(), a.g(), hyper);
  EXPECT_EQ(a.values, values_after_two_clean_steps());
  EXPECT_EQ(o->steps(), (std::vector<std::uint64_t>{2, 2, 0, 2, 2}));
  pipeline.reset();
}

}  // namespace
}  // namespace tensormem::offload
