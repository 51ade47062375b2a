#include "tensormem/swap/tensor_swapper.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <stdexcept>
#include <string_view>
#include <tuple>

#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/io/detail/blocking.hpp"
#include "tensormem/io/file_io.hpp"
#include "tensormem/io/path_argument.hpp"
#include "tensormem/memory/errors.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"
#include "tensormem/swap/crc32c.hpp"
#include "tensormem/core/detail/thread_start.hpp"

namespace tensormem::swap {

namespace {

constexpr std::size_t header_bytes = 4096;
constexpr char magic[8] = {'T', 'M', 'S', 'W', 'A', 'P', '0', '2'};
constexpr std::size_t no_staging = static_cast<std::size_t>(-1);
constexpr std::size_t key_room = 4000;    // bytes of the key kept in the header (its tail)
constexpr std::size_t submit_batch = 8;  // requests handed to the engine at once, at most

// The first 4096 bytes of a swap file. header_crc covers all 4096 bytes (with header_crc
// itself zero), so a flipped bit anywhere in the header is detected whatever the setting.
struct file_header {
  char magic[8];
  std::uint64_t bytes;
  std::uint32_t crc;         // CRC-32C of the tensor bytes (when flags & 1)
  std::uint32_t flags;       // bit 0: crc present
  std::uint64_t key_bytes;   // length of the identity key
  std::uint32_t key_crc;     // CRC-32C of the whole key
  std::uint32_t header_crc;
  char key_tail[key_room];   // the last key_room bytes of the key
};
static_assert(sizeof(file_header) <= header_bytes);

std::uint32_t crc_of(const std::string& s) { return crc32c(s.data(), s.size()); }

void write_header(std::byte* page, std::uint64_t bytes, std::uint32_t crc, bool crc_present,
                  const std::string& key) {
  std::memset(page, 0, header_bytes);
  file_header h{};
  std::memcpy(h.magic, magic, sizeof magic);
  h.bytes = bytes;
  h.crc = crc;
  h.flags = crc_present ? 1U : 0U;
  h.key_bytes = key.size();
  h.key_crc = crc_of(key);
  const std::size_t tail = std::min(key.size(), key_room);
  std::memcpy(h.key_tail, key.data() + key.size() - tail, tail);
  std::memcpy(page, &h, sizeof h);
  h.header_crc = crc32c(page, header_bytes);
  std::memcpy(page, &h, sizeof h);
}

// Empty when the page is a sound header of `key`, else why not.
std::string check_header(const std::byte* page, const std::string& key, file_header& h) {
  std::memcpy(&h, page, sizeof h);
  if (std::memcmp(h.magic, magic, sizeof magic) != 0) return "is not a tensormem swap file";
  const std::uint32_t stored = h.header_crc;
  std::byte copy[header_bytes];
  std::memcpy(copy, page, header_bytes);
  file_header zeroed = h;
  zeroed.header_crc = 0;
  std::memcpy(copy, &zeroed, sizeof zeroed);
  if (crc32c(copy, header_bytes) != stored) return "has a corrupt header";
  const std::size_t tail = std::min(key.size(), key_room);
  if (h.key_bytes != key.size() || h.key_crc != crc_of(key) ||
      std::memcmp(h.key_tail, key.data() + key.size() - tail, tail) != 0) {
    return "holds another tensor (its identity key differs)";
  }
  return {};
}

// A number no other swapper of this process has (names of temporary files: two swappers
// writing one path never share one).
std::uint64_t next_swapper_number() {
  static std::atomic<std::uint64_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed);
}

// The errno of a header check_header refused: EBADMSG for a damaged one, EINVAL for one
// of another file or tensor.
int header_error(const std::string& problem) {
  return problem.find("corrupt") != std::string::npos ? EBADMSG : EINVAL;
}

std::string holds_another_size(const std::string& path, std::uint64_t file_bytes, std::uint64_t tensor_bytes) {
  return path + " holds " + std::to_string(file_bytes) + " bytes; the tensor has " + std::to_string(tensor_bytes);
}

// What is wrong with `page`, the header of the swap file at `path` read for a tensor of
// `tensor_bytes` bytes and identity `key` (with its errno), or empty when it is that
// tensor's: damaged, another file or tensor, another size. `h` gets the header.
std::string header_problem(const std::byte* page, const std::string& path, const std::string& key,
                           std::uint64_t tensor_bytes, file_header& h, int& error) {
  if (std::string problem = check_header(page, key, h); !problem.empty()) {
    error = header_error(problem);
    return path + " " + problem;
  }
  if (h.bytes != tensor_bytes) {
    error = EINVAL;
    return holds_another_size(path, h.bytes, tensor_bytes);
  }
  return {};
}

std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

bool aligned(const void* p, std::size_t n) {
  return reinterpret_cast<std::uintptr_t>(p) % io_alignment == 0 && n % io_alignment == 0;
}

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Descriptors of files the swapper holds at once: a quarter of the soft RLIMIT_NOFILE (the rest
// is the program's), between 4 and 256.
std::size_t open_file_budget() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 256;
  return std::clamp<std::size_t>(static_cast<std::size_t>(limit.rlim_cur) / 4, 4, 256);
}

}  // namespace

struct tensor_swapper::job {
  std::uint64_t ticket = 0;
  std::string path;
  std::string key;        // identity recorded in (swap-out) or expected of (swap-in) the file
  std::string temp_path;  // swap-out writes here, then renames onto `path` (packed: the spare's name)
  bool own_temp = false;  // temp_path is a name of this job's (not the path's spare)
  std::string folder;     // swap-out: the path's folder, where a file of its own is made
  bool unnamed = false;   // its own file has no name yet (O_TMPFILE): temp_path is the one it will take
  bool link_refused = false;  // the file system could not link its unnamed file (no hard links)
  tensor_ref tensor;
  bool out = true;
  int fd = -1;
  bool direct = false;
  bool opened = false;           // the worker has started it
  std::size_t next_offset = 0;   // next data byte to queue
  bool header_queued = false;
  std::size_t requests_left = 0;
  bool done = false;
  int error = 0;
  std::string message;
  std::uint32_t crc = 0;                 // swap-out: running CRC of the bytes queued so far
  std::vector<std::uint32_t> block_crc;  // swap-in: CRC of each block, as it arrived
  bool header_read = false;              // swap-in: the header arrived and was checked
  std::uint32_t file_crc = 0;
  bool file_has_crc = false;
  bool packed = false;            // in a pack file (decided when queued)
  bool first_pack = false;        // swap-out: the path was not packed before
  pack_file* pack = nullptr;
  std::uint64_t data_start = header_bytes;  // file offset of the first byte (a pack slot's start)
  std::uint64_t slot_bytes = 0;   // packed swap-out: the slot taken
  packed_index::node_type index_node;  // packed swap-out of a path not packed before: its entry, made ahead
  job* next_commit = nullptr;          // the committer's queue
  std::chrono::steady_clock::time_point started;
  std::chrono::steady_clock::time_point finished;
  bool fully_queued() const noexcept { return header_queued && next_offset >= tensor.bytes; }
};

struct tensor_swapper::pending_request {
  std::uint64_t job = 0;
  std::size_t staging = no_staging;  // data staging buffer, if the data is staged
  std::size_t header = no_staging;   // header page, if the request carries the header
  void* copy_to = nullptr;  // staged read: where the bytes go once read
  std::size_t copy_bytes = 0;
  std::size_t expected = 0;
  std::size_t block = 0;    // data block index; header_block for a header alone
  bool write = false;
};

// An unnamed file in one directory holding small tensors at slots of `space`.
struct tensor_swapper::pack_file {
  int fd = -1;
  bool direct = false;
  std::uint64_t reserved = 0;  // bytes allocated to the file with fallocate
  core::best_fit_allocator space{core::growing, io_alignment};
  ~pack_file() {
    if (fd >= 0) close(fd);
  }
};

namespace {
constexpr std::size_t header_block = static_cast<std::size_t>(-1);
}  // namespace

tensor_swapper::tensor_swapper(memory::pinned_pool& pool, swap_options options)
    : tensor_swapper(pool, options, nullptr) {}

