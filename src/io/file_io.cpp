#include "tensormem/io/file_io.hpp"

#include "tensormem/io/path_argument.hpp"
#include "tensormem/io/detail/blocking.hpp"
#include "tensormem/core/detail/thread_start.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <filesystem>
#include <memory>
#include <new>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace tensormem::io {

namespace {

constexpr std::uint64_t direct_alignment = 4096;


}  // namespace

const char* kind_of_file(unsigned mode) noexcept {
  return S_ISREG(mode)    ? "a regular file"
         : S_ISDIR(mode)  ? "a directory"
         : S_ISFIFO(mode) ? "a pipe"
         : S_ISLNK(mode)  ? "a symbolic link"
         : S_ISSOCK(mode) ? "a socket"
                          : "a device";
}

std::optional<unsigned> mode_at(const std::string& path) noexcept {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return std::nullopt;
  return static_cast<unsigned>(st.st_mode);
}

std::string describe_transfer_error(int error) {
  std::string words = std::generic_category().message(error);
  if (error == ECANCELED) {
    words += " (io_uring could not start a kernel worker for it: a limit on the user's processes and threads, "
             "RLIMIT_NPROC, is reached)";
  }
  return words;
}

int not_a_file_error(unsigned mode) noexcept { return S_ISDIR(mode) ? EISDIR : EINVAL; }

std::optional<not_a_file> not_a_file_at(const std::string& path, bool link_allowed) noexcept {
  const auto mode = mode_at(path);
  if (!mode || S_ISREG(*mode) || (link_allowed && S_ISLNK(*mode))) return std::nullopt;
  return not_a_file{not_a_file_error(*mode), kind_of_file(*mode)};
}

int keep_opened_file(int fd, const char* path, const char*& refused, bool regular_only) noexcept {
  struct stat st {};
  if (fd < 0) {
    if (errno == ENXIO && ::stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
      refused = kind_of_file(st.st_mode);
      if (regular_only) errno = EINVAL;
    }
    return -1;
  }
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  if (regular_only && !S_ISREG(st.st_mode)) {
    refused = kind_of_file(st.st_mode);
    ::close(fd);
    errno = not_a_file_error(st.st_mode);
    return -1;
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

void check_path_argument(std::string_view who, std::string_view path) {
  if (path.empty()) throw std::invalid_argument(std::string(who) + ": an empty path");
  if (const auto nul = path.find('\0'); nul != std::string_view::npos) {
    throw std::invalid_argument(std::string(who) + ": the path '" + std::string(path.substr(0, nul)) +
                                "\\0...' holds a NUL byte");
  }
}

namespace {

std::atomic<bool> unnamed_temporaries{true};

// The next name a temporary file beside `target` tries.
std::string temporary_name(const std::string& target) {
  static std::atomic<unsigned long> made{0};
  const std::filesystem::path where(target);
  const std::string name = where.filename().string();
  const std::string suffix = ".tensormem-tmp." + std::to_string(::getpid()) + "." + std::to_string(made++);
  // A name at the file system's limit leaves no room for the suffix: a short hidden name then.
  return name.size() + suffix.size() <= NAME_MAX ? target + suffix
                                                 : (where.parent_path() / ("." + suffix.substr(1))).string();
}

// A new file beside `target` under a name no file has (O_EXCL, passing over names taken):
// the descriptor, `temp` its name; or -1 with errno (EEXIST after a hundred names taken),
// `temp` the last name tried.
int create_named_beside(const std::string& target, std::string& temp, mode_t mode) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    temp = temporary_name(target);
    const int fd = detail::repeat_interrupted(
        [&] { return ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode); });
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  return -1;  // errno EEXIST: a hundred names taken
}

// An unnamed file that cannot be linked (a file system with unnamed files but no hard links)
// copied into a new named file with its permission bits (and owner where they can be set),
// synced. Returns 0 and sets `temp`, or -1 with errno, nothing left behind.
int copy_to_named(int fd, const std::string& target, std::string& temp) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return -1;
  std::string name;
  const int copy = create_named_beside(target, name, st.st_mode & 07777);
  if (copy < 0) return -1;
  if (st.st_uid != ::geteuid() || st.st_gid != ::getegid()) {
    static_cast<void>(::fchown(copy, st.st_uid, st.st_gid));  // refused: the copy is the writer's
  }
  int error = ::fchmod(copy, st.st_mode & 07777) != 0 ? errno : 0;  // (not narrowed by the umask)
  if (error == 0 && detail::copy_whole_file(fd, copy) != 0) error = errno;
  if (error == 0 && detail::repeat_interrupted([&] { return ::fsync(copy); }) != 0) error = errno;
  if (::close(copy) != 0 && error == 0 && errno != EINTR) error = errno;
  if (error != 0) {
    ::unlink(name.c_str());
    errno = error;
    return -1;
  }
  temp = std::move(name);
  return 0;
}

}  // namespace

