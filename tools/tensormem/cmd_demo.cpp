// `tensormem demo`: the main job on the built-in model, a transformer training step.

#include <stdlib.h>

#include <iostream>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <sstream>
#include <limits>
#include <optional>
#include <string>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "arena_ops.hpp"
#include "commands.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/graph.hpp"
#include "tensormem/core/planner.hpp"
#include "tensormem/core/replay.hpp"
#include "tensormem/core/tlsf_allocator.hpp"
#include "tensormem/core/transformer_step.hpp"
#include "tensormem/memory/host_resource.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"
#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/swap/tensor_swapper.hpp"
#include "timed_replay.hpp"

namespace tensormem::cli {

namespace {

struct demo_options {
  core::transformer_config model;
  std::uint64_t alignment = 256;
  double plan_seconds = 2.0;
  bool json = false;
};

struct online_row {
  std::string name;
  std::uint64_t high_water = 0;
  double ns_per_op = 0;  // median over the replays
  std::size_t replays = 0;
};

template <class Allocator>
online_row run_online(const std::string& name, const std::vector<core::buffer>& buffers,
                      std::uint64_t alignment) {
  const timed_replay t = replay_timed<Allocator>(buffers, alignment);
  return {name, t.first.high_water, t.ns_per_op, t.replays};
}

struct arena_row {
  std::string policy;
  arena::arena_stats stats;
  bool verified = false;
};

// The arena section: a ZeRO-3-like gather/release sequence under both policies.
std::vector<arena_row> run_arena_section(const arena_scenario& sc) {
  std::istringstream in(sc.script);
  const std::vector<arena_op> ops = parse_arena_ops(in, "zero3");
  std::vector<arena_row> rows;
  memory::host_resource host;
  for (const auto& [name, policy] : {std::pair{"minimal-move", arena::defrag_policy::minimal_move},
                                     std::pair{"full compaction", arena::defrag_policy::full_compaction}}) {
    arena::contiguous_arena a(host, sc.capacity, {.alignment = sc.alignment, .policy = policy});
    const arena_run_result r = run_arena_ops(a, ops, true, 64);
    if (!r.failed_lines.empty()) throw std::logic_error("arena demo step failed: " + r.failures[0]);
    rows.push_back({name, a.stats(), r.verified.value_or(false)});
  }
  return rows;
}

struct swap_section {
  std::string dir;              // where the files went (removed afterwards)
  std::size_t candidates = 0;   // layer 0's saved activations
  std::uint64_t candidate_bytes = 0;
  std::size_t tensors = 0;      // those swapped: as many as the budget holds, in order
  std::uint64_t bytes = 0;
  std::uint64_t budget = 0;     // bytes the section may lock and write
  std::string budget_basis;     // what set the budget
  std::string skipped;          // non-empty: why nothing was swapped
  std::string error;            // non-empty: the first failed transfer
  std::uint64_t unlocked_slabs = 0;
  swap::swap_stats stats;
  bool verified = false;
};

// Layer 0's saved activations: the buffers of layer 0 (not gradients) that live at least
// three steps, that is until the backward pass.
std::vector<std::size_t> layer0_saved_activations(const core::graph& g,
                                                  const core::graph_lifetimes& life) {
  std::vector<std::size_t> chosen;
  for (std::size_t k = 0; k < life.buffers.size(); ++k) {
    const core::graph_tensor& t = g.tensors()[life.tensor_of[k]];
    if (t.name.rfind("l0.", 0) == 0 && t.name.find(".grad") == std::string::npos &&
        life.buffers[k].upper - life.buffers[k].lower >= 3) {
      chosen.push_back(k);
    }
  }
  return chosen;
}

// The swap section: layer 0's saved activations out to a temporary directory and back. The
// tensors are held in host memory and written to disk, so the section takes only as many as
// fit in a quarter of the machine's memory and half the free space of the temporary
// directory; without the right to lock that much memory it runs from unlocked memory and says
// so. When it cannot run at all, `skipped` says why and the rest of the demo stands.
swap_section run_swap_section(const core::graph& g, const core::graph_lifetimes& life) {
  namespace fs = std::filesystem;
  swap_section out;
  const std::vector<std::size_t> candidates = layer0_saved_activations(g, life);
  out.candidates = candidates.size();
  for (const std::size_t k : candidates) out.candidate_bytes += life.buffers[k].bytes;
  std::error_code ec;
  const fs::path tmp = fs::temp_directory_path(ec);
  if (ec) {
    out.skipped = "no temporary directory (" + ec.message() + "); set TMPDIR to a writable folder";
    return out;
  }
  std::string templ = (tmp / "tensormem-demo-XXXXXX").string();
  if (mkdtemp(templ.data()) == nullptr) {
    out.skipped = "cannot create a folder in " + tmp.string() + " (" + std::strerror(errno) +
                  "); set TMPDIR to a writable folder";
    return out;
  }
  const fs::path dir = templ;
  out.dir = dir.string();
  // Removed however the section ends, after the swapper and the pool below are gone.
  struct remove_on_exit {
    const fs::path& path;
    ~remove_on_exit() {
      std::error_code ignored;
      fs::remove_all(path, ignored);
    }
  } cleanup{dir};
  const std::uint64_t memory = memory::physical_memory_bytes();
  const std::uint64_t memory_share = memory / 4;
  const fs::space_info space = fs::space(dir);
  const std::uint64_t disk_share = space.available / 2;
  out.budget = std::min(memory_share, disk_share);
  out.budget_basis = memory_share <= disk_share
                         ? "a quarter of this machine's memory, " + human_bytes(memory)
                         : "half the free space of " + tmp.string() + ", " + human_bytes(space.available);
  std::vector<std::size_t> chosen;
  for (const std::size_t k : candidates) {
    const std::uint64_t b = life.buffers[k].bytes;
    if (b <= out.budget - out.bytes) {
      chosen.push_back(k);
      out.bytes += b;
    }
  }
  out.tensors = chosen.size();
  if (chosen.empty()) {
    out.skipped = "layer 0's saved activations (" + human_bytes(out.candidate_bytes) +
                  ") are each larger than the budget of " + human_bytes(out.budget) + " (" +
                  out.budget_basis + ")";
    return out;
  }
  // Slabs no larger than what is swapped (a 256 MiB slab alone passed a container's 256 MiB):
  // the pool then maps about the chosen bytes, within the budget.
  const std::uint64_t slab = std::min<std::uint64_t>(std::uint64_t{256} << 20, (out.bytes + (2U << 20) - 1) / (2U << 20) * (2U << 20));
  memory::pinned_pool pool({.slab_bytes = static_cast<std::size_t>(slab), .allow_unlocked_fallback = true});
  std::optional<swap::tensor_swapper> made;
  try {
    made.emplace(pool);
  } catch (const std::system_error& e) {
    if (e.code() != std::errc::resource_unavailable_try_again) throw;
    // Its threads cannot start (a limit on threads): the rest of the demo needs none.
    out.skipped = e.what();
    return out;
  }
  swap::tensor_swapper& swapper = *made;
  std::vector<swap::tensor_ref> tensors;
  std::vector<std::string> paths;
  for (const std::size_t k : chosen) {
    const core::graph_tensor& t = g.tensors()[life.tensor_of[k]];
    auto* p = static_cast<std::byte*>(pool.allocate(static_cast<std::size_t>(t.bytes), 4096));
    for (std::size_t i = 0; i < t.bytes; i += 64) p[i] = static_cast<std::byte>(k * 31 + i / 64);
    tensors.push_back({p, static_cast<std::size_t>(t.bytes)});
    paths.push_back((dir / t.name).string());
  }
  auto note_errors = [&](const std::vector<swap::swap_result>& results) {
    for (const auto& r : results) {
      if (r.error != 0 && out.error.empty()) {
        out.error = r.message.find(r.path) != std::string::npos ? r.message : r.path + ": " + r.message;
      }
    }
  };
  note_errors(swapper.wait(swapper.swap_out(tensors, paths)));
  if (out.error.empty()) {
    for (const auto& t : tensors) std::memset(t.data, 0, t.bytes);
    note_errors(swapper.wait(swapper.swap_in(paths, tensors)));
  }
  bool ok = out.error.empty();
  for (std::size_t n = 0; n < chosen.size() && ok; ++n) {
    const auto* p = static_cast<const std::byte*>(tensors[n].data);
    for (std::size_t i = 0; i < tensors[n].bytes && ok; i += 64) {
      ok = p[i] == static_cast<std::byte>(chosen[n] * 31 + i / 64);
    }
  }
  out.verified = ok;
  out.stats = swapper.stats();
  out.unlocked_slabs = pool.stats().unlocked_fallbacks;
  for (const auto& t : tensors) pool.free(t.data);
  return out;
}

void print_swap_section(const swap_section& s) {
  if (!s.skipped.empty()) {
    std::cout << "\nswap: skipped: " << s.skipped << '\n';
    return;
  }
  const std::string which =
      s.tensors == s.candidates
          ? fmt::format("layer 0's {} saved activations ({})", s.tensors, human_bytes(s.bytes))
          : fmt::format("{} of layer 0's {} saved activations ({} of {}; the budget is {}: {})",
                        s.tensors, s.candidates, human_bytes(s.bytes), human_bytes(s.candidate_bytes),
                        human_bytes(s.budget), s.budget_basis);
  std::cout << fmt::format("\nswap: {} out to {} and back (the folder is removed afterwards)\n", which, s.dir)
            << fmt::format("  engine {}, {}, checksums {}; write {:.2f} GB/s, read {:.2f} GB/s; contents {}\n",
                           s.stats.engine, s.stats.direct ? "O_DIRECT" : "buffered",
                           !s.stats.checksums ? "off" : s.error.empty() ? "verified" : "on",
                           s.stats.write_gbps(), s.stats.read_gbps(),
                           !s.error.empty() ? "not checked: a transfer failed" : s.verified ? "intact" : "CHANGED");
  if (!s.stats.fallback.empty()) std::cout << "  fallback: " << s.stats.fallback << '\n';
  if (s.unlocked_slabs != 0) {
    std::cout << "  memory: " << unlocked_memory_note(s.unlocked_slabs, "the transfers") << '\n';
  }
  if (!s.error.empty()) std::cout << "  failed: " << s.error << '\n';
}

// After the whole report is printed: a failed transfer or changed contents fail the command.
void throw_if_failed(const swap_section& s) {
  if (!s.error.empty()) throw std::runtime_error("demo: a swap transfer failed: " + s.error);
  if (s.skipped.empty() && !s.verified) throw std::runtime_error("demo: swapped tensors came back changed");
}

// The contiguous arena section holds its arena in this machine's memory, and beside it the
// pattern each live tensor is checked against: about twice the arena (peak RSS 2.07 times it
// at 4,000 layers). A size that cannot fit is refused before the graph is built, first by the
// least the arena can be (a quick test: the scenario's script grows with the layers), then by
// its size. Before, 10^6 layers built and planned the graph for over a minute, then failed to
// allocate the 573 GiB arena; 10^7 layers, and 30,000 (a 17 GiB arena), were ended by the
// out-of-memory killer.
void refuse_arena_past_memory(std::uint32_t layers, std::size_t count, std::uint64_t bytes_each,
                              const std::string& basis) {
  const auto shortfall = memory::memory_shortfall_for(count, 2 * bytes_each);
  if (!shortfall) return;
  throw std::invalid_argument(fmt::format(
      "demo: --layers {}: the contiguous arena section needs {} ({}, and as much again for the patterns its tensors "
      "are checked against), more than this machine's {}; lower --layers",
      layers, human_bytes(shortfall->need_bytes), basis, human_bytes(shortfall->memory_bytes)));
}

void run_demo(const demo_options& o) {
  const std::uint64_t arena_layers = std::uint64_t{o.model.layers} * 2;
  refuse_arena_past_memory(o.model.layers, arena_layers, zero3_least_activation_bytes,
                           fmt::format("at least: an arena that holds {} parameter groups' activations of {} or "
                                       "more each, all live at the end of the forward pass",
                                       arena_layers, human_bytes(zero3_least_activation_bytes)));
  const arena_scenario zero3 = zero3_scenario(arena_layers, 7);
  refuse_arena_past_memory(o.model.layers, 1, zero3.capacity,
                           "its " + human_bytes(zero3.capacity) + " arena, 5 % over the most bytes its script holds at "
                           "once");
  const core::graph g = core::make_transformer_step(o.model);
  const core::graph_lifetimes life = core::derive_lifetimes(g, o.alignment);
  const std::uint64_t lb = core::lower_bound(life.buffers, o.alignment);
  const std::uint64_t no_reuse =
      std::accumulate(life.buffers.begin(), life.buffers.end(), std::uint64_t{0},
                      [](std::uint64_t s, const core::buffer& b) { return s + b.bytes; });
  core::plan_options popts;
  popts.alignment = o.alignment;
  popts.time_limit_seconds = o.plan_seconds;
  progress_line progress;
  if (progress.enabled()) popts.progress = plan_progress_printer(progress, life.buffers.size());
  const core::plan_result offline = core::plan(life.buffers, popts);
  const std::string problem =
      core::validate(life.buffers, offline.offsets, offline.arena_bytes, o.alignment);
  if (!problem.empty()) throw std::logic_error("invalid offline plan: " + problem);
  progress.show("demo: online allocators replay the step", true);
  const online_row rows[] = {
      run_online<core::best_fit_allocator>("online best-fit", life.buffers, o.alignment),
      run_online<core::tlsf_allocator>("online O(1) (TLSF)", life.buffers, o.alignment),
  };

  progress.show("demo: contiguous arena, both defragmentation policies", true);
  const std::vector<arena_row> arena_rows = run_arena_section(zero3);
  progress.show("demo: swapping layer 0's activations out and back", true);
  const swap_section swapped = run_swap_section(g, life);
  progress.clear();

  if (o.json) {
    nlohmann::json j;
    for (const arena_row& r : arena_rows) {
      j["arena"].push_back({{"policy", r.policy},
                            {"capacity", r.stats.capacity_bytes},
                            {"defragmentations", r.stats.defragmentations},
                            {"bytes_moved", r.stats.bytes_moved},
                            {"moves", r.stats.moves},
                            {"verified", r.verified}});
    }
    j["swap"] = {{"candidates", swapped.candidates},
                 {"candidate_bytes", swapped.candidate_bytes},
                 {"tensors", swapped.tensors},
                 {"bytes", swapped.bytes},
                 {"budget_bytes", swapped.budget},
                 {"skipped", swapped.skipped},
                 {"error", swapped.error},
                 {"unlocked_slabs", swapped.unlocked_slabs},
                 {"write_gbps", swapped.stats.write_gbps()},
                 {"read_gbps", swapped.stats.read_gbps()},
                 {"engine", swapped.stats.engine},
                 {"direct", swapped.stats.direct},
                 {"checksums", swapped.stats.checksums},
                 {"fallback", swapped.stats.fallback},
                 {"verified", swapped.verified}};
    j["model"] = {{"layers", o.model.layers},         {"hidden", o.model.hidden},
                  {"heads", o.model.heads},           {"sequence", o.model.sequence},
                  {"batch", o.model.batch},           {"vocabulary", o.model.vocabulary},
                  {"dtype_bytes", o.model.dtype_bytes}};
    j["ops"] = g.ops().size();
    j["buffers"] = life.buffers.size();
    j["weight_bytes"] = life.weight_bytes;
    j["lower_bound"] = lb;
    j["no_reuse_bytes"] = no_reuse;
    j["offline"] = {{"arena_bytes", offline.arena_bytes},
                    {"ratio", offline.ratio()},
                    {"strategy", offline.strategy},
                    {"seconds", offline.seconds}};
    for (const online_row& r : rows) {
      j["online"].push_back({{"allocator", r.name},
                             {"high_water", r.high_water},
                             {"ratio", ratio_of(r.high_water, lb)},
                             {"ns_per_op", r.ns_per_op},
                             {"replays", r.replays}});
    }
    std::cout << json_text(j, 2) << '\n';
    throw_if_failed(swapped);
    return;
  }

  const auto& m = o.model;
  std::cout << "tensormem demo: one training step of a GPT-style transformer\n"
            << fmt::format("  model: {} layers, hidden {}, {} heads, vocabulary {}, batch {}, "
                           "sequence {}, {}-byte dtype\n",
                           m.layers, m.hidden, m.heads, m.vocabulary, m.batch, m.sequence,
                           m.dtype_bytes)
            << fmt::format("  graph: {} ops; {} activation/input/output buffers; weights and "
                           "gradients {} in their own region\n",
                           g.ops().size(), life.buffers.size(), human_bytes(life.weight_bytes))
            << fmt::format("  alignment {} B; forward activations stay alive until the "
                           "backward pass consumes them\n\n",
                           o.alignment);
  std::cout << fmt::format("  {:<26} {:>14} {:>10}   {}\n", "activation memory", "bytes",
                           "x lower", "how");
  std::cout << fmt::format("  {:<26} {:>14} {:>10}   {}\n", "lower bound (peak live)",
                           human_bytes(lb), "1.0000", "no plan can do better");
  std::cout << fmt::format("  {:<26} {:>14} {:>10}   {} in {:.2f} s\n", "offline plan",
                           human_bytes(offline.arena_bytes),
                           ratio_text(offline.arena_bytes, lb), offline.strategy, offline.seconds);
  for (const online_row& r : rows) {
    std::cout << fmt::format("  {:<26} {:>14} {:>10}   {:.1f} ns per operation (median of {} replays)\n",
                             r.name, human_bytes(r.high_water), ratio_text(r.high_water, lb),
                             r.ns_per_op, r.replays);
  }
  std::cout << fmt::format("  {:<26} {:>14} {:>10}   {}\n", "no reuse (sum of buffers)",
                           human_bytes(no_reuse), ratio_text(no_reuse, lb), "every buffer its own bytes");
  std::cout << fmt::format("\ncontiguous arena: {}, two per layer of the model; {} arena "
                           "(5 % over the peak)\n",
                           zero3.description, human_bytes(zero3.capacity))
            << fmt::format("  {:<26} {:>10} {:>14} {:>8} {:>10}\n", "defragmentation policy",
                           "defrags", "bytes moved", "moves", "contents");
  for (const arena_row& r : arena_rows) {
    std::cout << fmt::format("  {:<26} {:>10} {:>14} {:>8} {:>10}\n", r.policy,
                             r.stats.defragmentations, human_bytes(r.stats.bytes_moved),
                             r.stats.moves, r.verified ? "intact" : "CHANGED");
  }
  print_swap_section(swapped);
  std::cout << "\nYour own PyTorch model: python3 -m tensormem.torch plan resnet50 --batch 32 "
               "(torchvision names or gpt; --training, --svg, --run)\n";
  throw_if_failed(swapped);
}

}  // namespace

void add_demo_command(CLI::App& app) {
  auto opts = std::make_shared<demo_options>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "Plan the memory of a built-in transformer training step (GPT-2 small default)");
  auto& m = opts->model;
  cmd->add_option("--layers", m.layers, "transformer layers")
      ->check(positive_count(std::numeric_limits<decltype(m.layers)>::max()));
  cmd->add_option("--hidden", m.hidden, "hidden size")->check(positive_count());
  cmd->add_option("--heads", m.heads, "attention heads")->check(positive_count());
  cmd->add_option("--sequence", m.sequence, "sequence length")->check(positive_count());
  cmd->add_option("--batch", m.batch, "batch size")->check(positive_count());
  cmd->add_option("--vocabulary", m.vocabulary, "vocabulary size")->check(positive_count());
  cmd->add_option("--dtype-bytes", m.dtype_bytes, "bytes per element")
      ->check(positive_count());
  cmd->add_option("--alignment", opts->alignment, "allocation alignment in bytes")
      ->check(power_of_two_count());
  cmd->add_option("--plan-seconds", opts->plan_seconds, "search budget of the offline plan")
      ->check(non_negative_seconds());
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->callback([opts] { run_demo(*opts); });
}

}  // namespace tensormem::cli
