#pragma once
// Swap space for offloaded tensors, striped over several folders (one per device): each
// tensor's bytes are cut into stripes dealt out to the folders in turn, so the folders'
// throughputs add up. Every tensor has two generations ("slots") on disk: reads come from the
// committed one, writes go to the other, and `commit` makes a written generation current, so a
// failed or interrupted write never damages the state that was last committed.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensormem/io/file_io.hpp"
#include "tensormem/io/fork_guard.hpp"

namespace tensormem::offload {

/// A failure of the offload layer that names the tensor and, where one is involved, the file
/// and errno.
class offload_error : public std::runtime_error {
 public:
  offload_error(const std::string& message, std::string tensor, std::string path = {}, int error = 0)
      : std::runtime_error(message), tensor_(std::move(tensor)), path_(std::move(path)), error_(error) {}
  const std::string& tensor() const noexcept { return tensor_; }
  const std::string& path() const noexcept { return path_; }
  int error() const noexcept { return error_; }

 private:
  std::string tensor_;
  std::string path_;
  int error_;
};

struct swap_space_options {
  std::vector<std::string> folders;     ///< one per device; at least one; not empty, no NUL byte
  unsigned rank = 0;                    ///< files live in <folder>/rank<rank>/
  std::size_t stripe_bytes = std::size_t{8} << 20;  ///< a multiple of 4096
  /// Per folder, the most bytes this space's files may take (both generations); empty or 0:
  /// no limit besides the filesystem's free space.
  std::vector<std::uint64_t> capacity_bytes;
  io::file_io_options io;               ///< engine, rings, request size, queue depth
  bool remove_files = true;             ///< the destructor deletes the files it made
};

struct swap_space_stats {
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t reads = 0;   ///< tensor reads completed
  std::uint64_t writes = 0;  ///< tensor writes completed
  std::vector<std::uint64_t> folder_bytes;  ///< bytes on disk per folder (both generations)
  io::file_io_stats io;
};

/// Thread-safe: transfers may be queued and finished from several threads. In a child forked
/// after the space was made, every call but `options` throws io::forked_child_error, and the
/// destructor waits for nothing and removes no file (they are the parent's).
class swap_space {
 public:
  /// Queued stripe operations of one tensor transfer.
  struct transfer {
    std::size_t tensor = 0;
    bool write = false;
    unsigned slot = 0;
    std::vector<std::uint64_t> tickets;
  };

  explicit swap_space(swap_space_options options);
  ~swap_space();
  swap_space(const swap_space&) = delete;
  swap_space& operator=(const swap_space&) = delete;

  /// Registers a tensor of `bytes` bytes (buffers for it are `padded_bytes(id)` long, 4096-aligned).
  /// Throws offload_error naming the folder when its capacity would be exceeded or when a file
  /// of that name exists already (EEXIST: never shares or clobbers another space's files), and
  /// std::invalid_argument for an empty, duplicate or non-portable name; nothing is added then.
  std::size_t add(const std::string& name, std::uint64_t bytes);
  std::size_t size() const;
  const std::string& name(std::size_t id) const;
  std::uint64_t bytes(std::size_t id) const;
  std::uint64_t padded_bytes(std::size_t id) const;
  /// True once a generation of the tensor has been committed.
  bool committed(std::size_t id) const;

  /// Queues a read of the committed generation into `buffer` (padded_bytes long, 4096-aligned).
  transfer read(std::size_t id, void* buffer);
  /// Queues a write of `buffer` into the generation that is not committed. Checks each folder's
  /// free space first when the generation's files are new (offload_error naming the tensor
  /// and folder; nothing queued).
  transfer write(std::size_t id, const void* buffer);
  /// Waits for every stripe of `t`; throws offload_error naming the tensor, file and errno of
  /// the first failed stripe (after all have finished).
  void finish(transfer& t);
  /// Makes the generation last written by a finished write the committed one.
  void commit(std::size_t id);

  swap_space_stats stats() const;
  /// Writes started so far, finished, failed or still queued. While it stays the same, no
  /// generation's files have changed: what a caller wrote earlier and has not committed is
  /// still there to commit.
  std::uint64_t writes_started() const;
  const swap_space_options& options() const noexcept { return options_; }
  /// The file of `id`'s generation `slot` in folder `folder`.
  std::string path(std::size_t id, unsigned slot, std::size_t folder) const;

 private:
  struct entry {
    std::string name;
    std::uint64_t bytes = 0;
    std::uint64_t padded = 0;
    int committed = -1;      // slot, or -1
    int written = -1;        // slot written by the last finished write, not yet committed
    bool created[2] = {false, false};
    std::vector<std::uint64_t> folder_share;  // padded bytes per folder, one generation
  };
  const entry& at(std::size_t id) const;
  std::string file_path(const std::string& name, unsigned slot, std::size_t folder) const;
  transfer start(std::size_t id, std::byte* buffer, bool write);
  void queue_stripes(transfer& t, std::byte* buffer, std::uint64_t padded, const std::string& name);
  void check_free_space(const entry& e, unsigned slot) const;

  static constexpr const char* who = "a swap space";
  io::detail::fork_guard made_;
  swap_space_options options_;
  std::vector<std::filesystem::path> dirs_;
  mutable std::mutex mutex_;
  io::detail::unless_forked<std::vector<entry>> entries_;  // left as it is in a forked child
  std::vector<std::uint64_t> reserved_;  // per folder, both generations
  std::uint64_t bytes_read_ = 0, bytes_written_ = 0, reads_ = 0, writes_ = 0, writes_started_ = 0;
  io::async_file_io io_;
};

namespace detail {
/// The bytes of one generation of tensor `id` (`padded` bytes, cut into stripes of `stripe`
/// bytes, stripe c in folder (id + c) mod `folders`) that each folder holds, computed from the
/// counts of stripes (not stripe by stripe: a tensor of 2^62 bytes has 2^39 stripes of 8 MiB).
/// `stripe` and `folders` are positive (the space's options are checked for it).
std::vector<std::uint64_t> stripe_shares(std::size_t id, std::uint64_t padded, std::uint64_t stripe,
                                         std::size_t folders);
}  // namespace detail

}  // namespace tensormem::offload