tensor_swapper::tensor_swapper(memory::pinned_pool& pool, swap_options options,
                               std::unique_ptr<io::io_engine> engine)
    : number_(next_swapper_number()), pool_(pool), options_(options), engine_(std::move(engine)) {
  if (options_.block_bytes == 0 || options_.block_bytes % io_alignment != 0) {
    throw std::invalid_argument("tensor_swapper: block_bytes must be a positive multiple of 4096");
  }
  if (options_.queue_depth == 0 || options_.queue_depth > io::max_queue_depth) {
    throw std::invalid_argument("tensor_swapper: queue_depth must be 1 to " + std::to_string(io::max_queue_depth) +
                                ", not " + std::to_string(options_.queue_depth));
  }
  if (options_.staging_buffers < 2) {
    throw std::invalid_argument("tensor_swapper: staging_buffers must be at least 2 (a block is staged while another "
                                "moves), not " + std::to_string(options_.staging_buffers));
  }
  std::string reason;
  if (!engine_) engine_ = io::make_engine(options_.engine, options_.queue_depth, reason);
  stats_.engine = std::string(io::to_string(engine_->kind()));
  stats_.fallback = reason;
  stats_.checksums = options_.checksums;
  stats_.direct = options_.direct;
  unnamed_files_ = access("/proc/self/fd", X_OK) == 0;
  // One of the budget is the committer's: it holds a duplicate of a swap-out's descriptor
  // while it closes the file and commits it.
  max_open_files_ = open_file_budget() - 1;
  max_queued_ = std::max<std::size_t>(2U * std::max(engine_->queue_depth(), 1U), 8);
  const std::size_t count = options_.staging_buffers;
  // Headers have pages of their own (one per request the swapper may have queued), so small
  // tensors do not hold a whole staging buffer each for their 4 KiB header.
  const std::size_t headers = max_queued_;
  // Checked before any is taken: buffers locked one by one would hold the whole machine
  // before the pool refused one.
  const std::size_t physical = memory::physical_memory_bytes();
  const std::size_t header_total = headers * header_bytes;  // at most 2 x 32,768 pages
  if (header_total >= physical || options_.block_bytes > (physical - header_total) / count) {
    throw memory::out_of_memory("tensor_swapper: " + std::to_string(count) + " staging buffers of " +
                                std::to_string(options_.block_bytes) + " bytes are more than this machine's " +
                                std::to_string(physical) + " bytes of memory");
  }
  // Room first: once a buffer is taken from the pool nothing allocates until the buffers are
  // registered, and a failure there gives every one back (the constructor runs no destructor).
  staging_.reserve(count + headers);
  // So is the room the worker needs (a request's record and its place in a batch, at most
  // max_queued_ of them; the timers it adds to): its thread must not run out of memory there.
  requests_->reserve(max_queued_);
  free_requests_->reserve(max_queued_);
  batch_->reserve(max_queued_);
  for (const char* name : {"checksum", "staging_copy", "wait"}) timers_->emplace(name, 0.0);
  free_staging_->reserve(count);
  free_headers_->reserve(headers);
  std::vector<std::span<std::byte>> regions;
  regions.reserve(count + 1);
  std::size_t taken = 0;  // staging buffers from the pool
  try {
    // The header pages first, then the staging buffers: those beyond what the memory-lock
    // limit lets the pool lock are given up, down to two, and reported.
    header_slab_ = static_cast<std::byte*>(pool_.allocate(headers * header_bytes, io_alignment));
    for (; taken < count; ++taken) {
      try {
        staging_.push_back(static_cast<std::byte*>(pool_.allocate(options_.block_bytes, io_alignment)));
      } catch (const memory::lock_limit_error&) {
        if (taken < 2) throw;
        io::detail::append_reason(stats_.fallback, "RLIMIT_MEMLOCK let the swapper lock " + std::to_string(taken) +
                                                       " of its " + std::to_string(count) + " staging buffers of " +
                                                       std::to_string(options_.block_bytes) + " bytes");
        break;
      }
      free_staging_->push_back(taken);
    }
    data_staging_ = taken;
    stats_.staging_buffers = taken;
    for (std::size_t i = 0; i < headers; ++i) {
      free_headers_->push_back(staging_.size());
      staging_.push_back(header_slab_ + i * header_bytes);
    }
    // Fixed buffers where io_uring allows them; plain requests otherwise.
    for (std::size_t i = 0; i < data_staging_; ++i) regions.emplace_back(staging_[i], options_.block_bytes);
    regions.emplace_back(header_slab_, headers * header_bytes);
    stats_.registered_staging = engine_->register_buffers(regions);
  } catch (...) {
    engine_.reset();  // unregisters whatever it registered before the buffers go back
    for (std::size_t i = 0; i < taken; ++i) pool_.free(staging_[i]);
    if (header_slab_ != nullptr) pool_.free(header_slab_);
    try {
      throw;
    } catch (const memory::lock_limit_error& e) {
      // Which options size what the swapper locks.
      throw memory::lock_limit_error(
          std::string(e.what()) + ". The swapper locks " + std::to_string(headers) + " header pages and at least two " +
              "staging buffers of " + std::to_string(options_.block_bytes) + " bytes (" +
              std::to_string(2 * options_.block_bytes + header_total) +
              " bytes): a smaller block_bytes or a smaller queue_depth lock less",
          e.requested_bytes(), e.limit_bytes());
    }
  }
  try {
    *reaper_ = std::thread([this] { run_reaper(); });
    *committer_ = std::thread([this] { run_committer(); });
    *worker_ = std::thread([this] { run(); });
  } catch (...) {
    // No thread to start (EAGAIN): end those started and give the staging back, as the
    // destructor would (a joinable thread destroyed would end the process).
    stop_threads_and_free_staging();
    core::detail::rethrow_naming_thread_start("tensor_swapper");
  }
}

tensor_swapper::~tensor_swapper() {
  // In a forked child the threads do not exist and the lock may be a parent thread's: the
  // transfers are the parent's, and so are the files (a swap-out's file beside its path is
  // neither committed nor removed here). Nothing is waited for or given back to the pool.
  if (made_.forked()) return;
  try {
    synchronize();
  } catch (...) {  // std::bad_alloc collecting the results: every transfer still ends first
    std::unique_lock lock(mutex_);
    done_cv_->wait(lock, [this] {
      return std::all_of(tickets_->begin(), tickets_->end(), [](const auto& t) { return t.second.unfinished == 0; });
    });
  }
  stop_threads_and_free_staging();
}

void tensor_swapper::stop_threads_and_free_staging() noexcept {
  {
    const std::lock_guard lock(mutex_);
    stop_ = true;
  }
  work_cv_->notify_all();
  if (worker_->joinable()) worker_->join();
  {
    const std::lock_guard lock(mutex_);
    commit_stop_ = true;
  }
  commit_cv_->notify_all();
  if (committer_->joinable()) committer_->join();
  {
    const std::lock_guard lock(reap_mutex_);
    reap_stop_ = true;
  }
  reap_cv_->notify_all();
  if (reaper_->joinable()) reaper_->join();  // every displaced file is gone before this returns
  engine_.reset();  // unregisters the staging buffers before they go back to the pool
  for (std::size_t i = 0; i < data_staging_; ++i) pool_.free(staging_[i]);
  pool_.free(header_slab_);
}

namespace {

// What is at `path` ("a pipe", "a device"...) where something other than a regular file is;
// nullptr where a regular file or nothing is.
const char* other_than_a_file(const std::string& path) {
  const auto there = io::not_a_file_at(path);
  return there ? there->kind : nullptr;
}

// Why a swap-out must not replace what is at `path`, or empty when it may: nothing there, or
// a regular file. The commit exchanges the new file with whatever the path names, so a
// directory would be moved aside (with everything in it) and a symbolic link replaced.
std::string not_replaceable_message(const std::string& path, const char* kind) {
  return path + " is " + kind + "; a swap-out replaces only a regular file (or makes a new one)";
}

std::string not_replaceable(const std::string& path, int& error) {
  const auto there = io::not_a_file_at(path);
  if (!there) return {};
  error = there->error;
  return not_replaceable_message(path, there->kind);
}

// Sets a failure's message. Out of memory it stays empty, and the call that collects the job
// makes a plain one from its errno: the swapper's threads must not fail while they report.
template <class Make>
void set_message(std::string& message, Make&& make) noexcept {
  try {
    message = make();
  } catch (...) {
    message.clear();
  }
}

}  // namespace

// Buffered I/O where O_DIRECT was asked for: reported once (the first file's folder), after
// any other reason.
void tensor_swapper::note_buffered(const std::string& where) noexcept {
  stats_.direct = false;
  if (buffered_noted_) return;
  buffered_noted_ = true;
  try {
    io::detail::append_reason(stats_.fallback, "O_DIRECT refused by the filesystem of " + where + "; buffered I/O");
  } catch (...) {
    // No memory for the words: `direct` false still says it, and an empty fallback gets the
    // short form, which allocates nothing.
    if (stats_.fallback.empty()) stats_.fallback = "buffered I/O";
  }
}

int tensor_swapper::open_file(const std::string& path, bool out, bool truncate, bool& direct,
                              const char*& refused) const {
  // Reads leave the access time alone (after every rewrite, relatime would dirty the inode
  // on the next read): O_NOATIME where we own the file (it needs the owner: EPERM else).
  // A swap-out writes its own file beside the path: never through a symbolic link there.
  int flags = out ? O_WRONLY | O_CREAT | O_NOFOLLOW | (truncate ? O_TRUNC : 0) : O_RDONLY | O_NOATIME;
  direct = options_.direct;
  // Only a regular file: a pipe or a device at the path (or at the spare's) would hold the
  // worker in open(), and every transfer behind it, for as long as no one opened its other
  // end.
  return io::open_regular_file(path.c_str(), [&](int extra) {
    int f = open(path.c_str(), flags | extra | O_CLOEXEC, 0644);
    if (f < 0 && errno == EPERM && (flags & O_NOATIME) != 0) {
      flags &= ~O_NOATIME;
      f = open(path.c_str(), flags | extra | O_CLOEXEC, 0644);
    }
    return f;
  }, direct, refused);
}

