#include "tensormem/memory/pinned_host_resource.hpp"

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "tensormem/memory/cuda_resources.hpp"
#include "tensormem/memory/detail/cgroup_limit.hpp"
#include "tensormem/memory/errors.hpp"

namespace tensormem::memory {

namespace {

std::size_t round_up(std::size_t bytes, std::size_t unit) {
  return (bytes + unit - 1) / unit * unit;
}

std::string limit_text(std::size_t limit) {
  return limit == std::numeric_limits<std::size_t>::max() ? "unlimited"
                                                          : std::to_string(limit) + " bytes";
}

}  // namespace

std::size_t pinned_host_resource::page_bytes() noexcept {
  static const std::size_t page = [] {
    const long v = sysconf(_SC_PAGESIZE);
    return v > 0 ? static_cast<std::size_t>(v) : std::size_t{4096};
  }();
  return page;
}

std::size_t memlock_limit_bytes() noexcept {
  rlimit r{};
  if (getrlimit(RLIMIT_MEMLOCK, &r) != 0 || r.rlim_cur == RLIM_INFINITY) {
    return std::numeric_limits<std::size_t>::max();
  }
  return static_cast<std::size_t>(r.rlim_cur);
}

namespace {

// f(text of /proc/self/cgroup, of /proc/self/mountinfo, a reader of files) of this process;
// UINT64_MAX (no limit known) where they cannot be read or there is no memory for them.
template <class F>
std::uint64_t from_own_cgroup(F&& f) noexcept {
  try {
    const detail::read_file_fn read = [](const std::string& path) -> std::optional<std::string> {
      std::ifstream in(path);
      if (!in) return std::nullopt;
      std::stringstream text;
      text << in.rdbuf();
      if (in.bad()) return std::nullopt;
      return std::move(text).str();
    };
    const auto cgroup = read("/proc/self/cgroup");
    const auto mountinfo = read("/proc/self/mountinfo");
    if (!cgroup || !mountinfo) return std::numeric_limits<std::uint64_t>::max();
    return f(*cgroup, *mountinfo, read);
  } catch (...) {
    return std::numeric_limits<std::uint64_t>::max();
  }
}

}  // namespace

std::uint64_t cgroup_memory_limit_bytes() noexcept {
  static const std::uint64_t limit = from_own_cgroup(
      [](std::string_view cgroup, std::string_view mountinfo, const detail::read_file_fn& read) {
        return detail::cgroup_memory_limit(cgroup, mountinfo, read);
      });
  return limit;
}

std::uint64_t cgroup_memory_available_bytes() noexcept {
  return from_own_cgroup([](std::string_view cgroup, std::string_view mountinfo, const detail::read_file_fn& read) {
    return detail::cgroup_memory_available(cgroup, mountinfo, read);
  });
}

std::size_t physical_memory_bytes() noexcept {
  static const std::size_t physical = [] {
    const long pages = sysconf(_SC_PHYS_PAGES);
    const std::size_t machine = pages > 0 ? static_cast<std::size_t>(pages) * pinned_host_resource::page_bytes()
                                          : std::numeric_limits<std::size_t>::max();
    return static_cast<std::size_t>(std::min<std::uint64_t>(machine, cgroup_memory_limit_bytes()));
  }();
  return physical;
}

std::optional<memory_shortfall> shortfall_against(std::size_t count, std::uint64_t bytes_each,
                                                  std::size_t memory) noexcept {
  if (bytes_each == 0 || memory == std::numeric_limits<std::size_t>::max() || count <= memory / bytes_each) {
    return std::nullopt;
  }
  const std::uint64_t most = std::numeric_limits<std::uint64_t>::max();
  const std::uint64_t need = count > most / bytes_each ? most : static_cast<std::uint64_t>(count) * bytes_each;
  return memory_shortfall{need, memory};
}

std::optional<memory_shortfall> memory_shortfall_for(std::size_t count, std::uint64_t bytes_each) noexcept {
  return shortfall_against(count, bytes_each, physical_memory_bytes());
}

std::size_t process_locked_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmLck:", 0) == 0) {
      return static_cast<std::size_t>(std::stoull(line.substr(6))) * 1024;  // kB
    }
  }
  return 0;
}

pinned_host_resource::pinned_host_resource(pinned_options options) : options_(options) {
  if (options_.register_with_cuda) {
    if (const std::string why = cuda_unavailable_reason(); !why.empty()) {
      throw device_unavailable("pinned_host_resource: register_with_cuda needs a CUDA device: " + why);
    }
  }
}

void* pinned_host_resource::do_allocate(std::size_t bytes, std::size_t alignment) {
  made_.refuse_allocation_in_child("a pinned_host_resource");
  return map_and_lock(bytes, alignment, options_.allow_unlocked_fallback);
}

void* pinned_host_resource::allocate_locked(std::size_t bytes, std::size_t alignment) {
  made_.refuse_allocation_in_child("a pinned_host_resource");
  return map_and_lock(checked_request(bytes, alignment), alignment, false);
}

