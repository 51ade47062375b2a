#pragma once
// Tensors out to files and back, asynchronously, through pinned staging buffers.

#include <chrono>
#include <optional>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "tensormem/io/fork_guard.hpp"
#include "tensormem/io/io_engine.hpp"
#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/swap/detail/range_cover.hpp"

namespace tensormem::swap {

/// Swap files are read and written in blocks of a multiple of this many bytes, at offsets
/// that are multiples of it (O_DIRECT's alignment on the file systems in use).
inline constexpr std::size_t io_alignment = 4096;

struct swap_options {
  io::engine_kind engine = io::engine_kind::uring;  ///< falls back to threads, reported
  unsigned queue_depth = 32;                       ///< requests in flight, 1 to io::max_queue_depth
  std::size_t block_bytes = std::size_t{1} << 20;  ///< bytes per I/O request (multiple of io_alignment)
  /// Pinned buffers of block_bytes each, at least 2. Where the pool refuses to lock more
  /// (RLIMIT_MEMLOCK, no unlocked fallback), the swapper keeps those it got, if two or more,
  /// and says so in `swap_stats::fallback` (`staging_buffers` counts them).
  std::size_t staging_buffers = 8;
  bool direct = true;      ///< O_DIRECT where the filesystem allows it (reported otherwise)
  bool checksums = true;   ///< CRC-32C written with each tensor and verified on swap-in
  /// Keep the version before the last of each path as `path.tensormem-spare` and write the
  /// next version into it (its blocks are allocated already): rewrites run at the disk's
  /// speed instead of allocating and freeing (and discarding) every block, at the price of
  /// up to twice the disk space. `remove_files(path)` deletes both.
  bool reuse_files = true;
  /// Tensors of at most this many bytes (0: none) are packed into one unnamed file per
  /// directory (O_TMPFILE; where the file system has none, a file created under a name nothing
  /// else has, never through a link or over a file, and unlinked at once), kept open by the
  /// swapper, at slots that an offset allocator hands out and takes back: no file is opened,
  /// created or renamed per tensor, and a slot holds the bytes alone (size and checksum stay
  /// in the swapper's index), so small tensors move at the disk's speed. A packed tensor
  /// lives in the swapper: the same swapper reads it back by its path; the pack's storage
  /// goes away with the swapper (and with the process, however it ends). No file is created
  /// at the path; a file a swap-out of the path left there before is removed when the path is
  /// first packed (it would be stale).
  std::size_t pack_below = 0;
};

/// A tensor's bytes in host memory.
struct tensor_ref {
  void* data = nullptr;
  std::size_t bytes = 0;
};

/// The outcome for one tensor: error 0 means the tensor's bytes are on disk (swap-out; its
/// memory may be reused now) or back in the tensor (swap-in, checksum verified when on).
struct swap_result {
  std::string path;
  std::size_t bytes = 0;
  int error = 0;        ///< 0 or an errno value (EIO for a short transfer, EBADMSG for a bad checksum)
  std::string message;  ///< empty on success
};

struct swap_stats {
  std::uint64_t tensors_out = 0;
  std::uint64_t tensors_in = 0;
  std::uint64_t bytes_out = 0;
  std::uint64_t bytes_in = 0;
  std::uint64_t failed = 0;
  std::uint64_t staged_bytes = 0;   ///< bytes copied through staging buffers
  std::uint64_t direct_bytes = 0;   ///< bytes written/read straight from/to tensor memory
  double seconds_out = 0;           ///< from submission to completion, summed per ticket
  double seconds_in = 0;
  double seconds_waiting = 0;       ///< time the caller spent blocked in wait/synchronize
  bool direct = false;              ///< O_DIRECT in use
  bool registered_staging = false;  ///< staging buffers registered with io_uring (fixed buffers)
  std::uint64_t staging_buffers = 0; ///< staging buffers in use (fewer than asked: see fallback)
  bool checksums = false;
  std::uint64_t packed_tensors = 0;  ///< paths whose current version sits in a pack file
  std::uint64_t pack_file_bytes = 0; ///< size of the pack files (their high-water marks)
  /// Requests io_uring cancelled, moved by blocking calls (file_io_stats::synchronous_requests).
  std::uint64_t synchronous_requests = 0;
  std::string engine;               ///< "uring" or "threads"
  std::string fallback;             ///< why an engine, O_DIRECT or blocking-call fallback happened; empty if none
  double write_gbps() const noexcept { return seconds_out > 0 ? static_cast<double>(bytes_out) / seconds_out / 1e9 : 0; }
  double read_gbps() const noexcept { return seconds_in > 0 ? static_cast<double>(bytes_in) / seconds_in / 1e9 : 0; }
};

/// DeepSpeed's AsyncTensorSwapper, both ways, on io_uring.
///
/// File format: a 4096-byte header (magic, tensor bytes, CRC-32C of the bytes, flags, the
/// tensor's identity key, and a CRC-32C of the header itself) then the bytes, padded to 4096.
/// Swap-out writes a file beside `path` (its spare `path.tensormem-spare` with `reuse_files`,
/// else a new file of its own) and exchanges it with `path` (renameat2 RENAME_EXCHANGE; a
/// plain rename for a new path) once every byte is on disk: the path holds its old contents
/// or the new ones, never a mix, and a failed swap-out removes its partial file and never
/// reads back as success. A file of its own has no name while it is written (O_TMPFILE in
/// the path's folder): it is linked as `path.tensormem-tmp.<pid>.<swapper>.<n>` at its
/// commit, so a process killed mid-write leaves nothing beside the path. Where the file
/// system has no unnamed files or there is no /proc/self/fd, it is named from the start;
/// where one cannot be linked (no hard links), that swap-out copies its file into a new one
/// of that name, and later ones name theirs from the start (`stats().fallback` says so). The displaced old version becomes the
/// spare, or, without reuse, is unlinked by a reaper thread, off the I/O path.
///
/// Asynchronous for real: a worker thread of the swapper's own opens files, queues the
/// requests and drives the engine, and a committer thread closes each finished tensor's file
/// (and commits a swap-out) while the worker keeps the disk busy, so transfers progress
/// while the caller computes; `wait` is where the caller blocks. Checksums are computed on the worker, block by block:
/// on swap-out as each block is queued (the header, written last, carries the total); on
/// swap-in as each block arrives, in any order, combined in file order at the end. A swap-in
/// reads the header with the first block, in one vectored request (no blocking read first);
/// a swap-out of a tensor of one block writes header and block in one request. At most a
/// quarter of RLIMIT_NOFILE (4 to 256) descriptors are the swapper's at once (one of them the
/// committer's while it commits): files are opened when their tensor's turn comes and closed
/// when it completes.
///
/// Contract:
/// - `swap_out(tensors, paths)` / `swap_in(paths, tensors)` queue the transfers and return a
///   ticket at once. Tensor memory must stay valid and, for swap-out, unchanged until
///   `wait(ticket)` reports it. After a failed swap-in the tensor's contents are unspecified.
/// - Tensors whose memory and size are 4096-aligned move straight between their memory and
///   the file; others go through pinned staging buffers. A staging buffer is reused only after
///   its request completed.
/// - `wait(ticket)` returns one result per tensor. A failed or short write is reported for that
///   tensor (its bytes are still in its memory). Swap-in of a path never written, of a file
///   that holds another size, another tensor (its key differs; the key defaults to the path),
///   a corrupt header (EBADMSG), or, with checksums on, data whose checksum differs or that
///   carries none (EBADMSG), is an error for that tensor. The swapper's setting decides
///   whether data is verified, never the file.
/// - A path may be in one unwaited transfer at a time: a batch naming a path twice, or a
///   path whose earlier transfer was not waited for, throws std::invalid_argument and
///   queues nothing; so does an empty path or one holding a NUL byte.
/// - Swappers (in this process or others) may write one path at once: a spare is reused by
///   one swap-out at a time (locked, flock, from its open until its version is committed);
///   another finds it locked and writes a file of its own name instead, as without reuse.
///   Each commits a complete version; the path holds the later one. A swap-in reads the
///   version committed when it opened the file: it holds the file under a shared lock until
///   it is closed, so another swapper's later swap-out does not overwrite it as its spare.
/// - Memory written by an unwaited swap-in is in no other unwaited transfer: a swap-in whose
///   tensors overlap one another, or overlap the memory of any unwaited transfer, and a
///   swap-out whose tensors overlap the memory of an unwaited swap-in, throw
///   std::invalid_argument and queue nothing (the bytes would be written twice, or read while
///   they are written, each side reporting success). Swap-outs may share memory.
/// - A swap-out replaces only a regular file: a path that names a directory (EISDIR), a
///   symbolic link, a pipe, a socket or a device (EINVAL) is an error for that tensor and
///   stays as it was, also when it appears there while the tensor is being written. The
///   file beside the path is opened with O_NOFOLLOW.
/// - Swap files are regular files: a swap-in from a pipe, a device or a directory, and a
///   swap-out whose spare (`spare_path`) is one, fail that tensor with EINVAL (EISDIR for a
///   directory) naming what the file is. No open waits for a pipe's other end.
/// - Out of memory: `swap_out`, `swap_in` and `wait` throw std::bad_alloc having queued or
///   collected nothing (a refused wait leaves the ticket to wait for again). On the
///   swapper's own threads it fails the tensors it meets with ENOMEM, never the process: a
///   failed swap-out leaves the version before it, as any failed swap-out does.
/// Thread-safe: any thread may queue and wait (one internal mutex, never held while blocked,
/// nor while the worker opens a file, checksums or copies a block or submits requests, so
/// that `done`, `unfinished` and new transfers are answered in microseconds while the disk is
/// busy; Python bindings release the GIL before taking it). The destructor waits for
/// everything. In a child forked after the swapper was made, every call but `options` (and
/// the static ones) throws io::forked_child_error, and the destructor waits for nothing and
/// touches no file: the transfers and files are the parent's.
class tensor_swapper {
 public:
  tensor_swapper(memory::pinned_pool& pool, swap_options options = {});
  /// With an engine of the caller's (tests, instrumentation); `options.engine` is ignored.
  tensor_swapper(memory::pinned_pool& pool, swap_options options,
                 std::unique_ptr<io::io_engine> engine);
  ~tensor_swapper();
  tensor_swapper(const tensor_swapper&) = delete;
  tensor_swapper& operator=(const tensor_swapper&) = delete;

