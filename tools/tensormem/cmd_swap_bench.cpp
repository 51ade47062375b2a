// `tensormem swap-bench`: tensors out to a directory and back through the swapper.

#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "report.hpp"
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
};

void run_swap_bench(const swap_bench_options& o) {
  if (!std::filesystem::is_directory(o.dir)) throw std::invalid_argument(o.dir + " is not a directory");
  if (o.bytes < o.tensor_bytes) {
    throw std::invalid_argument("--bytes " + std::to_string(o.bytes) + " is less than --tensor-bytes " +
                                std::to_string(o.tensor_bytes) + "; lower --tensor-bytes");
  }
  const std::uint64_t count = o.bytes / o.tensor_bytes;
  memory::pinned_pool pool({.slab_bytes = static_cast<std::size_t>(o.tensor_bytes)});
  swap::tensor_swapper swapper(
      pool, {.engine = o.engine == "threads" ? io::engine_kind::threads : io::engine_kind::uring,
             .queue_depth = o.queue_depth,
             .block_bytes = static_cast<std::size_t>(o.block),
             .staging_buffers = 4,
             .direct = !o.buffered,
             .checksums = !o.no_checksum});
  std::vector<swap::tensor_ref> tensors;
  std::vector<std::string> paths;
  // The files go away however the run ends (success, a failed transfer, an exception).
  struct remove_on_exit {
    std::vector<std::string>& paths;
    ~remove_on_exit() {
      std::error_code ec;
      for (const std::string& p : paths) std::filesystem::remove(p, ec);
    }
  } cleanup{paths};
  for (std::uint64_t i = 0; i < count; ++i) {
    auto* p = static_cast<std::byte*>(pool.allocate(static_cast<std::size_t>(o.tensor_bytes), 4096));
    for (std::uint64_t k = 0; k < o.tensor_bytes; k += 4096) p[k] = static_cast<std::byte>(i + k);
    tensors.push_back({p, static_cast<std::size_t>(o.tensor_bytes)});
    paths.push_back((std::filesystem::path(o.dir) / fmt::format("tensormem-swap-{}.bin", i)).string());
  }
  auto check = [](const std::vector<swap::swap_result>& results) {
    for (const auto& r : results) {
      if (r.error != 0) throw std::runtime_error(r.message);
    }
  };
  // A first pass lays the files out (as fio does before it measures); the timed pass
  // overwrites them, then reads them back.
  check(swapper.wait(swapper.swap_out(tensors, paths)));
  const swap::swap_stats laid = swapper.stats();
  check(swapper.wait(swapper.swap_out(tensors, paths)));
  check(swapper.wait(swapper.swap_in(paths, tensors)));
  const swap::swap_stats s = swapper.stats();
  const double write_seconds = s.seconds_out - laid.seconds_out;
  const double write_gbps = static_cast<double>(s.bytes_out - laid.bytes_out) / write_seconds / 1e9;
  const double read_gbps = s.read_gbps();
  for (const auto& t : tensors) pool.free(t.data);
  if (o.json) {
    nlohmann::json j;
    j["write_gbps"] = write_gbps;
    j["read_gbps"] = read_gbps;
    j["engine"] = s.engine;
    j["direct"] = s.direct;
    j["checksums"] = s.checksums;
    j["bytes"] = count * o.tensor_bytes;
    j["block"] = o.block;
    j["queue_depth"] = o.queue_depth;
    j["fallback"] = s.fallback;
    j["registered_staging"] = s.registered_staging;
    std::cout << j.dump() << '\n';
    return;
  }
  std::cout << fmt::format("swap-bench: {} tensors of {} in {}, {} requests, queue depth {}\n", count,
                           human_bytes(o.tensor_bytes), o.dir, human_bytes(o.block), o.queue_depth)
            << fmt::format("engine {}, {} I/O, checksums {}\n", s.engine,
                           s.direct ? "O_DIRECT" : "buffered", s.checksums ? "on" : "off");
  if (!s.fallback.empty()) std::cout << "fallback: " << s.fallback << '\n';
  std::cout << fmt::format("write {:.2f} GB/s, read {:.2f} GB/s\n", write_gbps, read_gbps);
}

}  // namespace

void add_swap_bench_command(CLI::App& app) {
  auto o = std::make_shared<swap_bench_options>();
  CLI::App* cmd = app.add_subcommand("swap-bench", "Swap tensors out to a directory and back; GB/s each way");
  cmd->add_option("--dir", o->dir, "directory for the swap files")->required();
  cmd->add_option("--bytes", o->bytes, "total bytes (default 4 GiB)")->check(CLI::PositiveNumber);
  cmd->add_option("--block", o->block, "bytes per I/O request (default 1 MiB)")->check(CLI::PositiveNumber);
  cmd->add_option("--tensor-bytes", o->tensor_bytes, "bytes per tensor (default 64 MiB)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--queue-depth", o->queue_depth, "requests in flight (default 32)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--engine", o->engine, "uring or threads")->check(CLI::IsMember({"uring", "threads"}));
  auto* direct = cmd->add_flag("--direct", o->direct_flag, "O_DIRECT (the default)");
  auto* buffered = cmd->add_flag("--buffered", o->buffered, "page-cache I/O");
  direct->excludes(buffered);
  cmd->add_flag("--no-checksum", o->no_checksum, "skip CRC-32C");
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->callback([o] { run_swap_bench(*o); });
}

}  // namespace tensormem::cli
