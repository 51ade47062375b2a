// `tensormem swap-bench`: tensors out to a directory and back through the swapper.

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "tensormem/memory/errors.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"
#include "tensormem/swap/tensor_swapper.hpp"

namespace tensormem::cli {

namespace {

struct swap_bench_options {
  std::string dir;
  std::uint64_t bytes = std::uint64_t{4} << 30;
  std::uint64_t block = std::uint64_t{1} << 20;
  std::uint64_t tensor_bytes = std::uint64_t{64} << 20;
  unsigned queue_depth = 32;
  std::string engine = "uring";
  bool buffered = false;
  bool direct_flag = false;
  bool no_checksum = false;
  bool json = false;
  double overlap_seconds = 0;
  bool no_reuse = false;
  std::uint64_t pack_below = 0;
  bool poll = false;
  bool allow_unlocked = false;
};

// A compute loop: `iterations` rounds of dependent floating-point work on the caller's
// thread (what a training step does between queuing a swap-out and waiting for it).
double compute(std::uint64_t iterations) {
  double x = 1.0;
  for (std::uint64_t i = 0; i < iterations; ++i) x = x * 1.0000001 + 1e-9;
  return x;
}

// The longest --overlap compute loop (the loop's calibrated iteration count stays far from
// 2^64 below it).
constexpr double most_overlap_seconds = 86400;

// The run's files live in a private folder made inside --dir; it is removed however the run
// ends: by this object's destructor, or by a watcher thread when SIGINT, SIGTERM or SIGHUP
// arrives (Ctrl-C during a 4 GiB run would otherwise leave 8 GiB of files). The signals are
// blocked in every thread of the run (the swapper's threads inherit the mask) and taken by
// the watcher, which removes the folder and then lets the signal take its default action.
// A signal the tool was started with ignored (a background job's SIGINT, nohup's SIGHUP)
// stays ignored.
class private_folder {
 public:
  explicit private_folder(const std::string& parent) {
    std::string templ = (std::filesystem::path(parent) / "tensormem-swap-bench-XXXXXX").string();
    if (mkdtemp(templ.data()) == nullptr) {
      throw std::system_error(errno, std::generic_category(), "cannot make a folder in " + parent);
    }
    path_ = templ;
    sigemptyset(&watched_);
    for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
      struct sigaction now {};
      if (sigaction(sig, nullptr, &now) == 0 && now.sa_handler != SIG_IGN) sigaddset(&watched_, sig);
    }
    pthread_sigmask(SIG_BLOCK, &watched_, &old_mask_);
    watcher_ = std::thread([this] { watch(); });
  }
  ~private_folder() {
    stop_ = true;
    watcher_.join();
    remove();
    // A signal that came after the watcher stopped is delivered here, the folder gone.
    pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
  }
  private_folder(const private_folder&) = delete;
  private_folder& operator=(const private_folder&) = delete;
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  void remove() const noexcept {
    // A commit in flight may put a file back between the walk and the final rmdir; retry.
    for (int attempt = 0; attempt < 100; ++attempt) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
      if (!ec && !std::filesystem::exists(path_, ec)) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  void watch() {
    const timespec tick{0, 50'000'000};
    while (!stop_) {
      const int sig = sigtimedwait(&watched_, nullptr, &tick);
      if (sig <= 0) continue;
      remove();
      ::signal(sig, SIG_DFL);
      sigset_t one;
      sigemptyset(&one);
      sigaddset(&one, sig);
      pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
      raise(sig);
      _exit(128 + sig);
    }
  }

  std::filesystem::path path_;
  sigset_t watched_{};
  sigset_t old_mask_{};
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

void run_swap_bench(const swap_bench_options& o) {
  if (!std::filesystem::is_directory(o.dir)) throw std::invalid_argument(o.dir + " is not a directory");
  if (o.bytes < o.tensor_bytes) {
    throw std::invalid_argument("--bytes " + std::to_string(o.bytes) + " is less than --tensor-bytes " +
                                std::to_string(o.tensor_bytes) + "; lower --tensor-bytes");
  }
  const std::uint64_t count = o.bytes / o.tensor_bytes;
  // The run holds every tensor in page-locked memory at once and keeps up to twice their
  // bytes on disk (the files and, while they are rewritten, their next versions). Refused
  // before anything is made when this machine cannot give that: locking more than the
  // memory there is gets the process killed, not an error.
  const std::uint64_t held = count * o.tensor_bytes;
  const std::size_t memory = memory::physical_memory_bytes();
  if (memory != std::numeric_limits<std::size_t>::max() && held > memory / 2) {
    throw std::invalid_argument(fmt::format(
        "--bytes {}: the run holds {} of tensors in page-locked memory, more than half of this machine's {}; "
        "lower --bytes",
        o.bytes, human_bytes(held), human_bytes(memory)));
  }
  if (const std::uint64_t available = std::filesystem::space(o.dir).available; held > available / 2) {
    throw std::invalid_argument(fmt::format(
        "--bytes {}: the run needs up to {} of free space in {} (its files and their next versions), {} "
        "available; lower --bytes",
        o.bytes, human_bytes(held > std::numeric_limits<std::uint64_t>::max() / 2 ? held : 2 * held), o.dir,
        human_bytes(available)));
  }
  // Before the pool and the swapper: removed after them, signals blocked in their threads.
  const private_folder folder(o.dir);
  memory::pinned_pool pool({.slab_bytes = static_cast<std::size_t>(std::max<std::uint64_t>(o.tensor_bytes, 1 << 20)),
                            .allow_unlocked_fallback = o.allow_unlocked});
  swap::tensor_swapper swapper(
      pool, {.engine = o.engine == "threads" ? io::engine_kind::threads : io::engine_kind::uring,
             .queue_depth = o.queue_depth,
             .block_bytes = static_cast<std::size_t>(o.block),
             .staging_buffers = 4,
             .direct = !o.buffered,
             .checksums = !o.no_checksum,
             .reuse_files = !o.no_reuse,
             .pack_below = static_cast<std::size_t>(o.pack_below)});
  std::vector<swap::tensor_ref> tensors;
  std::vector<std::string> paths;
  for (std::uint64_t i = 0; i < count; ++i) {
    auto* p = static_cast<std::byte*>(pool.allocate(static_cast<std::size_t>(o.tensor_bytes), 4096));
    for (std::uint64_t k = 0; k < o.tensor_bytes; k += 4096) p[k] = static_cast<std::byte>(i + k);
    tensors.push_back({p, static_cast<std::size_t>(o.tensor_bytes)});
    paths.push_back((folder.path() / fmt::format("{}.bin", i)).string());
  }
  struct free_on_exit {
    memory::pinned_pool& pool;
    std::vector<swap::tensor_ref>& tensors;
    ~free_on_exit() {
      for (const auto& t : tensors) pool.free(t.data);
    }
  } release{pool, tensors};
  auto check = [](const std::vector<swap::swap_result>& results) {
    for (const auto& r : results) {
      if (r.error != 0) throw std::runtime_error(r.message);
    }
  };
  const double total = static_cast<double>(count * o.tensor_bytes);
  progress_line progress;
  auto timed = [&](bool out, const char* what) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t ticket = out ? swapper.swap_out(tensors, paths) : swapper.swap_in(paths, tensors);
    // On a terminal: tensors done and the rate so far, every 0.1 s, while the swapper works.
    while (progress.enabled() && !swapper.done(ticket)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const std::uint64_t finished = count - swapper.unfinished(ticket);
      const double s = seconds_since(t0);
      progress.show(fmt::format("swap-bench: {} {} of {} ({:.2f} GB/s)", what,
                                human_bytes(finished * o.tensor_bytes), human_bytes(count * o.tensor_bytes),
                                static_cast<double>(finished * o.tensor_bytes) / s / 1e9));
    }
    check(swapper.wait(ticket));
    return seconds_since(t0);
  };
  // Fresh files (as a driver that writes new files sees it), then rewrites in the steady
  // state (with reuse: into the spare files, as fio measures after laying its file out),
  // then reads.
  const double fresh_seconds = timed(true, "writing fresh files");
  // The first rewrite leaves a spare beside every file (or, packed, the pack at twice the
  // live bytes: every slot freed after it is reused by the next pass).
  if (!o.no_reuse || o.pack_below > 0) (void)timed(true, "rewriting");
  const double rewrite_seconds = timed(true, "rewriting");
  const double read_seconds = timed(false, "reading");
  progress.clear();
  const swap::swap_stats s = swapper.stats();
  const std::uint64_t unlocked_slabs = pool.stats().unlocked_fallbacks;

  nlohmann::json overlap = nullptr;
  if (o.overlap_seconds > 0) {
    // Calibrate the compute loop to the asked duration alone, then run the same work while a
    // swap-out of every tensor is in flight. Ratio: total / (swap alone + compute alone);
    // 0.5 is perfect overlap of equal parts, 1.0 none.
    std::uint64_t iterations = 1 << 20;
    double alone = 0;
    for (;;) {
      const auto t0 = std::chrono::steady_clock::now();
      volatile double sink = compute(iterations);
      (void)sink;
      alone = seconds_since(t0);
      if (alone >= o.overlap_seconds * 0.5) break;
      iterations *= 2;
    }
    iterations = static_cast<std::uint64_t>(static_cast<double>(iterations) * o.overlap_seconds / alone);
    const auto c0 = std::chrono::steady_clock::now();
    volatile double sink = compute(iterations);
    (void)sink;
    const double compute_alone = seconds_since(c0);
    const double swap_alone = rewrite_seconds;
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t ticket = swapper.swap_out(tensors, paths);
    const double queue_seconds = seconds_since(t0);
    volatile double sink2 = compute(iterations);
    (void)sink2;
    const double compute_done = seconds_since(t0);
    check(swapper.wait(ticket));
    const double together = seconds_since(t0);
    overlap = {{"swap_alone_s", swap_alone}, {"compute_alone_s", compute_alone},
               {"together_s", together}, {"compute_with_io_s", compute_done},
               {"swap_out_call_s", queue_seconds}, {"ratio", together / (swap_alone + compute_alone)}};
  }
  nlohmann::json poll = nullptr;
  if (o.poll) {
    // How long the caller's done() takes while the swapper works: a swap-out and a swap-in
    // of every tensor, done() called every 100 us until it says yes, each call timed.
    std::vector<double> micros;
    for (const bool out : {true, false}) {
      const std::uint64_t ticket = out ? swapper.swap_out(tensors, paths) : swapper.swap_in(paths, tensors);
      for (;;) {
        const auto t0 = std::chrono::steady_clock::now();
        const bool finished = swapper.done(ticket);
        micros.push_back(seconds_since(t0) * 1e6);
        if (finished) break;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      check(swapper.wait(ticket));
    }
    std::sort(micros.begin(), micros.end());
    const auto at = [&](double q) { return micros[static_cast<std::size_t>(q * static_cast<double>(micros.size() - 1))]; };
    poll = {{"polls", micros.size()}, {"median_us", at(0.5)}, {"p99_us", at(0.99)}, {"p999_us", at(0.999)},
            {"max_us", micros.back()}};
  }
  if (o.json) {
    nlohmann::json j;
    j["write_gbps"] = total / rewrite_seconds / 1e9;
    j["write_fresh_gbps"] = total / fresh_seconds / 1e9;
    j["read_gbps"] = total / read_seconds / 1e9;
    j["engine"] = s.engine;
    j["direct"] = s.direct;
    j["checksums"] = s.checksums;
    j["bytes"] = count * o.tensor_bytes;
    j["tensors"] = count;
    j["block"] = o.block;
    j["queue_depth"] = o.queue_depth;
    j["fallback"] = s.fallback;
    j["synchronous_requests"] = s.synchronous_requests;
    j["registered_staging"] = s.registered_staging;
    j["overlap"] = overlap;
    j["poll"] = poll;
    j["reuse_files"] = !o.no_reuse;
    j["pack_below"] = o.pack_below;
    j["pack_file_bytes"] = s.pack_file_bytes;
    j["unlocked_slabs"] = unlocked_slabs;
    std::cout << json_text(j) << '\n';
    return;
  }
  std::cout << fmt::format("swap-bench: {} tensors of {} in {}, {} requests, queue depth {}\n", count,
                           human_bytes(o.tensor_bytes), o.dir, human_bytes(o.block), o.queue_depth)
            << fmt::format("engine {}, {} I/O, checksums {}\n", s.engine,
                           s.direct ? "O_DIRECT" : "buffered", s.checksums ? "on" : "off")
            << (o.pack_below > 0 ? fmt::format("packed: tensors of at most {} in pack files of {} in all\n",
                                               human_bytes(o.pack_below), human_bytes(s.pack_file_bytes))
                                 : std::string());
  if (!s.fallback.empty()) std::cout << "fallback: " << s.fallback << '\n';
  if (unlocked_slabs != 0) {
    std::cout << "memory: " << unlocked_memory_note(unlocked_slabs, "the tensors and staging") << '\n';
  }
  std::cout << fmt::format("write {:.2f} GB/s (fresh files {:.2f} GB/s), read {:.2f} GB/s\n",
                           total / rewrite_seconds / 1e9, total / fresh_seconds / 1e9,
                           total / read_seconds / 1e9);
  if (!overlap.is_null()) {
    std::cout << fmt::format("overlap: swap-out alone {:.3f} s, compute alone {:.3f} s, together {:.3f} s "
                             "(swap_out() returned in {:.4f} s): ratio {:.2f}\n",
                             overlap["swap_alone_s"].get<double>(), overlap["compute_alone_s"].get<double>(),
                             overlap["together_s"].get<double>(), overlap["swap_out_call_s"].get<double>(),
                             overlap["ratio"].get<double>());
  }
  if (!poll.is_null()) {
    std::cout << fmt::format("done() while swapping out and in: {} calls, median {:.1f} us, p99 {:.1f} us, "
                             "p99.9 {:.1f} us, max {:.1f} us\n",
                             poll["polls"].get<std::size_t>(), poll["median_us"].get<double>(),
                             poll["p99_us"].get<double>(), poll["p999_us"].get<double>(),
                             poll["max_us"].get<double>());
  }
}

}  // namespace

void add_swap_bench_command(CLI::App& app) {
  auto o = std::make_shared<swap_bench_options>();
  CLI::App* cmd = app.add_subcommand("swap-bench", "Swap tensors out to a directory and back; GB/s each way");
  cmd->add_option("--dir", o->dir, "directory for the swap files (in a folder of their own, removed at the end, on Ctrl-C too)")
      ->required()
      ->check(path_given());
  cmd->add_option("--bytes", o->bytes, "total bytes (default 4 GiB)")->check(positive_count());
  cmd->add_option("--block", o->block, "bytes per I/O request, a multiple of 4096 (default 1 MiB)")
      ->check(positive_count(std::numeric_limits<decltype(o->block)>::max(), swap::io_alignment));
  cmd->add_option("--tensor-bytes", o->tensor_bytes, "bytes per tensor (default 64 MiB)")
      ->check(positive_count());
  cmd->add_option("--queue-depth", o->queue_depth, "requests in flight (default 32)")
      ->check(positive_count(io::max_queue_depth));
  cmd->add_option("--engine", o->engine, "uring or threads")->check(CLI::IsMember({"uring", "threads"}));
  auto* direct = cmd->add_flag("--direct", o->direct_flag, "O_DIRECT (the default)");
  auto* buffered = cmd->add_flag("--buffered", o->buffered, "page-cache I/O");
  direct->excludes(buffered);
  cmd->add_flag("--no-checksum", o->no_checksum, "skip CRC-32C");
  cmd->add_flag("--no-reuse", o->no_reuse, "write every version to a new file (no spare files)");
  cmd->add_option("--pack-below", o->pack_below,
                  "pack tensors of at most this many bytes into one file per directory (default 0: a file per tensor)")
      ->check(whole_number("BYTES>=0"));
  cmd->add_option("--overlap", o->overlap_seconds,
                  "also time a swap-out beside a compute loop of this many seconds; print the overlap ratio")
      ->check(non_negative_seconds(most_overlap_seconds));
  cmd->add_flag("--poll", o->poll,
                "also time the caller's done() every 100 us through a swap-out and a swap-in; print its latencies");
  cmd->add_flag("--allow-unlocked", o->allow_unlocked,
                "where the memory-lock limit (ulimit -l) refuses page-locked memory, run from unlocked memory and "
                "say so (without it such a run stops at the limit's error)");
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->callback([o] {
    try {
      run_swap_bench(*o);
    } catch (const memory::lock_limit_error& e) {
      if (o->allow_unlocked) throw;
      throw std::runtime_error(std::string(e.what()) + " (here: --allow-unlocked)");
    }
  });
}

}  // namespace tensormem::cli