namespace detail {
bool allow_unnamed_temporaries(bool allowed) noexcept { return unnamed_temporaries.exchange(allowed); }
bool unnamed_temporaries_allowed() noexcept { return unnamed_temporaries.load(); }

int copy_whole_file(int from, int to) noexcept {
  loff_t in = 0;
  loff_t out = 0;
  for (;;) {
    const ssize_t n = detail::repeat_interrupted([&] { return ::copy_file_range(from, &in, to, &out, 1 << 30, 0); });
    if (n == 0) return 0;
    if (n > 0) continue;
    if (in != 0 || (errno != EXDEV && errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)) return -1;
    break;  // none copied, and the file system cannot: through a buffer
  }
  constexpr std::size_t chunk = std::size_t{1} << 20;
  const std::unique_ptr<char[]> buffer(new (std::nothrow) char[chunk]);
  if (!buffer) {
    errno = ENOMEM;
    return -1;
  }
  for (std::uint64_t at = 0;; at += chunk) {
    const detail::transferred got = detail::pread_fully(from, buffer.get(), chunk, at);
    if (got.error != 0) {
      errno = got.error;
      return -1;
    }
    const detail::transferred put = detail::pwrite_fully(to, buffer.get(), got.bytes, at);
    if (put.bytes != got.bytes) {
      errno = put.error != 0 ? put.error : EIO;
      return -1;
    }
    if (got.bytes < chunk) return 0;
  }
}
}  // namespace detail

int create_temporary_beside(const std::string& target, std::string& temp, unsigned mode) {
  temp.clear();
  if (unnamed_temporaries.load() && ::access("/proc/self/fd", X_OK) == 0) {
    const int fd = detail::repeat_interrupted([&] {
      // (read too: where it cannot be linked, it is copied)
      return ::open(folder_of(target).c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, static_cast<mode_t>(mode));
    });
    // Any failure (no O_TMPFILE there: EOPNOTSUPP, EISDIR; or the folder's own, which the
    // named file meets again and reports by its name) tries a named file.
    if (fd >= 0) return fd;
  }
  return create_named_beside(target, temp, static_cast<mode_t>(mode));
}

int name_temporary(int fd, const std::string& target, std::string& temp) {
  if (!temp.empty()) return 0;
  const std::string by = "/proc/self/fd/" + std::to_string(fd);
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string name = temporary_name(target);
    if (::linkat(AT_FDCWD, by.c_str(), AT_FDCWD, name.c_str(), AT_SYMLINK_FOLLOW) == 0) {
      temp = std::move(name);
      return 0;
    }
    if (errno != EEXIST) return copy_to_named(fd, target, temp);  // (no hard links there)
  }
  return -1;  // errno EEXIST: a hundred names taken
}

std::string temporary_in_messages(const std::string& target, const std::string& temp) {
  return temp.empty() ? target + " (its new file, not yet named)" : temp;
}

std::string folder_of(const std::string& path) {
  std::string folder = std::filesystem::path(path).parent_path().string();
  return folder.empty() ? "." : folder;
}

void sync_folder_of(std::string_view who, const std::string& path) { sync_folder(who, folder_of(path), path); }

