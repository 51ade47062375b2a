#pragma once
// The command line tool's heap on transparent huge pages.

#include <string>

namespace tensormem::cli {

/// Planning a trace of a million buffers touches a few hundred MiB of fresh heap, and on a
/// virtual machine each 4 KiB page fault is a trip through the hypervisor: a quarter of
/// `plan --time-limit 1` on 10^6 buffers went to page faults here (docs/BENCHMARKS.md, "The
/// CLI's heap on huge pages"). Where the kernel gives transparent huge pages only to memory
/// that asks for them (mode "madvise"), glibc's malloc asks when the tunable
/// glibc.malloc.hugetlb=1 is set, and tunables are read only when a program starts. So this
/// runs the program again, once, before anything else (same arguments and open files), with
/// that tunable added to GLIBC_TUNABLES, and restores the caller's GLIBC_TUNABLES in the new
/// run. It does nothing when TENSORMEM_HUGE_PAGES=0, when GLIBC_TUNABLES already sets
/// glibc.malloc.hugetlb, when the mode is "always" or "never" (or unknown), in sanitizer
/// builds (their allocator ignores the tunable), without glibc, and when the program cannot
/// be run again (it then goes on as it is). Call first thing in main.
void use_huge_pages(char** argv);

/// What the first run tells the second of the caller's GLIBC_TUNABLES (`tunables`, null when
/// unset), so that the second run can put it back: "-" for none, else "=" and the value.
std::string second_run_marker(const char* tunables);

/// Whether the heap of this run asks for huge pages, and why not: "on (...)" or "off (...)".
/// Printed by `tensormem --version` and in `plan --json` ("heap_huge_pages").
const std::string& huge_pages_status();

}  // namespace tensormem::cli