// A swap-out's file of its own (without reuse, or where the spare is another's), in the
// path's folder. Where the file system can (O_TMPFILE, and /proc/self/fd to link it by), it
// has no name until its commit links it as `temp_path`: a process killed while it writes
// leaves nothing behind. Elsewhere (NFS: EOPNOTSUPP; an old kernel: EISDIR; any failure, which
// the named file meets again and reports by its name) it is `temp_path` from the start.
int tensor_swapper::open_own_file(job& j, bool unnamed, const char*& refused) const noexcept {
  j.unnamed = false;
  if (unnamed && io::detail::unnamed_temporaries_allowed()) {
    j.direct = options_.direct;
    const int fd = io::open_regular_file(j.folder.c_str(), [&](int extra) {
      return open(j.folder.c_str(), O_TMPFILE | O_WRONLY | extra | O_CLOEXEC, 0644);
    }, j.direct, refused);
    if (fd >= 0) {
      j.unnamed = true;
      return fd;
    }
  }
  return open_file(j.temp_path, true, true, j.direct, refused);
}

// Gives a swap-out's unnamed file its name, `temp_path`, once every byte is written (the
// exchange with the path needs one). A file left at that name (by an earlier process of this
// pid) is replaced, as the named file would have been; anything else there is left as it is
// and fails the swap-out. Where the file system cannot link it (unnamed files but no hard
// links: EPERM, EOPNOTSUPP), its bytes are copied into a new file of that name, which takes
// its place; the commit then switches later swap-outs to files named from the start.
// Allocates nothing but a failure's message (and the copy's buffer, where copy_file_range is
// refused).
void tensor_swapper::name_own_file(job& j) noexcept {
  char by[48];
  std::snprintf(by, sizeof by, "/proc/self/fd/%d", j.fd);
  // A regular file at the name is stale (the job's name is unique in the process): replaced.
  const auto replacing = [&](auto make) {
    int rc = make();
    if (rc < 0 && errno == EEXIST && other_than_a_file(j.temp_path) == nullptr &&
        (unlink(j.temp_path.c_str()) == 0 || errno == ENOENT)) {
      rc = make();
    }
    return rc;
  };
  if (replacing([&] { return linkat(AT_FDCWD, by, AT_FDCWD, j.temp_path.c_str(), AT_SYMLINK_FOLLOW); }) == 0) {
    j.unnamed = false;
    return;
  }
  j.error = errno;
  j.link_refused = j.error == EPERM || j.error == EOPNOTSUPP;
  if (!j.link_refused) {
    set_message(j.message, [&] {
      return "swap-out of " + j.path + ": cannot name its new file " + j.temp_path + ": " + std::strerror(j.error);
    });
    return;
  }
  const int refusal = j.error;
  const int from = open(by, O_RDONLY | O_CLOEXEC);
  const int to = from < 0 ? -1 : replacing([&] {
    return open(j.temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  });
  const bool copied = to >= 0 && io::detail::copy_whole_file(from, to) == 0;
  j.error = copied ? 0 : errno;
  if (from >= 0) close(from);
  if (copied) {
    close(j.fd);  // (its bytes are read back whole)
    j.fd = to;
    j.unnamed = false;
    return;
  }
  if (to >= 0) {
    close(to);
    unlink(j.temp_path.c_str());
  }
  set_message(j.message, [&] {
    return "swap-out of " + j.path + ": the file system cannot link its new file (" + std::strerror(refusal) +
           ") and copying it to " + j.temp_path + " failed: " + std::strerror(j.error);
  });
}

// ---------------------------------------------------------------- the worker

namespace {

// Runs `work` with `lock` released (taken again however it ends). The worker checksums and copies
// blocks of a job's bytes, and hands requests to the engine, this way: a megabyte's checksum takes
// it tens of microseconds and a submission up to a few milliseconds (the kernel starts the
// transfers in it), and under the lock every done(), wait() and new transfer of the callers waited
// for them (a round of checksums, up to a queue depth of blocks: milliseconds). Only the worker
// touches the engine, the requests being queued, and a job's bytes, checksums and staging buffers
// until the job is finished; jobs stay where they are in the map (std::map) while the callers add
// theirs.
template <class Work>
void outside(std::unique_lock<std::mutex>& lock, Work&& work) {
  lock.unlock();
  const struct relock {
    std::unique_lock<std::mutex>& held;
    ~relock() { held.lock(); }
  } again{lock};
  work();
}

// `outside`, returning the seconds `work` took (the swapper's timers).
template <class Work>
double timed_outside(std::unique_lock<std::mutex>& lock, Work&& work) {
  const auto t0 = std::chrono::steady_clock::now();
  outside(lock, std::forward<Work>(work));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// The worker thread is the only one that touches the engine, the files and the staging
// buffers. It queues what resources allow (staging buffers, open files, a bounded number of
// requests so that checksums interleave with I/O), then blocks in the engine for
// completions with the lock released.
void tensor_swapper::run() {
  core::detail::prepare_thread_for_exceptions();
  std::unique_lock lock(mutex_);
  for (;;) {
    queue_ready(lock);
    if (engine_->outstanding() == 0) {
      if (stop_ && ready_jobs_->empty()) return;
      // Nothing in flight: wait for a job that can start (a file may be opened, or its file
      // is open already); the committer wakes us when it closes one.
      work_cv_->wait(lock, [this] {
        if (stop_) return true;
        if (ready_jobs_->empty()) return false;
        const job& next = jobs_->at(ready_jobs_->front());
        return next.opened || next.packed || open_files_ < max_open_files_;
      });
      continue;
    }
    lock.unlock();
    const std::vector<io::io_completion> completions = io::detail::wait_or_pause(*engine_);
    lock.lock();
    for (const io::io_completion& c : completions) on_completion(lock, c);
  }
}

// Queues what can be queued, then hands it to the engine in one submission.
void tensor_swapper::queue_ready(std::unique_lock<std::mutex>& lock) {
  queue_jobs(lock);
  if (!batch_->empty()) submit_batch_outside(lock);
}

// Hands the queued requests to the engine with the lock released (only the worker touches
// batch_ and the engine), then empties the batch.
// Out of memory the engine takes none of them: each completes failed with ENOMEM, as a
// request the disk refused would.
void tensor_swapper::submit_batch_outside(std::unique_lock<std::mutex>& lock) {
  bool submitted = true;
  outside(lock, [&] { submitted = io::detail::submit_or_refuse(*engine_, *batch_); });
  if (!submitted) {
    for (const io::io_request& q : *batch_) on_completion(lock, {q.user_data, -ENOMEM, q.total()});
  }
  batch_->clear();
}

void tensor_swapper::queue_jobs(std::unique_lock<std::mutex>& lock) {
  while (!ready_jobs_->empty()) {
    job& j = jobs_->at(ready_jobs_->front());
    if (!j.opened) {
      if (!j.packed && open_files_ >= max_open_files_) return;
      start_job(lock, ready_jobs_->front(), j);
      if (j.done || j.fully_queued()) {
        ready_jobs_->pop_front();
        continue;
      }
    }
    const bool all = queue_more(lock, ready_jobs_->front(), j);
    // Hand what is queued to the engine every few requests, not at the end of the whole
    // round: the disk gets work while the next files are opened and checksummed.
    if (batch_->size() >= submit_batch) submit_batch_outside(lock);
    if (!all) return;  // out of staging buffers or budget
    ready_jobs_->pop_front();
  }
}

// Everything a job needs in memory (names, its checksums' table, a pack's index entry) is
// made before its file is opened or its slot taken: out of memory, it fails with ENOMEM having
// opened, taken and written nothing. Nothing after that allocates but a failure's message.
void tensor_swapper::start_job(std::unique_lock<std::mutex>& lock, std::uint64_t id, job& j) {
  j.opened = true;
  if (j.tensor.data == nullptr && j.tensor.bytes != 0) {
    j.error = EINVAL;
    set_message(j.message, [] { return std::string("null tensor"); });
    finish(j);
    return;
  }
  std::string own_name;  // a name no other file has: this process, this swapper, this job
  try {
    // A swap-out replaces what is at its path (by an exchange, or, packed, by removing a stale
    // file there) only when that is a regular file: checked before any byte is written.
    if (j.out) {
      if (std::string why = not_replaceable(j.path, j.error); !why.empty()) {
        j.message = std::move(why);
        finish(j);
        return;
      }
    }
    if (j.packed) {
      start_packed(j);
      return;
    }
    if (j.out) {
      // With reuse, the spare file (the version before the last) is overwritten in place:
      // its blocks are allocated already. Without, a name unique per job: a displaced version
      // still waiting for the reaper never shares a name with a file being written. The own
      // name also serves where the spare is another swap-out's.
      own_name = j.path + ".tensormem-tmp." + std::to_string(getpid()) + "." + std::to_string(number_) + "." +
                 std::to_string(id);
      j.own_temp = !options_.reuse_files;
      j.temp_path = j.own_temp ? std::move(own_name) : spare_path(j.path);
      j.folder = io::folder_of(j.path);
    } else {
      j.block_crc.assign((j.tensor.bytes + options_.block_bytes - 1) / options_.block_bytes, 0);
    }
  } catch (...) {  // std::bad_alloc
    j.error = ENOMEM;
    j.message.clear();
    finish(j);
    return;
  }
  open_job_file(lock, j, own_name);
}

// Opens a (not packed) job's file: allocates nothing, but a failure's message.
void tensor_swapper::open_job_file(std::unique_lock<std::mutex>& lock, job& j, std::string& own_name) noexcept {
  const std::string& file = j.out ? j.temp_path : j.path;
  const char* refused = nullptr;
  int e = 0;
  off_t size = -1;  // of a file to read
  std::string short_file;  // why a file to read is too short for its tensor
  int short_error = 0;
  const bool unnamed = unnamed_files_;
  // With the lock released: creating a file can take the file system a millisecond or more.
  outside(lock, [&] {
    j.fd = j.own_temp ? open_own_file(j, unnamed, refused) : open_file(file, j.out, false, j.direct, refused);
    e = errno;
    // A spare is reused by one swap-out at a time: another swapper (in this process or
    // another) writing the same path holds it locked until its version is committed, and so
    // may a child forked meanwhile (it shares the lock). Then this one writes a file of its
    // own name instead, as without reuse: both commit, the later wins, neither is lost. Where
    // the file system has no such locks (ENOLCK), nothing is excluded.
    if (j.fd >= 0 && j.out && !j.own_temp && flock(j.fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
      close(j.fd);
      j.own_temp = true;
      j.temp_path.swap(own_name);
      j.fd = open_own_file(j, unnamed, refused);
      e = errno;
    }
    // A swap-in holds its file under a shared lock until it is closed: when another swapper
    // commits a newer version meanwhile, this file becomes that path's spare, and a swap-out
    // that would overwrite it in place finds it locked and writes a file of its own name. A
    // file locked exclusively now (a version being committed) is read without the lock.
    if (j.fd >= 0 && !j.out) static_cast<void>(flock(j.fd, LOCK_SH | LOCK_NB));
    struct stat st {};
    if (j.fd >= 0 && !j.out && fstat(j.fd, &st) == 0) size = st.st_size;
    if (size >= 0) {
      try {
        short_file = why_short(j, static_cast<std::uint64_t>(size), short_error);
      } catch (...) {  // std::bad_alloc, making the message of a file too short
        short_error = ENOMEM;
        short_file.clear();
      }
    }
  });
  if (j.fd < 0) {
    j.error = e;
    // A swap-out creates a file beside its path: the message names both.
    set_message(j.message, [&] {
      return (j.out ? "swap-out of " + j.path + ": cannot create " : std::string("cannot open ")) +
             (j.out ? j.temp_path : file) + ": " +
             (refused != nullptr ? std::string("it is ") + refused + "; swap files are regular files"
                                 : std::string(std::strerror(e))) +
             (!j.out && e == ENOENT ? " (never swapped out, or discarded or removed since)" : "");
    });
    finish(j);
    return;
  }
  if (options_.direct && !j.direct) note_buffered(file);
  ++open_files_;
  // Too short for its tensor: said so (a short read of it would look like an I/O error).
  // queue_more then queues nothing and finishes the job; the committer closes the file.
  if (short_error != 0) {
    j.error = short_error;
    j.message = std::move(short_file);
  }
}

// Why a swap file of `size` bytes cannot hold the tensor of swap-in `j`, or empty when it is
// long enough. Shorter than a header, it is no swap file; otherwise its header says whether it
// belongs to another tensor or size (as a full read would) or was cut short after it was
// written. Reads the header page with pread: only files that are too short pay for it.
std::string tensor_swapper::why_short(const job& j, std::uint64_t file_bytes, int& error) const {
  if (file_bytes < header_bytes) {
    error = EBADMSG;
    return j.path + " is not a tensormem swap file: " + std::to_string(file_bytes) + " bytes, less than a swap " +
           "file's " + std::to_string(header_bytes) + "-byte header";
  }
  const std::uint64_t whole = header_bytes + round_up(j.tensor.bytes, io_alignment);
  if (file_bytes >= whole) return {};
  alignas(io_alignment) std::byte page[header_bytes];  // O_DIRECT's alignment
  // Short and interrupted reads are continued (a file system may return either), up to the
  // end of the file.
  const io::detail::transferred read = io::detail::pread_fully(j.fd, page, header_bytes, 0);
  if (read.error != 0) {
    error = read.error;
    return "cannot read the header of " + j.path + ": " + std::strerror(error);
  }
  const std::size_t got = read.bytes;
  // Cut below a header since the fstat: no swap file any more.
  if (got < header_bytes) return why_short(j, got, error);
  file_header h{};
  std::string problem = header_problem(page, j.path, j.key, j.tensor.bytes, h, error);
  if (!problem.empty()) return problem;
  error = EBADMSG;
  return j.path + " is cut short: " + std::to_string(file_bytes) + " bytes, where the swap file of its " +
         std::to_string(h.bytes) + "-byte tensor holds " + std::to_string(whole) +
         " (truncated after it was written)";
}

// A packed job: a swap-out takes a new slot in its directory's pack (the current version
// stays where it is until this one is complete); a swap-in reads the slot of the current one.
// Throws std::bad_alloc only before it has taken anything.
void tensor_swapper::start_packed(job& j) {
  if (j.out) {
    std::string error;
    pack_file* pack = pack_for(j.path, error);
    if (pack == nullptr) {
      j.error = errno;
      j.message = std::move(error);
      finish(j);
      return;
    }
    // The index's entry for a path packed for the first time, made now: the commit, which
    // removes the files of the path's earlier version, must not fail for want of it.
    // So is the name of the path's spare, whose file the commit removes too.
    j.first_pack = !packed_->contains(j.path);
    if (j.first_pack) {
      packed_index made;
      j.index_node = made.extract(made.try_emplace(j.path).first);
      j.temp_path = spare_path(j.path);
    }
    const auto slot = pack->space.allocate(round_up(j.tensor.bytes, io_alignment));
    if (!slot) {
      j.error = EFBIG;
      set_message(j.message, [&] { return "no room for " + j.path + " in its pack file"; });
      finish(j);
      return;
    }
    if (const int e = reserve_pack(*pack, slot->offset + slot->bytes); e != 0) {
      pack->space.free(slot->offset, slot->bytes);
      j.error = e;
      set_message(j.message, [&] { return "cannot grow the pack file for " + j.path + ": " + std::strerror(e); });
      finish(j);
      return;
    }
    j.pack = pack;
    j.data_start = slot->offset;
    j.slot_bytes = slot->bytes;
  } else {
    const packed_entry& e = packed_->find(j.path)->second;
    if (e.bytes != j.tensor.bytes) {
      j.error = EINVAL;
      set_message(j.message, [&] { return holds_another_size(j.path, e.bytes, j.tensor.bytes); });
      finish(j);
      return;
    }
    j.block_crc.assign((j.tensor.bytes + options_.block_bytes - 1) / options_.block_bytes, 0);
    j.pack = e.pack;
    j.data_start = e.offset;
    j.header_read = true;  // what a header would say, the index knows
    j.file_crc = e.crc;
    j.file_has_crc = e.has_crc;
  }
  j.fd = j.pack->fd;
  j.direct = j.pack->direct;
  j.header_queued = true;  // a slot holds the bytes alone
  if (j.tensor.bytes == 0) finish(j);  // nothing to move
}

// Allocates the pack's blocks ahead of the writes (fallocate, in steps of at least 64 MiB or
// a quarter of the pack): writes past the end of a file are serialized by the file system,
// writes into allocated blocks are not; a full disk fails the slot's tensor here, before any
// byte is written. A file system without fallocate (EOPNOTSUPP) grows by its writes. An
// interrupted fallocate (tmpfs's, while a signal is pending) is repeated.
int tensor_swapper::reserve_pack(pack_file& pack, std::uint64_t end) {
  if (end <= pack.reserved) return 0;
  const std::uint64_t step = std::max<std::uint64_t>({end - pack.reserved, std::uint64_t{64} << 20, pack.reserved / 4});
  for (const std::uint64_t want : {pack.reserved + step, end}) {
    const int rc = io::detail::repeat_interrupted([&] { return fallocate(pack.fd, 0, 0, static_cast<off_t>(want)); });
    if (rc == 0) {
      pack.reserved = want;
      return 0;
    }
    if (errno == EOPNOTSUPP) {
      pack.reserved = std::numeric_limits<std::uint64_t>::max();
      return 0;
    }
    if (errno != ENOSPC && errno != EFBIG) return errno;
  }
  return errno;  // not even the slot fits
}

namespace {

// A file of the swapper's own in `dir` whose name is unlinked at once, for a file system
// without O_TMPFILE: created with O_EXCL under a name no other file has (a file, or a link
// that would lead the writes elsewhere, is passed over and left as it is). -1 with errno when
// no name is free among the tries or the creation fails.
int open_unlinked_pack(const std::string& dir) {
  static std::atomic<std::uint64_t> next_name{0};
  constexpr int tries = 1000;
  for (int n = 0; n < tries; ++n) {
    const std::string named =
        dir + "/.tensormem-pack." + std::to_string(getpid()) + "." + std::to_string(next_name++);
    const int fd = open(named.c_str(), O_CREAT | O_EXCL | O_NOFOLLOW | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0) {
      unlink(named.c_str());
      return fd;
    }
    if (errno != EEXIST) return -1;
  }
  return -1;  // errno EEXIST
}

// Turns O_DIRECT on for an open file; false where its file system refuses it.
bool set_direct(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  return flags >= 0 && fcntl(fd, F_SETFL, flags | O_DIRECT) == 0;
}

}  // namespace

// The pack of the path's directory, created on first use: an unnamed file (O_TMPFILE, or a
// name unlinked at once where the file system has no O_TMPFILE) that vanishes when closed.
tensor_swapper::pack_file* tensor_swapper::pack_for(const std::string& path, std::string& error) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  if (const auto it = packs_->find(dir); it != packs_->end()) return it->second.get();
  // Its memory first (the pack and its place in the map): out of memory, no file is left open.
  auto pack = std::make_unique<pack_file>();
  packs_by_dir made;
  auto entry = made.extract(made.try_emplace(dir).first);
  // Opened buffered, then O_DIRECT set where the file system allows it: an O_DIRECT open that
  // failed after creating a named file would take that name from its own retry.
  int fd = open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR)) fd = open_unlinked_pack(dir);
  if (fd < 0) {
    const int e = errno;
    error = "cannot create a pack file in " + dir + ": " + std::strerror(e);
    errno = e;  // the caller's result
    return nullptr;
  }
  const bool direct = options_.direct && set_direct(fd);
  if (options_.direct && !direct) note_buffered(dir);
  pack->fd = fd;
  pack->direct = direct;
  entry.mapped() = std::move(pack);
  return packs_->insert(std::move(entry)).position->second.get();
}

// Queues the job's next requests. The header rides with the first data block where it can:
// a swap-in reads it with block 0 (one vectored request: the header page, then the data);
// a swap-out of a one-block tensor writes it with that block (its checksum is known once the
// block is). Otherwise the header is a request of its own, written after the last block (it
// carries the checksum of all of them). Swap-out checksums each block as it is queued;
// swap-in checksums each block as it arrives. Returns true when the job is fully queued,
// false when a staging buffer, a header page or the request budget ran out.
bool tensor_swapper::queue_more(std::unique_lock<std::mutex>& lock, std::uint64_t id, job& j) {
  if (j.error != 0) {  // a request failed already: queue nothing more (no header either)
    j.next_offset = j.tensor.bytes;
    j.header_queued = true;
    if (j.requests_left == 0) finish(j);
    return true;
  }
  const bool header_with_first = j.tensor.bytes > 0 && (!j.out || j.tensor.bytes <= options_.block_bytes);
  auto* data = static_cast<std::byte*>(j.tensor.data);
  while (j.next_offset < j.tensor.bytes) {
    if (queued_ >= max_queued_) return false;
    const std::size_t off = j.next_offset;
    const std::size_t n = std::min(options_.block_bytes, j.tensor.bytes - off);
    const std::size_t block = off / options_.block_bytes;
    const bool straight = !j.direct || aligned(data + off, n);
    const bool with_header = header_with_first && !j.header_queued;
    if (!straight && free_staging_->empty()) return false;
    if (with_header && free_headers_->empty()) return false;
    if (j.out && options_.checksums) {
      (*timers_)["checksum"] += timed_outside(lock, [&] { j.crc = crc32c(data + off, n, j.crc); });
    }
    std::size_t h = no_staging;
    if (with_header) {
      h = take_header();
      if (j.out) write_header(staging_[h], j.tensor.bytes, j.crc, options_.checksums, j.key);
      j.header_queued = true;
    }
    if (straight) {
      issue(id, j, off, data + off, n, j.out, no_staging, h, nullptr, 0, block);
      stats_.direct_bytes += n;
    } else {
      const std::size_t s = take_staging();
      const std::size_t padded = round_up(n, io_alignment);
      if (j.out) {
        (*timers_)["staging_copy"] += timed_outside(lock, [&] {
          std::memcpy(staging_[s], data + off, n);
          std::memset(staging_[s] + n, 0, padded - n);
        });
        issue(id, j, off, staging_[s], padded, true, s, h, nullptr, 0, block);
      } else {
        issue(id, j, off, staging_[s], padded, false, s, h, data + off, n, block);
      }
      stats_.staged_bytes += n;
    }
    j.next_offset = off + n;
  }
  if (!j.header_queued) {  // a header alone: after the data of a swap-out, or of an empty tensor
    if (free_headers_->empty() || queued_ >= max_queued_) return false;
    const std::size_t h = take_header();
    if (j.out) write_header(staging_[h], j.tensor.bytes, j.crc, options_.checksums, j.key);
    issue(id, j, 0, nullptr, 0, j.out, no_staging, h, nullptr, 0, header_block);
    j.header_queued = true;
  }
  return true;
}

std::size_t tensor_swapper::take_header() {
  const std::size_t h = free_headers_->back();
  free_headers_->pop_back();
  return h;
}

std::size_t tensor_swapper::take_staging() {
  const std::size_t s = free_staging_->back();
  free_staging_->pop_back();
  return s;
}

// Queues one request: `bytes` of data at `buffer` for the tensor's bytes from `data_offset`,
// preceded by the header page `header` when there is one (then data_offset is 0 and both go
// in one vectored request from the start of the file).
void tensor_swapper::issue(std::uint64_t id, job& j, std::uint64_t data_offset, void* buffer,
                           std::size_t bytes, bool write, std::size_t staging, std::size_t header,
                           void* copy_to, std::size_t copy_bytes, std::size_t block) {
  std::size_t slot = 0;
  if (!free_requests_->empty()) {
    slot = free_requests_->back();
    free_requests_->pop_back();
  } else {
    slot = requests_->size();
    requests_->emplace_back();
  }
  const std::size_t prefix = header == no_staging ? 0 : header_bytes;
  (*requests_)[slot] = {id, staging, header, copy_to, copy_bytes, prefix + bytes, block, write};
  ++j.requests_left;
  ++queued_;
  if (header == no_staging) {
    batch_->push_back({j.fd, j.data_start + data_offset, buffer, bytes, write, slot});
  } else {
    batch_->push_back({j.fd, 0, staging_[header], header_bytes, write, slot, buffer, bytes});
  }
}

void tensor_swapper::on_completion(std::unique_lock<std::mutex>& lock, const io::io_completion& c) {
  const pending_request r = (*requests_)[c.user_data];
  free_requests_->push_back(static_cast<std::size_t>(c.user_data));
  --queued_;
  job& j = jobs_->at(r.job);
  const auto fail = [&](int error, auto make_message) {
    if (j.error != 0) return;  // the first problem is the one reported
    j.error = error;
    set_message(j.message, make_message);
  };
  if (c.result < 0) {
    fail(static_cast<int>(-c.result), [&] {
      return std::string(r.write ? "write to " : "read from ") + j.path +
             " failed: " + io::describe_transfer_error(static_cast<int>(-c.result));
    });
  } else {
    const auto got = static_cast<std::size_t>(c.result);
    // A header that arrived is checked first, even from a short read: a file of another
    // tensor or size says so rather than "short read".
    if (!r.write && r.header != no_staging && got >= header_bytes) {
      file_header h{};
      int error = 0;
      std::string problem;
      try {
        problem = header_problem(staging_[r.header], j.path, j.key, j.tensor.bytes, h, error);
      } catch (...) {  // std::bad_alloc, making the message of a header that does not fit
        error = ENOMEM;
      }
      if (error != 0) {
        fail(error, [&] { return std::move(problem); });
      } else {
        j.header_read = true;
        j.file_crc = h.crc;
        j.file_has_crc = (h.flags & 1U) != 0;
      }
    }
    if (got < r.expected) {
      fail(EIO, [&] {
        return std::string("short ") + (r.write ? "write to " : "read from ") + j.path + ": " +
               std::to_string(got) + " of " + std::to_string(r.expected) + " bytes";
      });
    } else if (!r.write && r.block != header_block) {
      // A data block arrived: into the tensor (copied from staging if it was staged), then
      // checksummed while the other blocks are still in flight.
      if (r.copy_to != nullptr) {
        (*timers_)["staging_copy"] +=
            timed_outside(lock, [&] { std::memcpy(r.copy_to, staging_[r.staging], r.copy_bytes); });
      }
      // (A tensor of one block is checksummed by the committer, off this thread.)
      if (options_.checksums && j.error == 0 && j.block_crc.size() > 1) {
        const std::size_t off = r.block * options_.block_bytes;
        const std::size_t n = std::min(options_.block_bytes, j.tensor.bytes - off);
        (*timers_)["checksum"] += timed_outside(lock, [&] {
          j.block_crc[r.block] = crc32c(static_cast<const std::byte*>(j.tensor.data) + off, n);
        });
      }
    }
  }
  // Their I/O is over: the buffers may be reused.
  if (r.staging != no_staging) free_staging_->push_back(r.staging);
  if (r.header != no_staging) free_headers_->push_back(r.header);
  if (--j.requests_left == 0 && j.fully_queued()) finish(j);
}

// A job whose requests are all complete. With a file open, the committer thread closes it
// (and commits a swap-out) so that the worker goes on queuing I/O meanwhile; else it is
// done now.
void tensor_swapper::finish(job& j) noexcept {
  if (j.fd >= 0) {  // a file of its own, or its pack's
    j.next_commit = nullptr;
    (commit_tail_ != nullptr ? commit_tail_->next_commit : commit_head_) = &j;
    commit_tail_ = &j;
    commit_cv_->notify_one();
    return;
  }
  complete(j);
}

void tensor_swapper::complete(job& j) {
  j.done = true;
  j.finished = clock::now();
  if (--tickets_->at(j.ticket).unfinished == 0) done_cv_->notify_all();
}

// The committer: takes finished jobs in batches and does their file work without the lock
// (set the length of a reused spare, close, exchange with the path; or close and verify a
// swap-in), then marks them done and frees their file slots.
// The batch is the queue taken whole (the jobs link to each other): nothing here allocates
// but a failure's message, so that the committer never fails.
void tensor_swapper::run_committer() {
  core::detail::prepare_thread_for_exceptions();
  std::unique_lock lock(mutex_);
  for (;;) {
    commit_cv_->wait(lock, [this] { return commit_stop_ || commit_head_ != nullptr; });
    if (commit_head_ == nullptr) return;  // stopping, and nothing left
    job* const batch = std::exchange(commit_head_, nullptr);
    commit_tail_ = nullptr;
    lock.unlock();
    for (job* j = batch; j != nullptr; j = j->next_commit) close_and_commit(*j);
    lock.lock();
    for (job* j = batch; j != nullptr;) {
      job* const next = j->next_commit;
      commit_locked(*j);
      complete(*j);
      j = next;
    }
    work_cv_->notify_one();  // file slots are free again
  }
}

// The committer's work under the lock: file slots and the index of packed paths.
void tensor_swapper::commit_locked(job& j) {
  if (!j.packed) {
    --open_files_;
    if (j.link_refused && unnamed_files_) {  // later swap-outs name their files from the start
      unnamed_files_ = false;
      try {
        io::detail::append_reason(stats_.fallback, "the file system of " + j.folder +
                                                       " cannot link a file made without a name; swap-outs' own "
                                                       "files are named from the start");
      } catch (...) {  // std::bad_alloc: the swap-out's own message says why it failed
      }
    }
    if (j.out && j.error == 0) {  // a file at the path now: a packed version is stale
      if (const auto it = packed_->find(j.path); it != packed_->end()) {
        it->second.pack->space.free(it->second.offset, it->second.slot_bytes);
        packed_->erase(it);
      }
    }
    return;
  }
  if (!j.out) return;
  if (j.error != 0) {  // the slot goes back; the current version stays
    j.pack->space.free(j.data_start, j.slot_bytes);
    return;
  }
  const packed_entry entry{j.pack, j.data_start, j.slot_bytes, j.tensor.bytes, j.crc, options_.checksums};
  if (const auto it = packed_->find(j.path); it != packed_->end()) {
    it->second.pack->space.free(it->second.offset, it->second.slot_bytes);
    it->second = entry;
  } else {  // the path's first packed version: its entry was made when the job started
    j.index_node.mapped() = entry;
    packed_->insert(std::move(j.index_node));
  }
}

// Runs on the committer without the lock: touches only the job, which no other thread
// touches until it is marked done.
void tensor_swapper::close_and_commit(job& j) {
  if (j.packed) {  // the pack stays open; a swap-in is verified, a first packed path cleared
    if (!j.out && j.error == 0) verify_in(j);
    if (j.out && j.error == 0 && j.first_pack) {  // what is not a swap file there is left alone
      for (const std::string* p : {&j.path, &j.temp_path}) {  // (the spare's name, made when it started)
        if (other_than_a_file(*p) == nullptr) unlink(p->c_str());
      }
    }
    return;
  }
  if (j.out && j.error == 0 && !j.own_temp) {
    // A reused spare may be longer than this version: cut it to this length.
    const auto length = static_cast<off_t>(header_bytes + round_up(j.tensor.bytes, io_alignment));
    // (a network file system's may be interrupted)
    const int rc = io::detail::repeat_interrupted([&] { return ftruncate(j.fd, length); });
    if (rc != 0) {
      j.error = errno;
      set_message(j.message, [&] { return "cannot set the length of " + j.temp_path + ": " + std::strerror(j.error); });
    }
  }
  if (j.out && j.error == 0 && j.unnamed) name_own_file(j);
  // The file stays locked until it is committed: another swap-out of the path must not take
  // it between this close and the exchange (a duplicate descriptor keeps the lock; without
  // one, EMFILE, only that short window is open).
  const int held = j.out && !j.own_temp ? fcntl(j.fd, F_DUPFD_CLOEXEC, 0) : -1;
  if (close(j.fd) != 0 && j.out && j.error == 0) {
    j.error = errno;
    set_message(j.message, [&] { return "cannot close " + j.temp_path + ": " + std::strerror(j.error); });
  }
  j.fd = -1;
  if (!j.out) {
    if (j.error == 0) verify_in(j);
    return;
  }
  // Commit: the complete new file replaces the old one in one step; a failed swap-out
  // leaves the old file (or no file) and removes its partial copy. The exchange is atomic
  // for readers, and the old version's blocks are freed later by the reaper thread:
  // freeing gigabytes (and discarding them) takes the file system about as long as
  // writing them, and must not stall the I/O.
  bool displaced = false;
  if (j.error == 0) {
    if (renameat2(AT_FDCWD, j.temp_path.c_str(), AT_FDCWD, j.path.c_str(), RENAME_EXCHANGE) == 0) {
      displaced = true;
      // Checked when the job started; something else may have taken the path since. What
      // was exchanged away must be a regular file, else it goes back where it was.
      if (const auto there = io::not_a_file_at(j.temp_path)) {
        displaced = false;
        j.error = there->error;
        const bool back =
            renameat2(AT_FDCWD, j.temp_path.c_str(), AT_FDCWD, j.path.c_str(), RENAME_EXCHANGE) == 0;
        const int e = errno;
        set_message(j.message, [&] {
          return not_replaceable_message(j.path, there->kind) +
                 (back ? "" : "; it could not be put back from " + j.temp_path + ": " + std::strerror(e));
        });
        if (!back) j.temp_path.clear();  // holds what was at the path: never unlinked
      }
    } else if (rename(j.temp_path.c_str(), j.path.c_str()) != 0) {  // no old file (or no exchange)
      j.error = errno;
      set_message(j.message, [&] {
        return "cannot rename " + j.temp_path + " to " + j.path + ": " + std::strerror(j.error);
      });
    }
  }
  // A partial file is gone before wait() reports (an unnamed one, with its descriptor).
  if (j.error != 0 && !j.temp_path.empty() && !j.unnamed) unlink(j.temp_path.c_str());
  if (held >= 0) close(held);
  if (displaced && j.own_temp) {  // else: the next spare
    try {
      reap(j.temp_path);
    } catch (...) {  // std::bad_alloc: removed here instead of by the reaper
      unlink(j.temp_path.c_str());
    }
  }
}

// Swap-in checks, once every block arrived: the header's size, whether it carries a
// checksum (the swapper's setting decides), and the checksum of the blocks combined in
// file order.
void tensor_swapper::verify_in(job& j) {
  if (!j.header_read) {
    j.error = EINVAL;
    set_message(j.message, [&] { return j.path + " is not a tensormem swap file (or was never written completely)"; });
    return;
  }
  if (!options_.checksums) return;
  if (!j.file_has_crc) {
    j.error = EBADMSG;
    set_message(j.message, [&] {
      return j.path + " carries no checksum (written with checksums off) and checksums are on";
    });
    return;
  }
  if (j.block_crc.size() == 1) j.block_crc[0] = crc32c(j.tensor.data, j.tensor.bytes);
  std::uint32_t crc = 0;
  for (std::size_t b = 0; b < j.block_crc.size(); ++b) {
    const std::size_t n = std::min(options_.block_bytes, j.tensor.bytes - b * options_.block_bytes);
    crc = b == 0 ? j.block_crc[0] : crc32c_combine(crc, j.block_crc[b], n);
  }
  if (crc != j.file_crc) {
    j.error = EBADMSG;
    set_message(j.message, [&] { return "checksum mismatch in " + j.path + ": the file is corrupt"; });
  }
}

std::string tensor_swapper::spare_path(const std::string& path) { return path + ".tensormem-spare"; }

namespace {

// Swap files are regular files: anything else at the path or at its spare's (a device, a
// pipe, a socket, a symbolic link, a folder) was not made by a swapper, and removing it (a
// device node such as /dev/null, as root) could break the machine. Throws naming it.
void check_removable(const std::string& path, const std::string& spare) {
  for (const std::string* p : {&path, &spare}) {
    if (const char* kind = other_than_a_file(*p)) {
      throw std::invalid_argument("tensor_swapper: " + *p + " is " + kind +
                                  "; only swap files (regular files) are removed, and nothing was");
    }
  }
}

}  // namespace

void tensor_swapper::remove_files(const std::string& path) {
  io::check_path_argument("tensor_swapper::remove_files", path);
  const std::string spare = spare_path(path);
  check_removable(path, spare);
  unlink(path.c_str());
  unlink(spare.c_str());
}

// Hands a file to the reaper thread, which unlinks it off the I/O path.
void tensor_swapper::reap(const std::string& path) {
  {
    const std::lock_guard lock(reap_mutex_);
    reap_queue_->push_back(path);
  }
  reap_cv_->notify_one();
}

void tensor_swapper::run_reaper() {
  core::detail::prepare_thread_for_exceptions();
  std::unique_lock lock(reap_mutex_);
  for (;;) {
    reap_cv_->wait(lock, [this] { return reap_stop_ || !reap_queue_->empty(); });
    if (reap_queue_->empty()) return;  // stopping, and nothing left
    const std::string path = std::move(reap_queue_->front());
    reap_queue_->pop_front();
    lock.unlock();
    unlink(path.c_str());
    lock.lock();
  }
}

// ---------------------------------------------------------------- the callers

namespace {
// The address range of a tensor's memory; empty for no memory (checked per tensor later).
std::uintptr_t begin_of(const tensor_ref& t) { return reinterpret_cast<std::uintptr_t>(t.data); }
std::uintptr_t end_of(const tensor_ref& t) { return t.data == nullptr ? begin_of(t) : begin_of(t) + t.bytes; }

// How a transfer not yet waited for is collected, for the refusals that name it.
std::string collected_by(std::uint64_t ticket) {
  const std::string t = std::to_string(ticket);
  return "ticket " + t + ": wait(" + t + ") or synchronize() collects it";
}

// The first transfer not yet waited for (a job of `jobs`) that `holds` picks, or null: for a
// refusal's message, so only refusals pay for the walk over the transfers.
template <class Jobs, class Holds>
const typename Jobs::mapped_type* first_holding(const Jobs& jobs, Holds holds) {
  for (const auto& [id, j] : jobs) {
    if (holds(j)) return &j;
  }
  return nullptr;
}

// The transfer not yet waited for (a swap-out when `out`, else a swap-in) whose memory shares a
// byte with [begin, end), for a refusal's message: its path and ticket.
template <class Jobs>
std::string holder_of(const Jobs& jobs, std::uintptr_t begin, std::uintptr_t end, bool out) {
  const auto* j = first_holding(jobs, [&](const auto& x) {
    return x.out == out && begin_of(x.tensor) < end && begin < end_of(x.tensor);
  });
  return j == nullptr ? std::string() : " (the tensor for " + j->path + ", " + collected_by(j->ticket) + ")";
}

// The refusal of a path that is in a transfer not yet waited for: it names that transfer's
// ticket, which a caller who dropped it can still wait for (or synchronize()).
template <class Jobs>
std::invalid_argument path_in_flight(const Jobs& jobs, const std::string& path) {
  const auto* j = first_holding(jobs, [&](const auto& x) { return x.path == path; });
  return std::invalid_argument("tensor_swapper: " + path + " is in a transfer not yet waited for" +
                               (j == nullptr ? std::string() : " (" + collected_by(j->ticket) + ")"));
}
}  // namespace

// Refuses a batch whose memory would be written by two transfers at once, or read by one
// while another writes it (see the contract); changes nothing.
void tensor_swapper::check_memory(std::span<const tensor_ref> tensors, std::span<const std::string> paths,
                                  bool out) const {
  std::vector<std::pair<std::uintptr_t, std::size_t>> written;  // (begin, index) of this swap-in's
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::uintptr_t begin = begin_of(tensors[i]);
    if (end_of(tensors[i]) < begin) {
      throw std::invalid_argument("tensor_swapper: the memory of the tensor for " + paths[i] +
                                  " runs past the end of the address space");
    }
    if (writing_->overlaps(begin, end_of(tensors[i]))) {
      throw std::invalid_argument("tensor_swapper: the memory of the tensor for " + paths[i] +
                                  " overlaps a swap-in not yet waited for" +
                                  holder_of(*jobs_, begin, end_of(tensors[i]), false));
    }
    if (!out && reading_->overlaps(begin, end_of(tensors[i]))) {
      throw std::invalid_argument("tensor_swapper: the memory of the tensor for " + paths[i] +
                                  " overlaps a swap-out not yet waited for" +
                                  holder_of(*jobs_, begin, end_of(tensors[i]), true));
    }
    if (!out && end_of(tensors[i]) > begin) written.emplace_back(begin, i);
  }
  std::sort(written.begin(), written.end());
  for (std::size_t k = 1; k < written.size(); ++k) {
    const std::size_t a = written[k - 1].second;
    const std::size_t b = written[k].second;
    if (written[k].first < end_of(tensors[a])) {
      throw std::invalid_argument("tensor_swapper: the tensors for " + paths[std::min(a, b)] + " and " +
                                  paths[std::max(a, b)] + " overlap in memory; a swap-in writes each byte once");
    }
  }
}