void sync_folder(std::string_view who, const std::string& folder, const std::string& path) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const int synced = fd < 0 ? -1 : detail::repeat_interrupted([fd] { return ::fsync(fd); });
  const int error = synced != 0 ? errno : 0;
  if (fd >= 0) ::close(fd);
  if (error != 0) {
    throw std::system_error(error, std::generic_category(),
                            std::string(who) + ": cannot sync the folder '" + folder + "' of " + path);
  }
}

async_file_io::async_file_io(file_io_options options) : options_(options) {
  if (options_.block_bytes == 0) throw std::invalid_argument("async_file_io: block_bytes must be positive");
  if (options_.queue_depth == 0) throw std::invalid_argument("async_file_io: queue_depth must be positive");
  if (options_.rings == 0 || options_.rings > max_rings) {
    throw std::invalid_argument("async_file_io: rings must be 1 to " + std::to_string(max_rings) + ", not " +
                                std::to_string(options_.rings));
  }
  for (unsigned i = 0; i < options_.rings; ++i) {
    auto r = std::make_unique<ring>();
    std::string why;
    r->engine = options_.make_engine ? options_.make_engine(options_.queue_depth)
                                     : make_engine(options_.engine, options_.queue_depth, why);
    if (!why.empty() && stats_.fallback.empty()) stats_.fallback = why;
    stats_.engine = std::string(to_string(r->engine->kind()));
    rings_.push_back(std::move(r));
  }
  std::size_t started = 0;
  try {
    for (; started < rings_.size(); ++started) {
      ring* r = rings_[started].get();
      *r->thread = std::thread([this, r] { run(*r); });
    }
  } catch (...) {
    if (started == 0) core::detail::rethrow_naming_thread_start("async_file_io");
    // Fewer rings than asked (a limit on threads): those with a thread take every block, and
    // the others go (nothing was queued on them yet). Said in the stats.
    rings_.resize(started);
    try {
      detail::append_reason(stats_.fallback, "async_file_io started " + std::to_string(started) + " of its " +
                                                 std::to_string(options_.rings) +
                                                 " rings' threads (a limit on threads)");
    } catch (...) {
      stop_rings();  // a joinable thread destroyed would end the process
      throw;
    }
  }
}

void async_file_io::stop_rings() noexcept {
  {
    std::unique_lock lock(mutex_);
    done_->wait(lock, [this] { return unfinished_ops_ == 0; });
    stop_ = true;
  }
  for (auto& r : rings_) r->work->notify_all();
  for (auto& r : rings_) {
    if (r->thread->joinable()) r->thread->join();
  }
}

async_file_io::~async_file_io() {
  // In a forked child the ring threads do not exist, the lock may be a parent thread's and
  // the operations may be half-changed: nothing is waited for or read, and the child's copies
  // of the descriptors stay open until it exits or execs (they are opened O_CLOEXEC).
  if (made_.forked()) return;
  stop_rings();
  for (auto& [id, o] : *ops_) {
    if (o.fd >= 0) ::close(o.fd);
  }
}

std::uint64_t async_file_io::read(void* buffer, std::size_t bytes, const std::string& path,
                                  std::uint64_t file_offset, bool validate) {
  return queue(false, static_cast<std::byte*>(buffer), bytes, path, file_offset, validate);
}

std::uint64_t async_file_io::write(const void* buffer, std::size_t bytes, const std::string& path,
                                   std::uint64_t file_offset, bool validate) {
  // The engines never write into a write's buffer.
  return queue(true, const_cast<std::byte*>(static_cast<const std::byte*>(buffer)), bytes, path, file_offset, validate);
}