void* pinned_host_resource::map_and_lock(std::size_t bytes, std::size_t alignment, bool may_fall_back) {
  const std::size_t page = page_bytes();
  const std::size_t mapped = round_up(bytes, page);
  // Alignments above a page: map more and trim both ends.
  const std::size_t extra = alignment > page ? alignment - page : 0;
  // Populating a mapping larger than the machine would only end in the OOM killer.
  const std::size_t physical = physical_memory_bytes();
  if (bytes > physical || mapped + extra > physical) {
    throw out_of_memory("pinned_host_resource: " + std::to_string(bytes) +
                        " bytes is more than this machine's " + std::to_string(physical) +
                        " bytes of memory");
  }
  system_calls_.fetch_add(1, std::memory_order_relaxed);
  void* base = mmap(nullptr, mapped + extra, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (base == MAP_FAILED) {
    throw out_of_memory("pinned_host_resource: mmap of " + std::to_string(mapped + extra) +
                        " bytes failed: " + std::strerror(errno));
  }
  auto* start = static_cast<std::byte*>(base);
  if (extra != 0) {
    const auto addr = reinterpret_cast<std::uintptr_t>(start);
    const std::size_t head = (alignment - addr % alignment) % alignment;
    const std::size_t tail = extra - head;
    if (head != 0) munmap(start, head);
    if (tail != 0) munmap(start + head + mapped, tail);
    system_calls_.fetch_add((head != 0 ? 1U : 0U) + (tail != 0 ? 1U : 0U), std::memory_order_relaxed);
    start += head;
  }
  // Undoes the mapping on a failure below (and its registration once made).
  bool registered = false;
  const auto unmap = [&] {
    if (registered) cuda_unregister_host(start);
    munmap(start, mapped);
    system_calls_.fetch_add(1, std::memory_order_relaxed);
  };
  if (options_.register_with_cuda) {
    try {
      cuda_register_host(start, mapped);
    } catch (...) {
      unmap();
      throw;
    }
    registered = true;
  }
  system_calls_.fetch_add(1, std::memory_order_relaxed);
  // The raw system call: sanitizer runtimes replace mlock() with a no-op.
  if (syscall(SYS_mlock, start, mapped) != 0) {
    const int error = errno;
    if (!may_fall_back) {
      unmap();
      const std::size_t limit = memlock_limit_bytes();
      throw lock_limit_error(
          "pinned_host_resource: cannot lock " + std::to_string(mapped) + " bytes (" +
              std::strerror(error) + "); RLIMIT_MEMLOCK is " + limit_text(limit) + " and " +
              std::to_string(process_locked_bytes()) +
              " bytes are locked already. Raise it with `ulimit -l` (in kB; or the memlock "
              "line of /etc/security/limits.conf, or LimitMEMLOCK= for a systemd service), "
              "run with CAP_IPC_LOCK" + std::string(lock_limit_error::fallback_hint),
          mapped, limit);
    }
    unlocked_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    try {
      const std::lock_guard lock(unlocked_mutex_);
      unlocked_.insert(start);
    } catch (...) {
      unmap();
      throw;
    }
    unlocked_live_.fetch_add(1, std::memory_order_relaxed);
  } else {
    locked_bytes_.fetch_add(mapped, std::memory_order_relaxed);
  }
  if (registered) registered_bytes_.fetch_add(mapped, std::memory_order_relaxed);
  mappings_.fetch_add(1, std::memory_order_relaxed);
  mapped_bytes_.fetch_add(mapped, std::memory_order_relaxed);
  return start;
}

void pinned_host_resource::do_deallocate(void* p, std::size_t bytes,
                                         std::size_t /*alignment*/) noexcept {
  const std::size_t mapped = round_up(bytes, page_bytes());
  bool was_locked = true;
  if (unlocked_live_.load(std::memory_order_relaxed) != 0) {
    const std::lock_guard lock(unlocked_mutex_);
    if (unlocked_.erase(p) != 0) {
      was_locked = false;
      unlocked_live_.fetch_sub(1, std::memory_order_relaxed);
    }
  }
  // In a forked child the registration is the parent's CUDA context's, not this process's.
  if (options_.register_with_cuda) {
    if (!made_.forked()) cuda_unregister_host(p);
    registered_bytes_.fetch_sub(mapped, std::memory_order_relaxed);
  }
  munmap(p, mapped);  // unlocks as it unmaps
  system_calls_.fetch_add(1, std::memory_order_relaxed);
  if (was_locked) locked_bytes_.fetch_sub(mapped, std::memory_order_relaxed);
  mappings_.fetch_sub(1, std::memory_order_relaxed);
  mapped_bytes_.fetch_sub(mapped, std::memory_order_relaxed);
}

pinned_stats pinned_host_resource::stats() const noexcept {
  // In a forked child every mapping is from before the fork: none is locked or registered there.
  const bool forked = made_.forked();
  return {mappings_.load(), mapped_bytes_.load(), forked ? 0 : locked_bytes_.load(), system_calls_.load(),
          unlocked_fallbacks_.load(), forked ? 0 : registered_bytes_.load()};
}

}  // namespace tensormem::memory