std::uint64_t tensor_swapper::start(std::span<const tensor_ref> tensors,
                                    std::span<const std::string> paths,
                                    std::span<const std::string> keys, bool out) {
  if (tensors.size() != paths.size()) {
    throw std::invalid_argument("tensor_swapper: " + std::to_string(tensors.size()) +
                                " tensors for " + std::to_string(paths.size()) + " paths");
  }
  if (!keys.empty() && keys.size() != paths.size()) {
    throw std::invalid_argument("tensor_swapper: " + std::to_string(keys.size()) + " keys for " +
                                std::to_string(paths.size()) + " paths");
  }
  // A path may be in one unfinished transfer at a time: two writes to one file in flight
  // would leave one tensor lost while both report success.
  std::set<std::string_view> batch;
  for (const std::string& p : paths) {
    io::check_path_argument("tensor_swapper", p);
    if (!batch.insert(p).second) {
      throw std::invalid_argument("tensor_swapper: " + p + " appears twice in one batch");
    }
    if (busy_paths_->contains(p)) throw path_in_flight(*jobs_, p);
  }
  check_memory(tensors, paths, out);
  // Everything that allocates is made aside first (the jobs, the busy paths' entries, the
  // ticket, the order, the keys of the memory ranges): out of memory, nothing has changed.
  // The pieces then join the swapper's maps without allocating.
  const std::uint64_t ticket = next_ticket_;
  std::map<std::uint64_t, job> made;
  std::set<std::string, std::less<>> made_paths;
  ticket_state state;
  state.jobs.reserve(tensors.size());
  state.unfinished = tensors.size();
  const auto now = clock::now();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::uint64_t id = next_job_ + i;
    job& j = made[id];
    j.ticket = ticket;
    j.path = paths[i];
    j.key = keys.empty() ? paths[i] : keys[i];
    j.tensor = tensors[i];
    j.out = out;
    j.packed = out ? options_.pack_below > 0 && j.tensor.bytes <= options_.pack_below : packed_->contains(j.path);
    j.started = now;
    made_paths.insert(j.path);
    state.jobs.push_back(id);
  }
  // Packed swap-ins are queued in the order of their slots in the pack (the disk reads
  // ascending offsets faster than the scattered order rewrites leave); the rest as given.
  std::vector<std::uint64_t> order = state.jobs;
  if (!out && !packed_->empty()) {
    // (pack, offset, job id): job ids ascend with the batch, so the sort is stable.
    std::vector<std::tuple<std::uintptr_t, std::uint64_t, std::uint64_t>> slots;
    slots.reserve(order.size());
    for (const auto& [id, j] : made) {
      const auto it = j.packed ? packed_->find(j.path) : packed_->end();
      slots.emplace_back(it == packed_->end() ? 0 : reinterpret_cast<std::uintptr_t>(it->second.pack),
                         it == packed_->end() ? 0 : it->second.offset, id);
    }
    std::sort(slots.begin(), slots.end());
    for (std::size_t k = 0; k < slots.size(); ++k) order[k] = std::get<2>(slots[k]);
  }
  detail::range_cover& ranges = out ? *reading_ : *writing_;
  ranges.reserve(2 * tensors.size());
  const auto placed = tickets_->try_emplace(ticket, std::move(state)).first;
  try {
    ready_jobs_->insert(ready_jobs_->end(), order.begin(), order.end());  // all or nothing
  } catch (...) {
    tickets_->erase(placed);
    throw;
  }
  // Nothing below allocates.
  next_ticket_ = ticket + 1;
  next_job_ += tensors.size();
  jobs_->merge(made);
  busy_paths_->merge(made_paths);
  for (const tensor_ref& t : tensors) ranges.add(begin_of(t), end_of(t));
  work_cv_->notify_one();
  return ticket;
}