  /// `keys`: one identity per tensor recorded in its file (empty: each path is its key).
  std::uint64_t swap_out(std::span<const tensor_ref> tensors, std::span<const std::string> paths,
                         std::span<const std::string> keys = {});
  /// `keys`: the identity each file must carry (empty: each path).
  std::uint64_t swap_in(std::span<const std::string> paths, std::span<const tensor_ref> tensors,
                        std::span<const std::string> keys = {});
  std::vector<swap_result> wait(std::uint64_t ticket);
  /// `wait`, giving up at `deadline`: std::nullopt when some transfer of the ticket has not
  /// finished by then. The ticket then stays outstanding, its memory in use, for any thread to
  /// wait for again.
  std::optional<std::vector<swap_result>> wait_until(std::uint64_t ticket, std::chrono::steady_clock::time_point deadline);

  /// A wait in slices, for callers that must answer signals between them (Python's Ctrl-C):
  /// it takes the ticket as `wait` does (throwing as `wait` does when the ticket is unknown,
  /// collected, or being waited for by another thread), and holds it for its lifetime, so
  /// that no other thread's `wait` or `synchronize` collects the ticket between slices.
  /// Destroyed before `until` collected the ticket, it lets go: the ticket stays outstanding,
  /// its memory in use, for any thread to wait for. Must not outlive the swapper.
  class ticket_wait {
   public:
    ticket_wait(tensor_swapper& swapper, std::uint64_t ticket);
    ~ticket_wait();
    ticket_wait(const ticket_wait&) = delete;
    ticket_wait& operator=(const ticket_wait&) = delete;
    /// The results once every transfer has finished (the ticket is then collected), or
    /// std::nullopt when `deadline` comes first. Throws std::logic_error once collected.
    std::optional<std::vector<swap_result>> until(std::chrono::steady_clock::time_point deadline);

