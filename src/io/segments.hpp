#pragma once
// Private helpers of the engines: the queue depth they take, what remains of a request after
// `done` of its bytes moved (as one or two iovecs), the rest of a request moved by blocking
// calls, and room made ahead for completions.

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "tensormem/io/io_engine.hpp"

namespace tensormem::io::detail {

inline void check_queue_depth(unsigned queue_depth) {
  if (queue_depth > max_queue_depth) {
    throw std::invalid_argument("io engine: queue depth " + std::to_string(queue_depth) + " is more than " +
                                std::to_string(max_queue_depth) + " (io_uring's limit on one ring)");
  }
}

// Room for `needed` elements, growing at least twofold: a vector's reserve takes exactly
// what it is asked, and requests submitted one at a time would copy it whole each time.
template <class Vector>
void reserve_at_least(Vector& v, std::size_t needed) {
  if (needed > v.capacity()) v.reserve(std::max(needed, 2 * v.capacity()));
}

inline unsigned remaining_segments(const io_request& r, std::size_t done, iovec (&out)[2]) noexcept {
  unsigned n = 0;
  if (done < r.bytes) {
    out[n++] = {static_cast<char*>(r.buffer) + done, r.bytes - done};
    done = 0;
  } else {
    done -= r.bytes;
  }
  if (done < r.bytes2) out[n++] = {static_cast<char*>(r.buffer2) + done, r.bytes2 - done};
  return n;
}

// Moves the rest of `r` after its first `done` bytes with blocking preadv/pwritev, continuing
// short transfers: returns the bytes of the request moved in all (short where the file ended
// or a write made no progress), or -errno.
inline std::int64_t transfer_synchronously(const io_request& r, std::size_t done) noexcept {
  while (done < r.total()) {
    iovec iov[2];
    const unsigned segments = remaining_segments(r, done, iov);
    const auto offset = static_cast<off_t>(r.offset + done);
    const ssize_t n = r.write ? ::pwritev(r.fd, iov, static_cast<int>(segments), offset)
                              : ::preadv(r.fd, iov, static_cast<int>(segments), offset);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return -errno;
    }
    if (n == 0) break;  // end of file, or a write that makes no progress
    done += static_cast<std::size_t>(n);
  }
  return static_cast<std::int64_t>(done);
}

}  // namespace tensormem::io::detail