std::uint64_t tensor_swapper::swap_out(std::span<const tensor_ref> tensors,
                                       std::span<const std::string> paths,
                                       std::span<const std::string> keys) {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return start(tensors, paths, keys, true);
}

std::uint64_t tensor_swapper::swap_in(std::span<const std::string> paths,
                                      std::span<const tensor_ref> tensors,
                                      std::span<const std::string> keys) {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return start(tensors, paths, keys, false);
}

bool tensor_swapper::done(std::uint64_t ticket) { return unfinished(ticket) == 0; }

bool tensor_swapper::outstanding(std::uint64_t ticket) const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return tickets_->contains(ticket);
}

std::size_t tensor_swapper::unfinished(std::uint64_t ticket) {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  const auto it = tickets_->find(ticket);
  if (it == tickets_->end()) {
    throw std::invalid_argument("tensor_swapper: unknown or already waited ticket " + std::to_string(ticket));
  }
  return it->second.unfinished;
}

std::vector<swap_result> tensor_swapper::wait(std::uint64_t ticket) {
  made_.require_same_process(who);
  std::unique_lock lock(mutex_);
  return *wait_locked(lock, ticket, nullptr);
}

std::optional<std::vector<swap_result>> tensor_swapper::wait_until(std::uint64_t ticket, clock::time_point deadline) {
  made_.require_same_process(who);
  std::unique_lock lock(mutex_);
  return wait_locked(lock, ticket, &deadline);
}