   private:
    tensor_swapper& swapper_;
    std::uint64_t ticket_;
    bool collected_ = false;
  };
  /// True when every transfer of the ticket has finished (`wait` would not block).
  bool done(std::uint64_t ticket);
  /// True while the ticket has not been collected by `wait` or `synchronize` (from any
  /// thread); once it has, every transfer of it has ended and its tensors are free to reuse.
  bool outstanding(std::uint64_t ticket) const;
  /// Tensors of the ticket whose transfers have not finished yet (0 when `done`); throws
  /// std::invalid_argument for an unknown or already waited ticket, as `done` does.
  std::size_t unfinished(std::uint64_t ticket);
  /// The spare file kept beside `path` when `reuse_files` is on.
  static std::string spare_path(const std::string& path);
  /// Deletes a swap file and its spare (missing ones are ignored); an empty path or one
  /// holding a NUL byte is std::invalid_argument, and so is anything but a regular file at
  /// either path (a device, a pipe, a socket, a symbolic link, a folder: no swapper made it),
  /// removing nothing.
  static void remove_files(const std::string& path);
  /// Forgets a path: frees its packed slot and deletes its files (`remove_files`).
  /// Throws std::invalid_argument while the path is in a transfer not yet waited for, for an
  /// empty path or one holding a NUL byte, and where `remove_files` would, changing nothing.
  void discard(const std::string& path);
  /// Waits for every ticket; their results are dropped.
  void synchronize();
  /// `synchronize`, giving up at `deadline`: false when a ticket is still outstanding then.
  /// The tickets collected before it stay collected (their results dropped).
  bool synchronize_until(std::chrono::steady_clock::time_point deadline);
  swap_stats stats() const;
  /// Named timers (seconds): "checksum", "staging_copy", "wait".
  std::map<std::string, double> timers() const;
  const swap_options& options() const noexcept { return options_; }

