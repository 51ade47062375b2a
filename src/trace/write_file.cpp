#include "write_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "tensormem/io/detail/blocking.hpp"
#include "tensormem/io/path_argument.hpp"

namespace tensormem::trace::detail {
namespace {

constexpr std::size_t buffer_bytes = 64 * 1024;

// Whether `path` lies under /dev or /proc (read without following links).
bool under_dev_or_proc(const std::string& path) {
  std::error_code error;
  const std::string absolute = std::filesystem::absolute(path, error).lexically_normal().string();
  return !error && (absolute.starts_with("/dev/") || absolute.starts_with("/proc/"));
}

// A regular file at `path`, or at the end of the symbolic link at `path`: its path (the link's
// target resolved) and status. False where there is none (nothing there, a dangling link,
// something else, or a path that cannot be looked at: the open reports that).
bool regular_file_at(const std::string& path, std::string& file, struct stat& st, bool& nothing_there) {
  nothing_there = false;
  // /dev/stdout, /dev/fd/N, /proc/self/fd/N: a descriptor the process already has open,
  // perhaps on a regular file (a shell's `> out`); a rename would put a new file there and
  // leave the descriptor on the old one, whose later writes no one would see.
  if (under_dev_or_proc(path)) return false;
  if (::lstat(path.c_str(), &st) != 0) {
    nothing_there = errno == ENOENT;
    return false;
  }
  if (S_ISREG(st.st_mode)) {
    file = path;
    return true;
  }
  if (!S_ISLNK(st.st_mode)) return false;
  // A link to one of them (out.csv -> /dev/stdout), at any step of its chain, likewise.
  std::filesystem::path step(path);
  for (int hop = 0; hop < 40; ++hop) {
    std::error_code error;
    if (!std::filesystem::is_symlink(step, error)) break;
    const std::filesystem::path to = std::filesystem::read_symlink(step, error);
    if (error) break;
    step = to.is_absolute() ? to : step.parent_path() / to;
    if (under_dev_or_proc(step.string())) return false;
  }
  char* real = ::realpath(path.c_str(), nullptr);
  if (real == nullptr) return false;
  file = real;
  std::free(real);
  return ::stat(file.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

output_file::fd_buffer::fd_buffer() : data_(new char[buffer_bytes]) {
  setp(data_.get(), data_.get() + buffer_bytes);
}

bool output_file::fd_buffer::drain() noexcept {
  if (error_ != 0) return false;
  const auto bytes = static_cast<std::size_t>(pptr() - pbase());
  const io::detail::transferred done = io::detail::write_fully(fd_, pbase(), bytes);
  if (done.bytes != bytes) {
    error_ = done.error != 0 ? done.error : EIO;  // a write that moved nothing
    return false;
  }
  setp(data_.get(), data_.get() + buffer_bytes);
  return true;
}

output_file::fd_buffer::int_type output_file::fd_buffer::overflow(int_type ch) {
  if (!drain()) return traits_type::eof();
  if (!traits_type::eq_int_type(ch, traits_type::eof())) {
    *pptr() = traits_type::to_char_type(ch);
    pbump(1);
  }
  return traits_type::not_eof(ch);
}

int output_file::fd_buffer::sync() { return drain() ? 0 : -1; }

output_file::output_file(const std::string& path) : path_(path), stream_(&buffer_) {
  io::check_path_argument("cannot write", path);
  std::string file;
  struct stat old {};
  bool nothing_there = false;
  const bool replace = regular_file_at(path, file, old, nothing_there);
  // A file the writer may not change is refused as its open would refuse it, though the
  // folder would let a rename replace it.
  if (replace && ::faccessat(AT_FDCWD, file.c_str(), W_OK, AT_EACCESS) != 0) fail(errno);
  if (replace || nothing_there) {
    target_ = replace ? file : path;
    fd_ = io::create_temporary_beside(target_, temp_, 0666);
    if (fd_ < 0) {
      const int error = errno;
      temp_.clear();
      // A file the writer may change in a folder it may not add files to: written in place.
      if (!(replace && (error == EACCES || error == EPERM))) fail(error);
      target_.clear();
    } else if (replace) {
      // The replacement keeps the old file's owner and group where the writer may set them
      // (a process that may not gives the file its own), then its permission bits.
      if (old.st_uid != ::geteuid() || old.st_gid != ::getegid()) {
        const int kept = ::fchown(fd_, old.st_uid, old.st_gid);
        static_cast<void>(kept);  // refused (EPERM): the new file is the writer's
      }
      if (::fchmod(fd_, old.st_mode & 07777) != 0) fail(errno);
    }
  }
  if (fd_ < 0) {
    // Not repeated after EINTR: the open of a pipe waits for its reader, and a caller that
    // answers signals (Python's handlers, Ctrl-C) gets the error, runs them and calls again.
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd_ < 0) fail(errno);
  }
  buffer_.attach(fd_);
}

output_file::~output_file() {
  if (fd_ >= 0) ::close(fd_);
  if (!temp_.empty()) ::unlink(temp_.c_str());
}

void output_file::fail(int error) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temp_.empty()) ::unlink(temp_.c_str());
  temp_.clear();
  throw std::system_error(error, std::generic_category(), "cannot write " + path_);
}

void output_file::commit() {
  stream_.flush();
  if (buffer_.error() != 0) fail(buffer_.error());
  if (!stream_) fail(EIO);
  if (!target_.empty()) {
    if (io::detail::repeat_interrupted([&] { return ::fsync(fd_); }) != 0) fail(errno);
    if (io::name_temporary(fd_, target_, temp_) != 0) fail(errno);  // (an unnamed file: named now)
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0 && errno != EINTR) fail(errno);  // (after EINTR the descriptor is closed)
  if (!target_.empty()) {
    if (::rename(temp_.c_str(), target_.c_str()) != 0) fail(errno);
    temp_.clear();
  }
}

}  // namespace tensormem::trace::detail