void tensor_swapper::claim_locked(std::uint64_t ticket) {
  const auto it = tickets_->find(ticket);
  if (it == tickets_->end()) {
    throw std::invalid_argument("tensor_swapper: unknown or already waited ticket " +
                                std::to_string(ticket));
  }
  if (it->second.waiting) {
    throw std::invalid_argument("tensor_swapper: ticket " + std::to_string(ticket) +
                                " is already being waited for by another thread");
  }
  it->second.waiting = true;
}

void tensor_swapper::unclaim_locked(std::uint64_t ticket) {
  tickets_->at(ticket).waiting = false;  // outstanding still: another wait may take it up
  done_cv_->notify_all();                // synchronize() may be waiting for someone to wait for it
}

std::optional<std::vector<swap_result>> tensor_swapper::wait_locked(std::unique_lock<std::mutex>& lock,
                                                                    std::uint64_t ticket,
                                                                    const clock::time_point* deadline) {
  claim_locked(ticket);
  std::optional<std::vector<swap_result>> results;
  try {
    results = wait_claimed_locked(lock, ticket, deadline);
  } catch (...) {  // std::bad_alloc, collecting nothing: the ticket can be waited for again
    unclaim_locked(ticket);
    throw;
  }
  if (!results) unclaim_locked(ticket);
  return results;
}

