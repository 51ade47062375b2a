#pragma once
// Blocking system calls that a signal may interrupt, and transfers a file system may cut short:
// the one place where the library repeats and continues them.

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <sys/types.h>
#include <unistd.h>

namespace tensormem::io::detail {

/// Calls `call`, a system call that returns -1 and sets errno when it fails, again for as long
/// as it fails with EINTR (interrupted by a signal before it did anything; a network file
/// system's, or tmpfs's fallocate while a signal is pending). Returns the last result, with
/// errno as that call left it.
template <class Call>
auto repeat_interrupted(Call&& call) -> decltype(call()) {
  for (;;) {
    const auto rc = call();
    if (rc != -1 || errno != EINTR) return rc;
  }
}

/// What a continued transfer moved: `bytes` of those asked, and the errno of the call that
/// failed, or 0 where it stopped because the file ended (a read of 0 bytes) or a write moved
/// nothing, or because everything was moved.
struct transferred {
  std::size_t bytes = 0;
  int error = 0;
};

/// Reads `bytes` at `offset` into `data` with pread, continuing short and interrupted reads,
/// until all are read, the file ends or a read fails.
inline transferred pread_fully(int fd, void* data, std::size_t bytes, std::uint64_t offset) noexcept {
  transferred done;
  while (done.bytes < bytes) {
    const ssize_t n = repeat_interrupted(
        [&] { return ::pread(fd, static_cast<char*>(data) + done.bytes, bytes - done.bytes,
                             static_cast<off_t>(offset + done.bytes)); });
    if (n < 0) done.error = errno;
    if (n <= 0) break;
    done.bytes += static_cast<std::size_t>(n);
  }
  return done;
}

/// Writes `bytes` from `data` at `offset` with pwrite, continuing short and interrupted writes,
/// until all are written, a write moves nothing or a write fails.
inline transferred pwrite_fully(int fd, const void* data, std::size_t bytes, std::uint64_t offset) noexcept {
  transferred done;
  while (done.bytes < bytes) {
    const ssize_t n = repeat_interrupted(
        [&] { return ::pwrite(fd, static_cast<const char*>(data) + done.bytes, bytes - done.bytes,
                              static_cast<off_t>(offset + done.bytes)); });
    if (n < 0) done.error = errno;
    if (n <= 0) break;
    done.bytes += static_cast<std::size_t>(n);
  }
  return done;
}

/// Writes `bytes` from `data` with write (at the file position: a pipe, a device, a file
/// opened for it), continuing short and interrupted writes, until all are written, a write
/// moves nothing or a write fails.
inline transferred write_fully(int fd, const void* data, std::size_t bytes) noexcept {
  transferred done;
  while (done.bytes < bytes) {
    const ssize_t n = repeat_interrupted(
        [&] { return ::write(fd, static_cast<const char*>(data) + done.bytes, bytes - done.bytes); });
    if (n < 0) done.error = errno;
    if (n <= 0) break;
    done.bytes += static_cast<std::size_t>(n);
  }
  return done;
}

}  // namespace tensormem::io::detail