std::uint64_t async_file_io::queue(bool write, std::byte* buffer, std::size_t bytes, const std::string& path,
                          std::uint64_t file_offset, bool validate) {
  made_.require_same_process(who);
  check_path_argument("async_file_io", path);
  if (bytes != 0 && buffer == nullptr) throw std::invalid_argument("async_file_io: null buffer for " + path);
  if (file_offset > UINT64_MAX - bytes || file_offset + bytes > static_cast<std::uint64_t>(INT64_MAX)) {
    throw std::invalid_argument("async_file_io: offset " + std::to_string(file_offset) + " + " +
                                std::to_string(bytes) + " bytes is past the largest file offset (" + path + ")");
  }
  const auto aligned = [](std::uint64_t v) { return v % direct_alignment == 0; };
  bool direct = options_.direct && aligned(reinterpret_cast<std::uintptr_t>(buffer)) && aligned(file_offset) &&
                aligned(bytes);
  const bool wanted_direct = direct;
  const int flags = (write ? O_WRONLY | O_CREAT : O_RDONLY) | O_CLOEXEC | (options_.follow_links ? 0 : O_NOFOLLOW);
  const char* refused = nullptr;
  const int fd = open_regular_file(
      path.c_str(), [&](int extra) { return ::open(path.c_str(), flags | extra, 0600); }, direct, refused);
  if (fd < 0) {
    int e = errno;
    if (e == ELOOP && !options_.follow_links) {  // O_NOFOLLOW met a link at the path itself
      if (const auto mode = mode_at(path); mode && S_ISLNK(*mode)) {
        refused = kind_of_file(*mode);
        e = EINVAL;
      }
    }
    throw std::system_error(e, std::generic_category(),
                            std::string("cannot open ") + path + (write ? " for writing" : " for reading") +
                                (refused != nullptr ? std::string(": it is ") + refused + ", not a regular file" : ""));
  }
  if (!write) {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<std::uint64_t>(st.st_size) < file_offset + bytes) {
      const auto size = static_cast<std::uint64_t>(st.st_size);
      ::close(fd);
      throw std::system_error(EINVAL, std::generic_category(),
                              path + " has " + std::to_string(size) + " bytes; reading " + std::to_string(bytes) +
                                  " at offset " + std::to_string(file_offset) + " needs " +
                                  std::to_string(file_offset + bytes));
    }
  }
  // Blocks of block_bytes (a multiple of 4096 under O_DIRECT), dealt out to the rings.
  std::uint64_t block = options_.block_bytes;
  if (direct) block = (block + direct_alignment - 1) / direct_alignment * direct_alignment;
  // A request that cannot be queued for lack of memory leaves nothing behind: no op that
  // wait() would wait for, no part of the transfer queued, the file closed.
  std::vector<std::size_t> pushed;  // requests of this op queued on each ring
  try {
    pushed.assign(rings_.size(), 0);
  } catch (...) {
    ::close(fd);
    throw;
  }
  std::unique_lock lock(mutex_);
  const std::uint64_t id = next_id_;
  op* made = nullptr;
  try {
    if (wanted_direct && !direct && stats_.fallback.empty()) {
      stats_.fallback = "O_DIRECT refused by the filesystem of " + path + "; buffered I/O";
    }
    made = &ops_->try_emplace(id).first->second;
    // (copies the path)
    *made = {path, fd, write, validate, direct, buffer, bytes, file_offset, 0, false, 0, 0, 0, {}};
  } catch (...) {
    if (made != nullptr) ops_->erase(id);
    ::close(fd);
    throw;
  }
  ++next_id_;
  op& o = *made;
  ++unfinished_ops_;
  ++(direct ? stats_.direct_ops : stats_.buffered_ops);
  if (bytes == 0) {
    finish(o);
    return id;
  }
  std::size_t next = next_ring_;
  try {
    for (std::uint64_t done = 0; done < bytes; done += block) {
      io_request q;
      q.fd = fd;
      q.offset = file_offset + done;
      q.buffer = buffer + done;
      q.bytes = static_cast<std::size_t>(std::min<std::uint64_t>(block, bytes - done));
      q.write = write;
      q.user_data = id;
      rings_[next]->queued->push_back(q);
      ++pushed[next];
      next = (next + 1) % rings_.size();
    }
  } catch (...) {
    // Under the lock all along: no ring has taken any of them; they are the last queued.
    for (std::size_t i = 0; i < rings_.size(); ++i) {
      for (std::size_t k = 0; k < pushed[i]; ++k) rings_[i]->queued->pop_back();
    }
    --unfinished_ops_;
    --(direct ? stats_.direct_ops : stats_.buffered_ops);
    ops_->erase(id);
    ::close(fd);
    throw;
  }
  next_ring_ = next;
  for (const std::size_t n : pushed) {
    o.unfinished += n;
    stats_.requests += n;
  }
  lock.unlock();
  for (std::size_t i = 0; i < rings_.size(); ++i) {
    if (pushed[i] != 0) rings_[i]->work->notify_one();
  }
  return id;
}

