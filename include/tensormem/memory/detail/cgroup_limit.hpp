#pragma once
// The memory limit of a process's control group, from the text of /proc/self/cgroup and
// /proc/self/mountinfo (split out so that tests can give any layout).

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace tensormem::memory::detail {

/// Reads a whole small file, or nothing when it cannot be read.
using read_file_fn = std::function<std::optional<std::string>(const std::string& path)>;

/// The lowest memory limit over the process's memory cgroup and its ancestors, in bytes:
/// `memory.max` of cgroup v2 (the unified hierarchy, line "0::PATH" of /proc/self/cgroup,
/// a mount of type cgroup2) and `memory.limit_in_bytes` of cgroup v1 (the line whose
/// controllers include "memory", a mount of type cgroup with the option "memory"). A limit
/// of "max", a file that is missing or does not hold a number, and a cgroup path outside
/// the mount's root add no limit. UINT64_MAX when there is none.
std::uint64_t cgroup_memory_limit(std::string_view proc_self_cgroup, std::string_view mountinfo,
                                  const read_file_fn& read_file);

/// What the process's memory cgroup and its ancestors leave for new allocations, in bytes:
/// the lowest over those with a limit of the limit less the usage (`memory.current` of v2,
/// `memory.usage_in_bytes` of v1; 0 where the usage is past the limit), plus the inactive
/// file cache the kernel reclaims first (`inactive_file` of v2's `memory.stat`,
/// `total_inactive_file` of v1's), at most the limit. A cgroup whose usage cannot be read
/// counts its whole limit. UINT64_MAX where no cgroup has a limit.
std::uint64_t cgroup_memory_available(std::string_view proc_self_cgroup, std::string_view mountinfo,
                                      const read_file_fn& read_file);

}  // namespace tensormem::memory::detail