tensor_swapper::ticket_wait::ticket_wait(tensor_swapper& swapper, std::uint64_t ticket)
    : swapper_(swapper), ticket_(ticket) {
  swapper_.made_.require_same_process(who);
  const std::lock_guard lock(swapper_.mutex_);
  swapper_.claim_locked(ticket);
}

tensor_swapper::ticket_wait::~ticket_wait() {
  if (collected_ || swapper_.made_.forked()) return;
  const std::lock_guard lock(swapper_.mutex_);
  swapper_.unclaim_locked(ticket_);
}

std::optional<std::vector<swap_result>> tensor_swapper::ticket_wait::until(clock::time_point deadline) {
  swapper_.made_.require_same_process(who);
  if (collected_) throw std::logic_error("tensor_swapper: ticket " + std::to_string(ticket_) + " was collected");
  std::unique_lock lock(swapper_.mutex_);
  auto results = swapper_.wait_claimed_locked(lock, ticket_, &deadline);
  collected_ = results.has_value();
  return results;
}

std::optional<std::vector<swap_result>> tensor_swapper::wait_claimed_locked(std::unique_lock<std::mutex>& lock,
                                                                            std::uint64_t ticket,
                                                                            const clock::time_point* deadline) {
  const auto t0 = clock::now();
  ticket_state& state = tickets_->at(ticket);
  const auto finished = [&] { return state.unfinished == 0; };
  const bool ended = deadline == nullptr ? (done_cv_->wait(lock, finished), true)
                                         : done_cv_->wait_until(lock, *deadline, finished);
  const double waited = seconds(clock::now() - t0);
  stats_.seconds_waiting += waited;
  (*timers_)["wait"] += waited;
  if (!ended) return std::nullopt;
  const std::vector<std::uint64_t>& members = state.jobs;
  // What allocates comes first (the results, a plain message where a thread could not make
  // one, the range keys the removals may need): out of memory, nothing is collected.
  std::vector<swap_result> results;
  results.reserve(members.size());
  clock::time_point first = clock::time_point::max();
  clock::time_point last = clock::time_point::min();
  bool out = true;
  for (const std::uint64_t id : members) {
    const job& j = jobs_->at(id);
    first = std::min(first, j.started);
    last = std::max(last, j.finished);
    out = j.out;
    results.push_back({j.path, j.tensor.bytes, j.error, j.message});
    if (j.error != 0 && j.message.empty()) {
      results.back().message = std::string(j.out ? "swap-out of " : "swap-in of ") + j.path +
                               " failed: " + std::strerror(j.error);
    }
  }
  (out ? *reading_ : *writing_).reserve(2 * members.size());
  // Nothing below allocates.
  if (!members.empty()) (out ? stats_.seconds_out : stats_.seconds_in) += seconds(last - first);
  for (const std::uint64_t id : members) {
    const job& j = jobs_->at(id);
    busy_paths_->erase(j.path);
    (j.out ? *reading_ : *writing_).remove(begin_of(j.tensor), end_of(j.tensor));
    if (j.error != 0) {
      ++stats_.failed;
    } else if (j.out) {
      ++stats_.tensors_out;
      stats_.bytes_out += j.tensor.bytes;
    } else {
      ++stats_.tensors_in;
      stats_.bytes_in += j.tensor.bytes;
    }
    jobs_->erase(id);
  }
  tickets_->erase(ticket);
  done_cv_->notify_all();  // synchronize() may be waiting for this ticket to be collected
  return results;
}

