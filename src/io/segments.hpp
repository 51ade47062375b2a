#pragma once
// Private helpers of the engines: the queue depth they take, and what remains of a request
// after `done` of its bytes moved, as one or two iovecs.

#include <sys/uio.h>

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
