#pragma once
// What remains of a request after `done` of its bytes moved, as one or two iovecs.

#include <sys/uio.h>

#include <cstddef>

#include "tensormem/io/io_engine.hpp"

namespace tensormem::io::detail {

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

}  // namespace tensormem::io::detail