void tensor_swapper::synchronize() {
  made_.require_same_process(who);
  std::unique_lock lock(mutex_);
  synchronize_locked(lock, nullptr);
}

bool tensor_swapper::synchronize_until(clock::time_point deadline) {
  made_.require_same_process(who);
  std::unique_lock lock(mutex_);
  return synchronize_locked(lock, &deadline);
}

bool tensor_swapper::synchronize_locked(std::unique_lock<std::mutex>& lock, const clock::time_point* deadline) {
  for (;;) {
    const auto it = std::find_if(tickets_->begin(), tickets_->end(), [](const auto& t) { return !t.second.waiting; });
    if (it != tickets_->end()) {
      if (!wait_locked(lock, it->first, deadline)) return false;
    } else if (tickets_->empty()) {
      return true;
    } else if (deadline == nullptr) {
      done_cv_->wait(lock);  // tickets other threads wait for: until they are collected
    } else if (done_cv_->wait_until(lock, *deadline) == std::cv_status::timeout) {
      return tickets_->empty();
    }
  }
}

swap_stats tensor_swapper::stats() const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  swap_stats s = stats_;
  s.packed_tensors = packed_->size();
  for (const auto& [dir, pack] : *packs_) s.pack_file_bytes += pack->space.peak();
  s.synchronous_requests = engine_->synchronous_requests();
  if (s.synchronous_requests != 0) {
    io::detail::append_reason(s.fallback, io::synchronous_fallback(s.synchronous_requests));
  }
  return s;
}

void tensor_swapper::discard(const std::string& path) {
  made_.require_same_process(who);
  io::check_path_argument("tensor_swapper::discard", path);
  check_removable(path, spare_path(path));  // before the packed slot is let go
  {
    const std::lock_guard lock(mutex_);
    if (busy_paths_->contains(path)) throw path_in_flight(*jobs_, path);
    if (const auto it = packed_->find(path); it != packed_->end()) {
      it->second.pack->space.free(it->second.offset, it->second.slot_bytes);
      packed_->erase(it);
    }
  }
  remove_files(path);
}

std::map<std::string, double> tensor_swapper::timers() const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return *timers_;
}

}  // namespace tensormem::swap
