#pragma once
// Raw file reads and writes of caller buffers, queued and completed in the background on the
// io engines: DeepSpeed's aio_handle semantics (no header, any file offset), with every
// request's result checked.

#include <fcntl.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tensormem/io/fork_guard.hpp"
#include "tensormem/io/io_engine.hpp"

namespace tensormem::io {

/// Opens with O_DIRECT when `direct` is set, and again without it when the filesystem
/// refuses O_DIRECT (EINVAL); `direct` then reads false. `open_as(extra_flags)` opens.
template <class Open>
int open_direct_or_buffered(Open open_as, bool& direct) {
  int fd = open_as(direct ? O_DIRECT : 0);
  if (fd < 0 && errno == EINVAL && direct) {
    direct = false;
    fd = open_as(0);
  }
  return fd;
}

/// What a file of this mode is, for a message: "a regular file", "a directory", "a pipe",
/// "a symbolic link", "a socket" or "a device".
const char* kind_of_file(unsigned mode) noexcept;

/// The mode of what is at `path` itself (a symbolic link is not followed), or nullopt where
/// nothing is there or it cannot be looked at (lstat fails).
std::optional<unsigned> mode_at(const std::string& path) noexcept;

/// What a transfer's errno means, for its message: the system's words, and for ECANCELED
/// (nothing here cancels a request: io_uring does when it cannot start a kernel worker for
/// one, and the io_uring engine then moves it by blocking calls; an engine given through
/// `file_io_options::make_engine` may still report it) the likely cause.
std::string describe_transfer_error(int error);

/// The errno that refuses a file of this mode where a regular file is wanted: EISDIR for a
/// directory, else EINVAL.
int not_a_file_error(unsigned mode) noexcept;

/// Something other than a regular file where one is wanted: the errno that refuses it
/// (not_a_file_error) and what it is (kind_of_file), for the caller's message.
struct not_a_file {
  int error = 0;
  const char* kind = nullptr;
};

/// What refuses `path` where a regular file is wanted: nullopt where nothing is there, a
/// regular file is, or (with `link_allowed`, for a path a rename replaces) a symbolic link;
/// else the errno and what is there. A link is not followed.
std::optional<not_a_file> not_a_file_at(const std::string& path, bool link_allowed = false) noexcept;

/// Keeps `fd`, opened with O_NONBLOCK so that the open could not wait, clearing O_NONBLOCK.
/// With `regular_only`, anything but a regular file is closed and refused: -1 with errno
/// EISDIR for a directory, else EINVAL, and `refused` naming what it is. With `fd` < 0 and
/// errno ENXIO (a pipe's write end with no reader), `path` is looked at to name it (errno
/// EINVAL when `regular_only`, ENXIO kept otherwise). Never blocks.
int keep_opened_file(int fd, const char* path, const char*& refused, bool regular_only = true) noexcept;

/// open_direct_or_buffered for a file that must be a regular file (swap files, the files of
/// async_file_io). The open itself never waits: O_NONBLOCK is added, so that a pipe with no
/// one at its other end or a terminal cannot hold the caller, and cleared once the file is
/// known to be regular. Anything else is refused as keep_opened_file says; `refused` is null
/// when the open failed for another reason (errno set by open).
template <class Open>
int open_regular_file(const char* path, Open open_as, bool& direct, const char*& refused) {
  refused = nullptr;
  return keep_opened_file(open_direct_or_buffered([&](int extra) { return open_as(extra | O_NONBLOCK); }, direct),
                          path, refused);
}

/// The most rings one async_file_io drives (each is an engine and a thread).
inline constexpr unsigned max_rings = 256;

struct file_io_options {
  std::size_t block_bytes = std::size_t{1} << 20;  ///< bytes per request (an op is split in blocks)
  unsigned queue_depth = 128;                      ///< requests in flight per ring, 1 to max_queue_depth
  /// Engines (1 to max_rings), each driven by its own thread; an op's blocks are dealt out in
  /// turn. Where a limit on threads lets fewer ring threads start (one at least), those rings
  /// take every block, and stats().fallback says so.
  unsigned rings = 1;
  engine_kind engine = engine_kind::uring;
  bool direct = true;           ///< O_DIRECT where buffer, offset and length are 4096-aligned
  /// false: the files are the caller's own, and a symbolic link at a path is refused (EINVAL,
  /// "it is a symbolic link, not a regular file") instead of followed (O_NOFOLLOW).
  bool follow_links = true;
  /// Makes each ring's engine instead of `engine` (tests wrap engines to inject faults).
  std::function<std::unique_ptr<io_engine>(unsigned queue_depth)> make_engine;
};

/// One failed operation: the file, an errno value, what happened, and the ticket that
/// `read` or `write` returned for it.
struct file_io_error {
  std::string path;
  int error = 0;
  std::string message;
  std::uint64_t ticket = 0;
};

struct file_io_stats {
  std::uint64_t ops = 0;           ///< completed operations (failed ones included)
  std::uint64_t failed = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t direct_ops = 0;    ///< operations done with O_DIRECT
  std::uint64_t buffered_ops = 0;  ///< operations through the page cache (unaligned, or refused)
  std::uint64_t requests = 0;      ///< block requests handed to the engines
  /// Requests io_uring cancelled (it could not start a kernel worker: RLIMIT_NPROC), moved by
  /// blocking calls on the ring's thread instead (io_engine::synchronous_requests); `fallback`
  /// says so too (after any other reason, "; " between them).
  std::uint64_t synchronous_requests = 0;
  std::string engine;              ///< "uring" or "threads"
  std::string fallback;            ///< why io_uring, O_DIRECT or a kernel worker was not used; empty if they were
};

/// `fallback`'s words for requests io_uring cancelled and an engine moved by blocking calls.
std::string synchronous_fallback(std::uint64_t requests);

/// Queues whole-buffer reads and writes of files and completes them on background threads
/// (the caller need not be inside the object for the bytes to move). An operation opens its
/// file when it is queued (a write creates it, mode 0600, and never truncates: bytes outside
/// the written range stay), is split into `block_bytes` requests, and finishes when every
/// request has; a request that fails or transfers fewer bytes than asked (the file ended)
/// fails its operation with the path and errno, reported by `wait`. A failed write leaves
/// the file as the failure found it: bytes outside the write unchanged, bytes of its
/// requests that succeeded written, and a file the write created (possibly empty) in place.
/// The largest file a file system takes (16 TiB on ext4 with 4 KiB blocks) is not known
/// before writing: a write past it, or past RLIMIT_FSIZE, fails with EFBIG. Out of memory on
/// a background thread, the requests its engine could not take fail their operation with
/// ENOMEM; `wait` and `wait_for` that throw std::bad_alloc collect nothing. Thread-safe.
/// In a child forked after it was made, every call but `options` throws forked_child_error,
/// and the destructor waits for nothing and frees nothing the object's threads change (the
/// child's copies of queued operations' descriptors stay open until it exits or execs).
class async_file_io {
 public:
  explicit async_file_io(file_io_options options = {});
  ~async_file_io();  ///< waits for every queued operation (in a forked child, for nothing)
  async_file_io(const async_file_io&) = delete;
  async_file_io& operator=(const async_file_io&) = delete;