 private:
  struct job;
  struct pending_request;
  struct pack_file;
  struct packed_entry {
    pack_file* pack = nullptr;
    std::uint64_t offset = 0;      // of the slot: the bytes alone (no header page)
    std::uint64_t slot_bytes = 0;
    std::uint64_t bytes = 0;       // the tensor's
    std::uint32_t crc = 0;         // CRC-32C of the bytes, when has_crc
    bool has_crc = false;
  };
  using packed_index = std::map<std::string, packed_entry, std::less<>>;
  using clock = std::chrono::steady_clock;

  std::uint64_t start(std::span<const tensor_ref> tensors, std::span<const std::string> paths,
                      std::span<const std::string> keys, bool out);
  void check_memory(std::span<const tensor_ref> tensors, std::span<const std::string> paths, bool out) const;
  void stop_threads_and_free_staging() noexcept;
  // A ticket is taken by one waiter at a time (claim), waited for (without a deadline, null,
  // for as long as the transfers take) and collected, or let go again (unclaim).
  void claim_locked(std::uint64_t ticket);
  void unclaim_locked(std::uint64_t ticket);
  std::optional<std::vector<swap_result>> wait_claimed_locked(std::unique_lock<std::mutex>& lock,
                                                              std::uint64_t ticket, const clock::time_point* deadline);
  // Claims, waits, and lets go when the deadline passes.
  std::optional<std::vector<swap_result>> wait_locked(std::unique_lock<std::mutex>& lock, std::uint64_t ticket,
                                                      const clock::time_point* deadline);
  bool synchronize_locked(std::unique_lock<std::mutex>& lock, const clock::time_point* deadline);
  // The worker's steps run under `lock` (mutex_), which they release while they open a file,
  // checksum or copy a block of a job's bytes, or submit requests to the engine.
  void run();
  void queue_ready(std::unique_lock<std::mutex>& lock);
  void queue_jobs(std::unique_lock<std::mutex>& lock);
  void submit_batch_outside(std::unique_lock<std::mutex>& lock);
  void start_job(std::unique_lock<std::mutex>& lock, std::uint64_t id, job& j);
  bool queue_more(std::unique_lock<std::mutex>& lock, std::uint64_t id, job& j);
  int open_file(const std::string& path, bool out, bool truncate, bool& direct, const char*& refused) const;
  int open_own_file(job& j, bool unnamed, const char*& refused) const noexcept;
  static void name_own_file(job& j) noexcept;
  std::string why_short(const job& j, std::uint64_t file_bytes, int& error) const;
  void note_buffered(const std::string& where) noexcept;
  std::size_t take_staging();
  std::size_t take_header();
  void issue(std::uint64_t id, job& j, std::uint64_t data_offset, void* buffer, std::size_t bytes,
             bool write, std::size_t staging, std::size_t header, void* copy_to,
             std::size_t copy_bytes, std::size_t block);
  void on_completion(std::unique_lock<std::mutex>& lock, const io::io_completion& c);
  void finish(job& j) noexcept;
  void open_job_file(std::unique_lock<std::mutex>& lock, job& j, std::string& own_name) noexcept;
  void complete(job& j);
  void run_committer();
  void close_and_commit(job& j);
  void start_packed(job& j);
  pack_file* pack_for(const std::string& path, std::string& error);
  static int reserve_pack(pack_file& pack, std::uint64_t end);
  void commit_locked(job& j);
  void verify_in(job& j);
  void reap(const std::string& path);
  void run_reaper();

