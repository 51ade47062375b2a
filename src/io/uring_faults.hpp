#pragma once
// Test seam of the io_uring engine: replaces io_uring_submit / io_uring_wait_cqe so that
// tests can make them fail as a kernel may (-EBUSY, -EAGAIN, -EINTR, or a hard error), and
// change what a completion reports (a short transfer, -ECANCELED) and which operations the
// kernel says it has.

#include <liburing.h>

#include <functional>
#include <memory>

#include "tensormem/io/io_engine.hpp"

namespace tensormem::io::detail {

struct uring_faults {
  std::function<int(io_uring*)> submit;                 ///< empty: io_uring_submit
  std::function<int(io_uring*, io_uring_cqe**)> wait;   ///< empty: io_uring_wait_cqe
  std::function<int(int res)> result;                   ///< a completion's result; empty: the kernel's
  std::function<bool(int opcode)> supported;            ///< empty: the kernel's probe
};

std::unique_ptr<io_engine> make_uring_engine(unsigned queue_depth, uring_faults faults);

}  // namespace tensormem::io::detail