  /// Queues a read of `bytes` at `file_offset` of `path` into `buffer` (which must stay valid
  /// until `wait` returns). Throws std::system_error naming the path when the file cannot be
  /// opened, is not a regular file (a pipe, a device: EINVAL, naming what it is; a directory:
  /// EISDIR; a symbolic link without `follow_links`: EINVAL; the open never waits for a
  /// pipe's other end), or is shorter than
  /// `file_offset + bytes`, std::invalid_argument for an empty path
  /// or one holding a NUL byte (io::check_path_argument); nothing is queued then. With `validate`,
  /// `wait` reads the range again through the page cache and compares: bytes that differ, or
  /// a file that now ends inside the range, fail the operation with EBADMSG, and a read back
  /// that fails, with its errno (each message says which). Returns the
  /// operation's ticket for `wait_for`.
  std::uint64_t read(void* buffer, std::size_t bytes, const std::string& path, std::uint64_t file_offset,
                     bool validate = false);
  /// Queues a write of `bytes` from `buffer` (valid and unchanged until it is collected), to a
  /// regular file only, as `read`.
  std::uint64_t write(const void* buffer, std::size_t bytes, const std::string& path, std::uint64_t file_offset,
                      bool validate = false);

  struct wait_result {
    std::size_t completed = 0;          ///< operations finished since the last wait
    std::vector<file_io_error> errors;  ///< one per failed operation, in queuing order
  };
  /// Blocks until every queued operation has finished.
  wait_result wait();
  /// `wait`, giving up at `deadline`: std::nullopt when an operation has not finished by then,
  /// and nothing is collected (buffers stay in use; a later wait collects them all).
  std::optional<wait_result> wait_until(std::chrono::steady_clock::time_point deadline);
  /// Blocks until the operation `ticket` has finished and collects it (a later `wait` does not
  /// count it again): its error, or an empty `path` and `error == 0` when it succeeded. Throws
  /// std::invalid_argument for a ticket that is unknown or already collected.
  file_io_error wait_for(std::uint64_t ticket);
  /// Operations queued and not yet collected by `wait`.
  std::size_t pending() const;
  file_io_stats stats() const;
  const file_io_options& options() const noexcept { return options_; }

 private:
  void stop_rings() noexcept;  // waits for queued operations, then ends the started threads
  struct op {
    std::string path;
    int fd = -1;
    bool write = false;
    bool validate = false;
    bool direct = false;
    std::byte* buffer = nullptr;
    std::size_t bytes = 0;
    std::uint64_t file_offset = 0;
    std::size_t unfinished = 0;  // requests not yet completed
    bool finished = false;
    int error = 0;
    // A short transfer: the bytes moved of the bytes asked. The message is made where the
    // operation is collected, on the caller's thread: a ring's thread never allocates for it.
    std::int64_t moved = 0;
    std::size_t asked = 0;
    std::string message;  // made by failure_message, or by the validation
  };
  struct ring {
    std::unique_ptr<io_engine> engine;
    detail::unless_forked<std::vector<io_request>> queued;  // requests not yet given to the engine
    detail::unless_forked<std::condition_variable> work;
    detail::unless_forked<std::thread> thread;
  };

  std::uint64_t queue(bool write, std::byte* buffer, std::size_t bytes, const std::string& path,
                      std::uint64_t file_offset, bool validate);
  void check_validation(op& o);
  static void make_message(op& o);
  void run(ring& r);
  void complete(const io_completion& c) noexcept;
  void finish(op& o);

  static constexpr const char* who = "an async_file_io";
  detail::fork_guard made_;
  file_io_options options_;
  mutable std::mutex mutex_;
  detail::unless_forked<std::condition_variable> done_;
  std::vector<std::unique_ptr<ring>> rings_;
  // The operations and each ring's queue are changed by the rings' threads and the callers;
  // like the threads, they are left as they are in a forked child.
  detail::unless_forked<std::map<std::uint64_t, op>> ops_;  // queued, not yet collected, by id (queuing order)
  std::uint64_t next_id_ = 1;
  std::size_t unfinished_ops_ = 0;
  std::size_t next_ring_ = 0;
  bool stop_ = false;
  file_io_stats stats_;
};

}  // namespace tensormem::io