// A ring's thread: hands queued requests to its engine and collects completions; the engine
// is touched by this thread only.
//
// Nothing this thread does may throw: an exception would end the process. Out of memory
// (the engines throw only std::bad_alloc) fails what it was submitting with ENOMEM, or, for a
// wait, is retried after a pause (the requests in flight hold their buffers; they cannot be
// given up). The batch changes hands with the ring's queue by a swap, without allocating.
void async_file_io::run(ring& r) {
  core::detail::prepare_thread_for_exceptions();
  std::unique_lock lock(mutex_);
  std::vector<io_request> batch;
  for (;;) {
    if (!r.queued->empty()) {
      batch.swap(*r.queued);
      lock.unlock();
      const bool submitted = detail::submit_or_refuse(*r.engine, batch);
      lock.lock();
      if (!submitted) {
        for (const io_request& q : batch) complete({q.user_data, -ENOMEM, q.total()});
      }
      batch.clear();
      continue;
    }
    if (r.engine->outstanding() == 0) {
      if (stop_) return;
      r.work->wait(lock, [&] { return stop_ || !r.queued->empty(); });
      continue;
    }
    lock.unlock();
    const std::vector<io_completion> done = detail::wait_or_pause(*r.engine);
    lock.lock();
    for (const io_completion& c : done) complete(c);
  }
}

void async_file_io::complete(const io_completion& c) noexcept {
  op& o = ops_->find(c.user_data)->second;
  if (o.error == 0 && (c.result < 0 || static_cast<std::size_t>(c.result) < c.bytes)) {
    o.error = c.result < 0 ? static_cast<int>(-c.result) : EIO;
    o.moved = c.result;
    o.asked = c.bytes;
  }
  if (--o.unfinished == 0) finish(o);
}

// On the collecting thread: a failure's message, unless the validation made one.
void async_file_io::make_message(op& o) {
  if (o.error == 0 || !o.message.empty()) return;
  if (o.moved < 0) {
    o.message = std::string(o.write ? "write to " : "read from ") + o.path + " failed: " +
                describe_transfer_error(o.error);
  } else {
    o.message = std::string(o.write ? "short write to " : "short read from ") + o.path + ": " +
                std::to_string(o.moved) + " of " + std::to_string(o.asked) + " bytes";
  }
}

void async_file_io::finish(op& o) {
  ::close(o.fd);
  o.fd = -1;
  o.finished = true;
  ++stats_.ops;
  if (o.error != 0) {
    ++stats_.failed;
  } else {
    (o.write ? stats_.bytes_written : stats_.bytes_read) += o.bytes;
  }
  --unfinished_ops_;
  done_->notify_all();
}

async_file_io::wait_result async_file_io::wait() {
  return *wait_until(std::chrono::steady_clock::time_point::max());
}

std::optional<async_file_io::wait_result> async_file_io::wait_until(std::chrono::steady_clock::time_point deadline) {
  made_.require_same_process(who);
  std::unique_lock lock(mutex_);
  const auto finished_all = [this] { return unfinished_ops_ == 0; };
  if (deadline == std::chrono::steady_clock::time_point::max()) {
    done_->wait(lock, finished_all);
  } else if (!done_->wait_until(lock, deadline, finished_all)) {
    return std::nullopt;
  }
  std::map<std::uint64_t, op> finished;
  finished.swap(*ops_);
  lock.unlock();
  try {
    wait_result result;
    for (auto& [id, o] : finished) {
      ++result.completed;
      check_validation(o);
      make_message(o);
      if (o.error != 0) result.errors.push_back({o.path, o.error, o.message, id});
    }
    return result;
  } catch (...) {  // std::bad_alloc: nothing is collected; a later wait reports them all
    const std::lock_guard again(mutex_);
    ops_->merge(finished);  // moves the nodes back, allocating nothing
    throw;
  }
}

