#include "tensormem/memory/detail/cgroup_limit.hpp"

#include <algorithm>
#include <charconv>
#include <limits>
#include <vector>

namespace tensormem::memory::detail {

namespace {

std::vector<std::string_view> split(std::string_view text, char by) {
  std::vector<std::string_view> parts;
  for (std::size_t start = 0;;) {
    const std::size_t end = text.find(by, start);
    parts.push_back(text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

// mountinfo writes a space, tab, newline or backslash in a path as \040, \011, \012, \134.
std::string unescape(std::string_view field) {
  std::string out;
  for (std::size_t i = 0; i < field.size(); ++i) {
    const auto octal = [&](std::size_t k) { return field[k] >= '0' && field[k] <= '7'; };
    if (field[i] == '\\' && i + 3 < field.size() && octal(i + 1) && octal(i + 2) && octal(i + 3)) {
      out.push_back(static_cast<char>((field[i + 1] - '0') * 64 + (field[i + 2] - '0') * 8 + (field[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(field[i]);
    }
  }
  return out;
}

struct cgroup_mount {
  std::string root;         // the cgroup path the mount shows at its mount point
  std::string mount_point;
};

// The mount of a cgroup2 hierarchy (v1 = false) or of a v1 hierarchy with the memory
// controller (v1 = true), if any.
std::optional<cgroup_mount> find_mount(std::string_view mountinfo, bool v1) {
  for (std::string_view line : split(mountinfo, '\n')) {
    const std::size_t dash = line.find(" - ");
    if (dash == std::string_view::npos) continue;
    const auto before = split(line.substr(0, dash), ' ');
    const auto after = split(line.substr(dash + 3), ' ');
    if (before.size() < 5 || after.size() < 3) continue;
    if (v1) {
      if (after[0] != "cgroup") continue;
      const auto options = split(after[2], ',');
      if (std::find(options.begin(), options.end(), "memory") == options.end()) continue;
    } else if (after[0] != "cgroup2") {
      continue;
    }
    return cgroup_mount{unescape(before[3]), unescape(before[4])};
  }
  return std::nullopt;
}

// The whole of `text` as a number; none for an empty text or any other character.
std::optional<std::uint64_t> number(std::string_view text) {
  std::uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || text.empty()) return std::nullopt;
  return value;
}

// A file's one number (a limit or a usage); none for "max", an unreadable file or other text.
std::optional<std::uint64_t> number_in(const read_file_fn& read_file, const std::string& path) {
  const std::optional<std::string> text = read_file(path);
  if (!text) return std::nullopt;
  std::string_view t = *text;
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.remove_suffix(1);
  return number(t);
}

// The number of a stat file's line "NAME N", if any.
std::optional<std::uint64_t> stat_in(const read_file_fn& read_file, const std::string& path, std::string_view name) {
  const std::optional<std::string> text = read_file(path);
  if (!text) return std::nullopt;
  for (std::string_view line : split(*text, '\n')) {
    if (line.size() <= name.size() || line.substr(0, name.size()) != name || line[name.size()] != ' ') continue;
    if (const auto value = number(line.substr(name.size() + 1))) return value;
  }
  return std::nullopt;
}

// The lowest of value(folder) over the cgroup at `path` and its ancestors inside the mount
// (folders without a value count for none).
template <class Value>
std::uint64_t lowest_over_ancestors(const cgroup_mount& mount, std::string path, Value&& value) {
  std::string root = mount.root;
  if (root.size() > 1 && root.back() == '/') root.pop_back();
  if (root != "/") {
    if (path != root && path.rfind(root + "/", 0) != 0) return std::numeric_limits<std::uint64_t>::max();
    path = path.substr(root.size());
  }
  std::uint64_t lowest = std::numeric_limits<std::uint64_t>::max();
  while (true) {
    if (path.empty() || path.front() != '/') path.insert(path.begin(), '/');
    const std::string dir = mount.mount_point + (path == "/" ? std::string() : path);
    if (const std::optional<std::uint64_t> v = value(dir)) lowest = std::min(lowest, *v);
    if (path == "/") return lowest;
    path.erase(path.rfind('/'));
  }
}

// The files of one cgroup version: its limit, its usage, and the reclaimable cache in its stat.
struct memory_files {
  const char* limit;
  const char* usage;
  const char* inactive_file;  // the line of memory.stat
};
constexpr memory_files v2_files{"memory.max", "memory.current", "inactive_file"};
constexpr memory_files v1_files{"memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"};

// Calls each(mount, path, files) for the memory cgroup of each version the process is in.
template <class Each>
void for_each_memory_cgroup(std::string_view proc_self_cgroup, std::string_view mountinfo, Each&& each) {
  for (std::string_view line : split(proc_self_cgroup, '\n')) {
    const std::size_t first = line.find(':');
    const std::size_t second = first == std::string_view::npos ? first : line.find(':', first + 1);
    if (second == std::string_view::npos) continue;
    const std::string_view controllers = line.substr(first + 1, second - first - 1);
    const std::string path(line.substr(second + 1));
    if (line.substr(0, first) == "0" && controllers.empty()) {
      if (const auto mount = find_mount(mountinfo, false)) each(*mount, path, v2_files);
    } else {
      const auto names = split(controllers, ',');
      if (std::find(names.begin(), names.end(), "memory") == names.end()) continue;
      if (const auto mount = find_mount(mountinfo, true)) each(*mount, path, v1_files);
    }
  }
}

}  // namespace

std::uint64_t cgroup_memory_limit(std::string_view proc_self_cgroup, std::string_view mountinfo,
                                  const read_file_fn& read_file) {
  std::uint64_t lowest = std::numeric_limits<std::uint64_t>::max();
  for_each_memory_cgroup(proc_self_cgroup, mountinfo, [&](const cgroup_mount& mount, const std::string& path,
                                                          const memory_files& files) {
    lowest = std::min(lowest, lowest_over_ancestors(mount, path, [&](const std::string& dir) {
                        return number_in(read_file, dir + "/" + files.limit);
                      }));
  });
  return lowest;
}

std::uint64_t cgroup_memory_available(std::string_view proc_self_cgroup, std::string_view mountinfo,
                                      const read_file_fn& read_file) {
  std::uint64_t lowest = std::numeric_limits<std::uint64_t>::max();
  for_each_memory_cgroup(proc_self_cgroup, mountinfo, [&](const cgroup_mount& mount, const std::string& path,
                                                          const memory_files& files) {
    lowest = std::min(lowest, lowest_over_ancestors(mount, path, [&](const std::string& dir) -> std::optional<std::uint64_t> {
                        const auto limit = number_in(read_file, dir + "/" + files.limit);
                        if (!limit) return std::nullopt;
                        const auto usage = number_in(read_file, dir + "/" + files.usage);
                        if (!usage) return limit;
                        const std::uint64_t cache = stat_in(read_file, dir + "/memory.stat", files.inactive_file).value_or(0);
                        // (usage - cache may be past the limit: a usage read just after a
                        // limit was lowered)
                        const std::uint64_t held = *usage > cache ? *usage - cache : 0;
                        return held < *limit ? *limit - held : 0;
                      }));
  });
  return lowest;
}

}  // namespace tensormem::memory::detail
