#pragma once
// Private helpers of the engines: the queue depth they take, what remains of a request after
// `done` of its bytes moved (as one or two iovecs), and room made ahead for completions.

#include <sys/uio.h>

#include <algorithm>
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

}  // namespace tensormem::io::detail