file_io_error async_file_io::wait_for(std::uint64_t ticket) {
  made_.require_same_process(who);
  std::unique_lock lock(mutex_);
  const auto unknown = [&] {
    return std::invalid_argument("async_file_io::wait_for: unknown or already collected operation " +
                                 std::to_string(ticket));
  };
  if (ops_->find(ticket) == ops_->end()) throw unknown();
  // A concurrent wait() may collect the operation meanwhile: look it up again after each wake.
  done_->wait(lock, [&] {
    const auto it = ops_->find(ticket);
    return it == ops_->end() || it->second.finished;
  });
  const auto it = ops_->find(ticket);
  if (it == ops_->end()) throw unknown();
  auto taken = ops_->extract(it);
  lock.unlock();
  try {
    op& o = taken.mapped();
    check_validation(o);
    make_message(o);
    return o.error != 0 ? file_io_error{o.path, o.error, o.message, ticket} : file_io_error{};
  } catch (...) {  // std::bad_alloc: not collected; a later wait_for or wait reports it
    const std::lock_guard again(mutex_);
    ops_->insert(std::move(taken));
    throw;
  }
}

// Reads a finished, validated operation's range back through the page cache and compares.
// An interrupted read is repeated; a read that fails (or a file that cannot be opened again)
// fails the operation with its errno, and a file that ends inside the range with EBADMSG, each
// saying so: only bytes that were read and differ are reported as differing.
void async_file_io::check_validation(op& o) {
  if (o.error != 0 || !o.validate || o.bytes == 0) return;
  std::vector<std::byte> back(o.bytes);
  const int fd = ::open(o.path.c_str(), O_RDONLY | O_CLOEXEC);
  const detail::transferred read_back =
      fd < 0 ? detail::transferred{0, errno} : detail::pread_fully(fd, back.data(), o.bytes, o.file_offset);
  const int error = read_back.error;
  const std::size_t got = read_back.bytes;
  if (fd >= 0) ::close(fd);
  if (error == 0 && got == o.bytes && std::memcmp(back.data(), o.buffer, o.bytes) == 0) return;
  {
    const std::lock_guard stats_lock(mutex_);
    ++stats_.failed;
    (o.write ? stats_.bytes_written : stats_.bytes_read) -= o.bytes;
  }
  const std::string range = std::to_string(o.bytes) + " bytes at offset " + std::to_string(o.file_offset);
  if (error != 0) {
    o.error = error;
    o.message = "validation of " + o.path + " failed: cannot read the file's " + range + " back: " +
                std::generic_category().message(error);
  } else if (got < o.bytes) {
    o.error = EBADMSG;
    o.message = "validation of " + o.path + " failed: the file ends " + std::to_string(got) + " bytes into the " +
                range;
  } else {
    o.error = EBADMSG;
    o.message = "validation of " + o.path + " failed: the file's " + range + " differ from the buffer";
  }
}

std::size_t async_file_io::pending() const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return ops_->size();
}

std::string synchronous_fallback(std::uint64_t requests) {
  return "io_uring could not start a kernel worker for " + std::to_string(requests) +
         " requests (a limit on the user's processes and threads, RLIMIT_NPROC, is reached): they were moved by "
         "blocking calls on the ring's thread";
}

file_io_stats async_file_io::stats() const {
  made_.require_same_process(who);
  file_io_stats s;
  {
    const std::lock_guard lock(mutex_);
    s = stats_;
  }
  for (const auto& r : rings_) s.synchronous_requests += r->engine->synchronous_requests();
  if (s.synchronous_requests != 0) detail::append_reason(s.fallback, synchronous_fallback(s.synchronous_requests));
  return s;
}

}  // namespace tensormem::io
