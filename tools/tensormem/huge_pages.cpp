#include "huge_pages.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string_view>

namespace tensormem::cli {

namespace {

// Set in the environment of the second run: second_run_marker's value.
constexpr const char* second_run = "TENSORMEM_HUGE_PAGES_RUN";
constexpr std::string_view tunable = "glibc.malloc.hugetlb=";

std::string& status() {
  static std::string s = "off (not asked for)";
  return s;
}

// The kernel's transparent huge page mode: "always", "madvise", "never", or empty.
std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(f, line)) return {};
  const auto open = line.find('[');
  const auto close = line.find(']', open);
  if (open == std::string::npos || close == std::string::npos) return {};
  return line.substr(open + 1, close - open - 1);
}

// The value GLIBC_TUNABLES gives glibc.malloc.hugetlb (the last, as glibc reads them in
// order), or empty.
std::string hugetlb_value(std::string_view tunables) {
  std::string value;
  for (std::size_t start = 0; start <= tunables.size();) {
    const std::size_t end = std::min(tunables.find(':', start), tunables.size());
    if (const std::string_view item = tunables.substr(start, end - start); item.starts_with(tunable)) {
      value = item.substr(tunable.size());
    }
    start = end + 1;
  }
  return value;
}

// Puts GLIBC_TUNABLES back as `saved` says (the second run's marker: "-" or "=" and a value).
void restore_tunables(const std::string& saved) {
  if (saved[0] == '=') setenv("GLIBC_TUNABLES", saved.c_str() + 1, 1);
  else unsetenv("GLIBC_TUNABLES");
  unsetenv(second_run);
}

bool sanitized() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}

}  // namespace

std::string second_run_marker(const char* tunables) {
  return tunables != nullptr ? "=" + std::string(tunables) : "-";
}

void use_huge_pages(char** argv) {
  // The second run puts the caller's GLIBC_TUNABLES back (this run has read it already), so
  // that programs it starts see what the caller set.
  const char* marker = std::getenv(second_run);
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  const std::string in_effect = tunables != nullptr ? tunables : "";
  // The marker this run would give a second one.
  const std::string caller = second_run_marker(tunables);
  if (marker != nullptr) restore_tunables(marker);
#ifndef __GLIBC__
  status() = "off (not glibc's malloc)";
  return;
#endif
  if (sanitized()) {
    status() = "off (a sanitizer's allocator)";
    return;
  }
  const std::string value = hugetlb_value(in_effect);
  if (!value.empty()) {
    status() = (value == "0" ? "off" : "on") + std::string(" (GLIBC_TUNABLES: glibc.malloc.hugetlb=") + value + ")";
    return;
  }
  if (marker != nullptr) {
    status() = "off (GLIBC_TUNABLES did not reach the second run)";
    return;
  }
  if (const char* opt = std::getenv("TENSORMEM_HUGE_PAGES"); opt != nullptr && std::string_view(opt) == "0") {
    status() = "off (TENSORMEM_HUGE_PAGES=0)";
    return;
  }
  const std::string mode = thp_mode();
  if (mode == "always") {
    status() = "on (transparent huge pages: always)";
    return;
  }
  if (mode != "madvise") {
    status() = "off (transparent huge pages: " + (mode.empty() ? std::string("not available") : mode) + ")";
    return;
  }
  const std::string asked = (in_effect.empty() ? "" : in_effect + ":") + std::string(tunable) + "1";
  setenv(second_run, caller.c_str(), 1);
  setenv("GLIBC_TUNABLES", asked.c_str(), 1);
  execv("/proc/self/exe", argv);
  // Still here: the environment as it was, and on with 4 KiB pages.
  const int error = errno;
  restore_tunables(caller);
  status() = std::string("off (could not run /proc/self/exe again: ") + std::strerror(error) + ")";
}

const std::string& huge_pages_status() { return status(); }

}  // namespace tensormem::cli
