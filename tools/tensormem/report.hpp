#pragma once
// Formatting helpers shared by the sub-commands.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace tensormem::cli {

/// `j` as one JSON text. JSON is UTF-8: in a string that is not (a file name can be any
/// bytes), each byte that is not UTF-8 becomes U+FFFD instead of the output being lost.
inline std::string json_text(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

/// "1.41 GiB", "12.0 MiB", "512 B".
std::string human_bytes(std::uint64_t bytes);
/// high / low with four decimals: 1.0000 when both are zero (nothing to place, nothing
/// used), "n/a" when only low is.
std::string ratio_text(std::uint64_t high, std::uint64_t low);
/// high / low: 1 when both are zero, infinity when only low is.
double ratio_of(std::uint64_t high, std::uint64_t low);
/// Throws std::invalid_argument where `count` (buffers or lines of a trace) at about
/// `bytes_per_buffer` each is more than the memory this process can have (the machine's, or
/// its cgroup's limit): "COMMAND: WHAT: N COUNTED need about X of memory to COMMAND (about B
/// bytes a buffer), more than this machine's Y". Such a run is otherwise ended by the kernel's
/// out-of-memory killer.
void refuse_past_memory(const std::string& command, const std::string& what, std::size_t count,
                        const char* counted, std::uint64_t bytes_per_buffer);
/// The same for a trace file before it is read, by its line count (a line is at most a
/// buffer; reading 10^6 lines alone takes more than 64 MiB). Anything but a regular file (a
/// pipe is read once, as it comes) passes.
void refuse_trace_past_memory(const std::string& command, const std::string& path, std::uint64_t bytes_per_buffer);
/// "N slab(s) could not be page-locked (RLIMIT_MEMLOCK is X; raise it with `ulimit -l` or run
/// with CAP_IPC_LOCK): WHAT used unlocked memory", for a pool whose unlocked fallback was taken.
std::string unlocked_memory_note(std::uint64_t slabs, const std::string& what);
/// Seconds of the steady clock since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace tensormem::cli