  static constexpr const char* who = "a tensor swapper";
  // What the swapper's threads (or the callers') change under a lock is left as it is in a
  // forked child: a thread of the parent may have been changing it at the fork.
  template <class T>
  using unless_forked = io::detail::unless_forked<T>;
  io::detail::fork_guard made_;
  const std::uint64_t number_;  // unique in the process: names of temporary files
  memory::pinned_pool& pool_;
  swap_options options_;
  std::unique_ptr<io::io_engine> engine_;
  std::vector<std::byte*> staging_;
  unless_forked<std::vector<std::size_t>> free_staging_;
  bool buffered_noted_ = false;         // O_DIRECT's refusal is in stats_.fallback
  // Swap-outs' own files are made without a name (O_TMPFILE) and linked at their commit;
  // false where there is no /proc/self/fd to link them by, or once a link was refused.
  bool unnamed_files_ = false;
  std::size_t data_staging_ = 0;        // staging_[0, data_staging_): block buffers; then header pages
  std::byte* header_slab_ = nullptr;
  unless_forked<std::vector<std::size_t>> free_headers_;
  unless_forked<std::map<std::uint64_t, job>> jobs_;  // by job id
  unless_forked<std::deque<std::uint64_t>> ready_jobs_;  // jobs not yet fully queued, in order
  unless_forked<std::vector<pending_request>> requests_;
  unless_forked<std::vector<io::io_request>> batch_;  // queued by the worker, submitted at once
  unless_forked<std::vector<std::size_t>> free_requests_;
  struct ticket_state {
    std::vector<std::uint64_t> jobs;
    std::size_t unfinished = 0;  // waiters wake when it reaches 0: O(1) per finished job
    bool waiting = false;        // one thread waits for a ticket
  };
  unless_forked<std::map<std::uint64_t, ticket_state>> tickets_;
  std::uint64_t next_ticket_ = 1;
  std::uint64_t next_job_ = 1;
  std::size_t open_files_ = 0;
  std::size_t max_open_files_ = 0;
  std::size_t queued_ = 0;      // requests handed to the engine, not yet complete
  std::size_t max_queued_ = 0;
  swap_stats stats_;
  unless_forked<std::map<std::string, double>> timers_;
  unless_forked<std::set<std::string, std::less<>>> busy_paths_;  // paths of unwaited transfers
  unless_forked<detail::range_cover> reading_;  // the memory of unwaited swap-outs (they may share it)
  unless_forked<detail::range_cover> writing_;  // the memory of unwaited swap-ins (disjoint)
  using packs_by_dir = std::map<std::string, std::unique_ptr<pack_file>>;
  unless_forked<packs_by_dir> packs_;  // by directory
  unless_forked<packed_index> packed_;  // by path: its current version
  bool stop_ = false;
  mutable std::mutex mutex_;
  unless_forked<std::condition_variable> work_cv_;  // the worker: new jobs, or stop
  unless_forked<std::condition_variable> done_cv_;  // waiters: a job finished
  unless_forked<std::thread> worker_;
  // Finished jobs whose file the committer closes, linked through the jobs (job::next_commit)
  // so that queuing one allocates nothing: the worker must not fail there.
  job* commit_head_ = nullptr;
  job* commit_tail_ = nullptr;
  unless_forked<std::condition_variable> commit_cv_;
  bool commit_stop_ = false;
  unless_forked<std::thread> committer_;
  std::mutex reap_mutex_;
  unless_forked<std::condition_variable> reap_cv_;
  unless_forked<std::deque<std::string>> reap_queue_;  // displaced or failed files to unlink
  bool reap_stop_ = false;
  unless_forked<std::thread> reaper_;
};

}  // namespace tensormem::swap
