#pragma once
// Asynchronous file I/O engines behind one interface: io_uring, or a pool of threads.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tensormem::io {

/// One read or write of `bytes` at `offset` of `fd`, optionally followed by a second
/// segment (`bytes2` at `buffer2`, at file offset `offset + bytes`) in the same request
/// (preadv/pwritev): a small file's header page and its data move as one I/O. The buffers
/// must stay valid, and untouched for a write, until the request's completion has been
/// returned by `wait`.
struct io_request {
  int fd = -1;
  std::uint64_t offset = 0;
  void* buffer = nullptr;
  std::size_t bytes = 0;
  bool write = false;
  std::uint64_t user_data = 0;  ///< returned with the completion
  void* buffer2 = nullptr;
  std::size_t bytes2 = 0;
  std::size_t total() const noexcept { return bytes + bytes2; }
};

/// The outcome of one request: the bytes transferred (all of them unless the file ended, or
/// a write stopped making progress) or -errno. Short transfers are continued by the engine;
/// a completion with 0 <= result < bytes means no further progress was possible.
struct io_completion {
  std::uint64_t user_data = 0;
  std::int64_t result = 0;
  std::size_t bytes = 0;  ///< what was asked (both segments)
};

enum class engine_kind { uring, threads };

/// Contract of every engine. Requests are queued by `submit` (never blocks on I/O; the
/// engine keeps at most `queue_depth` in flight and starts the rest as others complete).
/// `wait(n)` blocks until at least n completions are ready (n is clamped to what is
/// outstanding) and returns every ready one. Errors are per request, never exceptions;
/// `submit` and `wait` throw only std::bad_alloc, and then `submit` has taken none of the
/// requests and `wait` keeps every completion for a later call (room for the completions is
/// made by `submit`, so reaping and the engines' own threads never allocate). The destructor
/// waits for everything in flight.
/// Not thread-safe: one thread submits and waits. In a child forked after an engine was made,
/// `submit`, `wait` and `register_buffers` throw forked_child_error and the destructor waits
/// for nothing (the requests in flight are the parent's; an io_uring ring is shared with it).
class io_engine {
 public:
  virtual ~io_engine() = default;
  virtual void submit(std::span<const io_request> requests) = 0;
  virtual std::vector<io_completion> wait(std::size_t min_completions) = 0;
  /// Submitted requests whose completions have not been returned yet.
  virtual std::size_t outstanding() const noexcept = 0;
  virtual engine_kind kind() const noexcept = 0;
  virtual unsigned queue_depth() const noexcept = 0;
  /// Requests the engine moved itself with blocking preadv/pwritev on the thread that waits,
  /// because io_uring cancelled them: it could not start a kernel worker for them (its
  /// workers count against RLIMIT_NPROC, the user's limit on processes and threads). Each
  /// completes as if io_uring had moved it. Safe to read from any thread; 0 for the thread
  /// engine.
  virtual std::uint64_t synchronous_requests() const noexcept { return 0; }
  /// Threads of the engine's own that move requests (the thread engine's workers; fewer than
  /// asked where a limit on threads stopped the rest); 0 for io_uring, whose kernel moves them.
  virtual unsigned workers() const noexcept { return 0; }
  /// Registers memory regions that later requests may use (io_uring fixed buffers: the kernel
  /// maps them once instead of per request). Returns false, changing nothing, where the
  /// engine or the system does not allow it (RLIMIT_MEMLOCK, or no io_uring); requests work
  /// either way. Call it while nothing is outstanding; the regions must outlive the engine.
  virtual bool register_buffers(std::span<const std::span<std::byte>> regions) {
    (void)regions;
    return false;
  }
};

/// The deepest queue an engine takes: io_uring's limit on the entries of one ring
/// (IORING_MAX_ENTRIES), kept by the thread engine too so that the two take the same options.
inline constexpr unsigned max_queue_depth = 32768;

/// An io_uring engine (liburing). Throws std::system_error when io_uring cannot be set up
/// (old kernel, seccomp, io_uring_disabled) or lacks an operation the engine uses (EOPNOTSUPP,
/// naming it: kernels before 5.6 have no plain read or write), std::invalid_argument for a queue depth above
/// max_queue_depth (0 counts as 1, as for every engine).
std::unique_ptr<io_engine> make_uring_engine(unsigned queue_depth);
/// pread/pwrite on `threads` threads, at most `queue_depth` requests in flight. Where fewer
/// threads can be started (a limit on threads), those that started move every request
/// (`workers()` counts them); where none can, std::system_error naming the engine.
std::unique_ptr<io_engine> make_thread_engine(unsigned queue_depth, unsigned threads = 4);

/// The engine asked for; when io_uring is asked for but unavailable, the thread engine,
/// with the reason written to `fallback_reason` (empty when no fallback happened; a thread
/// engine with fewer threads than asked says so there too). A queue
/// depth above max_queue_depth is std::invalid_argument, not a reason to fall back.
std::unique_ptr<io_engine> make_engine(engine_kind preferred, unsigned queue_depth,
                                       std::string& fallback_reason);

std::string_view to_string(engine_kind kind) noexcept;

namespace detail {
/// The out-of-memory policy of a thread that drives an engine (a ring's, the swapper's
/// worker), where an exception would end the process. `submit_or_refuse` hands `requests` to
/// the engine and returns false where it ran out of memory (it then took none: the caller
/// fails each with ENOMEM). `wait_or_pause` waits for at least one completion; out of memory
/// it pauses 1 ms and returns none (the engine keeps its completions, and the requests in
/// flight hold their buffers, so they cannot be given up: a later call collects them).
bool submit_or_refuse(io_engine& engine, std::span<const io_request> requests) noexcept;
std::vector<io_completion> wait_or_pause(io_engine& engine) noexcept;
/// Adds `reason` to a list of fallback reasons (the `fallback` of the stats), "; " between;
/// std::bad_alloc leaves the list as it was.
void append_reason(std::string& reasons, std::string_view reason);
}  // namespace detail

}  // namespace tensormem::io
