#include "arena_ops.hpp"

#include <cstring>
#include <istream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>

#include "tensormem/trace/trace_io.hpp"

namespace tensormem::cli {

std::vector<arena_op> parse_arena_ops(std::istream& in, const std::string& source) {
  std::vector<arena_op> ops;
  std::string line;
  std::size_t number = 0;
  while (trace::read_line(in, line, trace::max_line_bytes, source, number + 1)) {
    ++number;
    if (number == 1 && trace::starts_with_byte_order_mark(line)) line.erase(0, 3);
    if (const auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    std::istringstream words(line);
    std::string verb;
    if (!(words >> verb)) continue;
    arena_op op;
    op.line = number;
    auto fail = [&](const std::string& what) {
      return std::runtime_error(source + ":" + std::to_string(number) + ": " + what);
    };
    if (verb == "alloc") {
      std::string bytes;
      if (!(words >> op.name >> bytes)) throw fail("expected 'alloc ID BYTES'");
      if (bytes.empty() || bytes.find_first_not_of("0123456789") != std::string::npos) {
        throw fail("BYTES is not an unsigned integer: " + trace::brief(bytes));
      }
      try {
        op.bytes = std::stoull(bytes);
      } catch (const std::out_of_range&) {
        throw fail("BYTES does not fit in 64 bits: " + trace::brief(bytes));
      }
      op.allocate = true;
    } else if (verb == "free") {
      if (!(words >> op.name)) throw fail("expected 'free ID'");
    } else {
      throw fail("unknown step " + trace::brief(verb) + " (expected alloc or free)");
    }
    std::string extra;
    if (words >> extra) throw fail("unexpected " + trace::brief(extra) + " at the end of the step");
    if (const std::size_t bad = trace::first_non_text_byte(op.name); bad != op.name.size()) {
      throw fail("the ID " + trace::brief(op.name) + " is not UTF-8 text without control characters (byte " +
                 std::to_string(bad + 1) + ")");
    }
    ops.push_back(std::move(op));
  }
  return ops;
}

namespace {

std::byte pattern(std::uint64_t seed, std::uint64_t i) {
  return static_cast<std::byte>(((seed ^ (i * 0x9E3779B97F4A7C15ULL)) >> 29) & 0xff);
}

std::uint64_t seed_of(const std::string& name) { return std::hash<std::string>{}(name) | 1U; }

// The arena now, its tensors named as the script names them.
trace::arena_snapshot named_snapshot(const arena::contiguous_arena& arena,
                                     const std::map<std::string, std::uint64_t>& ids, std::string label) {
  std::map<std::uint64_t, std::string> names;
  for (const auto& [name, id] : ids) names[id] = name;
  return trace::snapshot(arena, std::move(label), [&](std::uint64_t id) { return names.at(id); });
}

}  // namespace

std::vector<std::string> pattern_check::add(const std::string& name, std::uint64_t offset,
                                           std::uint64_t bytes) {
  tensor& t = tensors_[name];
  t.offset = offset;
  t.pattern.resize(bytes);
  const std::uint64_t seed = seed_of(name);
  for (std::uint64_t i = 0; i < bytes; ++i) t.pattern[i] = pattern(seed, i);
  std::vector<std::string> changed;
  if (bytes == 0) return changed;
  std::memcpy(base_ + offset, t.pattern.data(), bytes);
  // The tensors that may overlap it: the last one starting below it, and those starting inside it.
  auto at = by_offset_.lower_bound(offset);
  if (at != by_offset_.begin()) at = std::prev(at);
  for (; at != by_offset_.end() && at->first < offset + bytes; ++at) {
    if (!intact(tensors_.at(at->second))) changed.push_back(at->second);
  }
  by_offset_.emplace(offset, name);
  return changed;
}

void pattern_check::remove(const std::string& name) {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) return;
  unplace(name, it->second.offset);
  tensors_.erase(it);
}

void pattern_check::unplace(const std::string& name, std::uint64_t offset) {
  for (auto [at, end] = by_offset_.equal_range(offset); at != end; ++at) {
    if (at->second == name) {
      by_offset_.erase(at);
      return;
    }
  }
}

void pattern_check::relocate(const std::string& name, std::uint64_t offset) {
  tensor& t = tensors_.at(name);
  if (t.offset == offset) return;
  if (!t.pattern.empty()) {
    unplace(name, t.offset);
    by_offset_.emplace(offset, name);
  }
  t.offset = offset;
}

std::vector<std::string> pattern_check::check_all() const {
  std::vector<std::string> changed;
  for (const auto& [name, t] : tensors_) {
    if (!intact(t)) changed.push_back(name);
  }
  return changed;
}

bool pattern_check::intact(const tensor& t) const {
  return t.pattern.empty() || std::memcmp(base_ + t.offset, t.pattern.data(), t.pattern.size()) == 0;
}

arena_run_result run_arena_ops(arena::contiguous_arena& arena, const std::vector<arena_op>& ops,
                               bool verify, std::size_t resolution) {
  arena_run_result r;
  std::map<std::string, std::uint64_t> ids;  // name -> arena id
  std::optional<pattern_check> patterns;     // verify
  if (verify) r.verified = true;
  for (const arena_op& op : ops) {
    ++r.steps;
    const arena::arena_stats before = arena.stats();
    const bool checking = verify && *r.verified;  // until the first change is found
    auto failed = [&](const std::string& what) {
      r.failed_lines.push_back(op.line);
      r.failures.push_back("line " + std::to_string(op.line) + ": " + what);
    };
    auto moved_since = [&](const arena::arena_stats& s) {
      const arena::arena_stats now = arena.stats();
      return now.defragmentations != s.defragmentations || now.moves != s.moves;
    };
    auto relocate_all = [&] {
      for (const auto& [name, id] : ids) patterns->relocate(name, arena.block(id).offset);
    };
    std::vector<std::string> changed;
    if (op.allocate) {
      if (ids.contains(op.name)) {
        failed("'" + op.name + "' is already allocated");
        continue;
      }
      try {
        const arena::tensor_block b = arena.allocate(op.bytes);
        if (verify) {
          if (!patterns) patterns.emplace(b.base);
          // The allocation may have made room by moving tensors: their places are read again
          // before the new tensor's overlaps are looked up (an old place may be free memory).
          if (moved_since(before)) relocate_all();
          changed = patterns->add(op.name, b.offset, b.bytes);
        }
        ids[op.name] = b.id;
      } catch (const arena::arena_out_of_memory& e) {
        failed(e.what());
      }
    } else {
      const auto it = ids.find(op.name);
      if (it == ids.end()) {
        failed("'" + op.name + "' is not allocated");
        continue;
      }
      arena.release(it->second);
      ids.erase(it);
      if (patterns) patterns->remove(op.name);
    }
    if (arena.stats().defragmentations != before.defragmentations) {
      r.maps_after_defrag.push_back(arena.print_allocation(resolution));
      r.snapshots.push_back(named_snapshot(
          arena, ids, "after defragmentation " + std::to_string(r.maps_after_defrag.size()) + " (line " +
                          std::to_string(op.line) + ")"));
    }
    // Only moves and new tensors' patterns write to the arena: after an allocation the
    // tensors the new one overlaps are checked (above); after moves, every live tensor at its
    // new place.
    if (patterns && moved_since(before)) {
      relocate_all();
      changed = patterns->check_all();
    }
    if (!checking) continue;
    for (const std::string& name : changed) {
      r.verified = false;
      failed("contents of '" + name + "' changed");
    }
  }
  r.snapshots.push_back(named_snapshot(arena, ids, "at the end"));
  return r;
}

arena_scenario zero3_scenario(std::uint64_t layers, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::ostringstream s;
  std::map<std::string, std::uint64_t> live;  // to size the arena from the peak live bytes
  std::uint64_t live_bytes = 0;
  std::uint64_t peak = 0;
  auto alloc = [&](const std::string& name, std::uint64_t bytes) {
    bytes = (bytes + 255) / 256 * 256;
    s << "alloc " << name << ' ' << bytes << '\n';
    live[name] = bytes;
    live_bytes += bytes;
    peak = std::max(peak, live_bytes);
  };
  auto release = [&](const std::string& name) {
    s << "free " << name << '\n';
    live_bytes -= live[name];
    live.erase(name);
  };
  std::vector<std::uint64_t> weight(layers);
  std::vector<std::uint64_t> activation(layers);
  for (std::uint64_t l = 0; l < layers; ++l) {
    weight[l] = (32 + rng() % 224) * 4096;
    activation[l] = zero3_least_activation_bytes + (rng() % 112) * 4096;
  }
  s << "# ZeRO-3-like step over " << layers << " layers: gather a layer's parameters, run it,\n"
    << "# release them; activations stay for backward; gradients are reduced one layer late\n";
  for (std::uint64_t l = 0; l < layers; ++l) {
    const std::string n = std::to_string(l);
    alloc("w" + n, weight[l]);
    alloc("act" + n, activation[l]);
    release("w" + n);
  }
  for (std::uint64_t l = layers; l-- > 0;) {
    const std::string n = std::to_string(l);
    alloc("w" + n, weight[l]);
    alloc("grad" + n, weight[l]);
    release("w" + n);
    release("act" + n);
    if (l + 1 < layers) release("grad" + std::to_string(l + 1));
  }
  release("grad0");
  arena_scenario sc;
  sc.script = s.str();
  sc.capacity = peak + peak / 20;  // 5 % slack over the most bytes live at once
  sc.alignment = 256;
  sc.description = "ZeRO-3-like gather/release of " + std::to_string(layers) +
                   " parameter groups, sizes drawn at random (seed " + std::to_string(seed) + ")";
  return sc;
}

std::optional<arena_scenario> find_arena_scenario(const std::string& name) {
  if (name == "fp16-compactions") {
    // Sizes in bytes of fp16 elements: 1024 elements in all.
    arena_scenario sc;
    sc.capacity = 1024 * 2;
    sc.alignment = 2;
    sc.description = "1024 fp16 elements; tensors of 64-256 elements; two compactions";
    sc.script =
        "# Two compactions in a 1024-element fp16 buffer (2048 bytes; the shape of DeepSpeed's\n"
        "# ContiguousMemoryAllocator tests, not one of them), tensors of 64-256 elements\n"
        "# (128-512 bytes).\n"
        "alloc wte 256        # 128 elements at 0\n"
        "alloc wpe 256        # 128 at 256\n"
        "alloc qkv 512        # 256 at 512\n"
        "alloc proj 256       # 128 at 1024\n"
        "alloc fc1 512        # 256 at 1280\n"
        "alloc ln 128         # 64 at 1792; 128 bytes left at the top\n"
        "free wpe             # a 256-byte hole at 256\n"
        "free proj            # another at 1024: 640 bytes free, no hole above 256\n"
        "alloc fc2 384        # compaction #1: minimal-move slides qkv down (512 bytes);\n"
        "                     # full compaction moves qkv, fc1 and ln (1152 bytes)\n"
        "free wte             # 512 free: holes of 256, 128 and 128\n"
        "alloc head 384       # compaction #2\n"
        "alloc extra 256      # only 128 bytes free: out of memory, reported, run goes on\n"
        "free qkv\n"
        "free ln\n";
    return sc;
  }
  if (name == "zero3") return zero3_scenario(24, 7);
  return std::nullopt;
}

std::vector<std::string> arena_scenario_names() { return {"fp16-compactions", "zero3"}; }

}  // namespace tensormem::cli
