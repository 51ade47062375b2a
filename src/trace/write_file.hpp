#pragma once
// Writes a text file through a callback, so that a failed write loses nothing.
//
// A regular file at the path (or at the end of a symbolic link there) is replaced only once
// the new one is complete: the text goes to a new file in its folder, which is synced, named
// `<file>.tensormem-tmp.<pid>.<n>` (a name no file has) and renamed onto the file; the
// replacement keeps the old file's permission bits (and its owner and group where the writer
// may set them). A new file is made the same way, so a partial file is never seen
// at the path. A file the writer may not write is refused (EACCES), as its open would be,
// though its folder would let a rename replace it. A write that fails (a full disk, a
// file-size limit, an exception from the callback) removes the temporary file and leaves what
// was at the path as it was. The new file has no name while it is written where the file
// system can (O_TMPFILE), so a process killed while writing leaves nothing; elsewhere it is
// named from the start (O_EXCL), and such a process leaves it (never a partial file at the
// path).
//
// Written in place instead: a device, a pipe or a socket (nothing there to keep), anything
// under /dev or /proc and a link to such a path (/dev/stdout where a shell sent it to a file:
// the process writes on through its descriptor, which must still name the file), a link that
// leads to no file or to something other than a regular file, and an existing file in a
// folder the writer may not add files to (EACCES or EPERM there). A file replaced by rename
// is a new file: other hard links to the old one keep the old text.
//
// Errors: std::system_error "cannot write <path>: <reason>" (EINTR where a signal interrupts
// the open of a pipe waiting for its reader: nothing was written, the caller may call again);
// std::invalid_argument for an empty path or one holding a NUL byte.

#include <memory>
#include <ostream>
#include <streambuf>
#include <string>

namespace tensormem::trace::detail {

class output_file {
 public:
  explicit output_file(const std::string& path);
  ~output_file();
  output_file(const output_file&) = delete;
  output_file& operator=(const output_file&) = delete;

  std::ostream& stream() noexcept { return stream_; }
  /// Flushes, syncs and closes the file, then renames it into place. Throws
  /// std::system_error naming the path when any of it fails; the temporary file is gone then.
  void commit();

 private:
  // Buffers writes to a descriptor, 64 KiB at a time, continuing short and interrupted
  // writes; the first failure's errno is kept and every later write refused.
  class fd_buffer final : public std::streambuf {
   public:
    fd_buffer();
    void attach(int fd) noexcept { fd_ = fd; }
    int error() const noexcept { return error_; }

   protected:
    int_type overflow(int_type ch) override;
    int sync() override;

   private:
    bool drain() noexcept;
    std::unique_ptr<char[]> data_;
    int fd_ = -1;
    int error_ = 0;
  };

  [[noreturn]] void fail(int error);

  std::string path_;    // as given, for messages
  std::string target_;  // the file a commit replaces (a link's target); empty when in place
  std::string temp_;    // the temporary file while it exists
  int fd_ = -1;
  fd_buffer buffer_;
  std::ostream stream_;
};

template <class Write>
void write_file(const std::string& path, Write&& write) {
  output_file out(path);
  write(out.stream());
  out.commit();
}

}  // namespace tensormem::trace::detail
