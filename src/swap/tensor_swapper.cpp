#include "tensormem/swap/tensor_swapper.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string_view>

#include "tensormem/swap/crc32c.hpp"

namespace tensormem::swap {

namespace {

constexpr std::size_t header_bytes = 4096;
constexpr std::size_t io_alignment = 4096;
constexpr char magic[8] = {'T', 'M', 'S', 'W', 'A', 'P', '0', '2'};
constexpr std::size_t no_staging = static_cast<std::size_t>(-1);
constexpr std::size_t key_room = 4000;  // bytes of the key kept in the header (its tail)

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

std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

bool aligned(const void* p, std::size_t n) {
  return reinterpret_cast<std::uintptr_t>(p) % io_alignment == 0 && n % io_alignment == 0;
}

}  // namespace

struct tensor_swapper::job {
  std::uint64_t ticket = 0;
  std::string path;
  std::string key;        // identity recorded in (swap-out) or expected of (swap-in) the file
  std::string temp_path;  // swap-out writes here, then renames onto `path`
  tensor_ref tensor;
  bool out = true;
  int fd = -1;
  bool direct = false;
  std::size_t requests_left = 0;
  bool issuing = true;  // requests are still being queued
  bool done = false;
  int error = 0;
  std::string message;
  std::uint32_t crc = 0;
  bool crc_present = false;
  std::chrono::steady_clock::time_point started;
  std::chrono::steady_clock::time_point finished;
};

struct tensor_swapper::pending_request {
  std::size_t job = 0;
  std::size_t staging = no_staging;
  void* copy_to = nullptr;  // staged read: where the bytes go once read
  std::size_t copy_bytes = 0;
  std::size_t expected = 0;
  bool write = false;
};

tensor_swapper::tensor_swapper(memory::pinned_pool& pool, swap_options options)
    : tensor_swapper(pool, options, nullptr) {}

tensor_swapper::tensor_swapper(memory::pinned_pool& pool, swap_options options,
                               std::unique_ptr<io::io_engine> engine)
    : pool_(pool), options_(options), engine_(std::move(engine)) {
  if (options_.block_bytes == 0 || options_.block_bytes % io_alignment != 0) {
    throw std::invalid_argument("tensor_swapper: block_bytes must be a positive multiple of 4096");
  }
  std::string reason;
  if (!engine_) engine_ = io::make_engine(options_.engine, options_.queue_depth, reason);
  stats_.engine = std::string(io::to_string(engine_->kind()));
  stats_.fallback = reason;
  stats_.checksums = options_.checksums;
  stats_.direct = options_.direct;
  const std::size_t count = std::max<std::size_t>(options_.staging_buffers, 1);
  try {
    for (std::size_t i = 0; i < count; ++i) {
      staging_.push_back(static_cast<std::byte*>(pool_.allocate(options_.block_bytes, io_alignment)));
      free_staging_.push_back(i);
    }
  } catch (...) {
    for (std::byte* b : staging_) pool_.free(b);
    throw;
  }
  // Fixed buffers where io_uring allows them; plain requests otherwise.
  std::vector<std::span<std::byte>> regions;
  for (std::byte* b : staging_) regions.emplace_back(b, options_.block_bytes);
  stats_.registered_staging = engine_->register_buffers(regions);
}

tensor_swapper::~tensor_swapper() {
  synchronize();
  engine_.reset();  // unregisters the staging buffers before they go back to the pool
  for (std::byte* b : staging_) pool_.free(b);
}

int tensor_swapper::open_file(const std::string& path, bool out, bool& direct) {
  const int base = out ? O_WRONLY | O_CREAT | O_TRUNC : O_RDONLY;
  direct = options_.direct;
  if (direct) {
    const int fd = open(path.c_str(), base | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EINVAL) return fd;
    // The filesystem refuses O_DIRECT (tmpfs): buffered I/O, reported.
    direct = false;
    stats_.direct = false;
    if (stats_.fallback.empty()) {
      stats_.fallback = "O_DIRECT refused by the filesystem of " + path + "; buffered I/O";
    }
  }
  return open(path.c_str(), base | O_CLOEXEC, 0644);
}

std::size_t tensor_swapper::take_staging() {
  while (free_staging_.empty()) drive(1);
  const std::size_t s = free_staging_.back();
  free_staging_.pop_back();
  return s;
}

void tensor_swapper::issue(std::size_t job_index, std::uint64_t file_offset, void* buffer,
                           std::size_t bytes, bool write, std::size_t staging, void* copy_to,
                           std::size_t copy_bytes) {
  std::size_t slot = 0;
  if (!free_requests_.empty()) {
    slot = free_requests_.back();
    free_requests_.pop_back();
  } else {
    slot = requests_.size();
    requests_.emplace_back();
  }
  requests_[slot] = {job_index, staging, copy_to, copy_bytes, bytes, write};
  job& j = jobs_[job_index];
  ++j.requests_left;
  const io::io_request r{j.fd, file_offset, buffer, bytes, write, slot};
  engine_->submit({&r, 1});
}

void tensor_swapper::start_out(job& j) {
  const std::size_t index = static_cast<std::size_t>(&j - jobs_.data());
  const auto* data = static_cast<const std::byte*>(j.tensor.data);
  if (options_.checksums) {
    const auto t0 = clock::now();
    j.crc = crc32c(data, j.tensor.bytes);
    j.crc_present = true;
    timers_["checksum"] += std::chrono::duration<double>(clock::now() - t0).count();
  }
  const std::size_t h = take_staging();
  write_header(staging_[h], j.tensor.bytes, j.crc, j.crc_present, j.key);
  issue(index, 0, staging_[h], header_bytes, true, h, nullptr, 0);
  for (std::size_t off = 0; off < j.tensor.bytes; off += options_.block_bytes) {
    const std::size_t n = std::min(options_.block_bytes, j.tensor.bytes - off);
    void* src = const_cast<std::byte*>(data + off);
    if (!jobs_[index].direct || aligned(src, n)) {
      issue(index, header_bytes + off, src, n, true, no_staging, nullptr, 0);
      stats_.direct_bytes += n;
    } else {
      const auto t0 = clock::now();
      const std::size_t s = take_staging();
      const std::size_t padded = round_up(n, io_alignment);
      std::memcpy(staging_[s], src, n);
      std::memset(staging_[s] + n, 0, padded - n);
      timers_["staging_copy"] += std::chrono::duration<double>(clock::now() - t0).count();
      issue(index, header_bytes + off, staging_[s], padded, true, s, nullptr, 0);
      stats_.staged_bytes += n;
    }
  }
}

void tensor_swapper::start_in(job& j) {
  const std::size_t index = static_cast<std::size_t>(&j - jobs_.data());
  // The header is read synchronously: it decides whether anything else is read.
  const std::size_t h = take_staging();
  const ssize_t got = pread(j.fd, staging_[h], header_bytes, 0);
  const int read_errno = errno;
  file_header header{};
  std::string problem = got == static_cast<ssize_t>(header_bytes)
                            ? check_header(staging_[h], j.key, header)
                            : "is not a tensormem swap file (or was never written completely)";
  free_staging_.push_back(h);
  if (!problem.empty()) {
    j.error = got < 0 ? read_errno : (problem.find("corrupt") != std::string::npos ? EBADMSG : EINVAL);
    j.message = j.path + " " + problem;
    return;
  }
  if (options_.checksums && (header.flags & 1U) == 0) {
    // The swapper's setting decides, not the file: with checksums on, data that carries
    // none cannot be verified and is refused.
    j.error = EBADMSG;
    j.message = j.path + " carries no checksum (written with checksums off) and checksums are on";
    return;
  }
  if (header.bytes != j.tensor.bytes) {
    j.error = EINVAL;
    j.message = j.path + " holds " + std::to_string(header.bytes) + " bytes; the tensor has " +
                std::to_string(j.tensor.bytes);
    return;
  }
  j.crc = header.crc;
  j.crc_present = (header.flags & 1U) != 0;
  auto* data = static_cast<std::byte*>(j.tensor.data);
  for (std::size_t off = 0; off < j.tensor.bytes; off += options_.block_bytes) {
    const std::size_t n = std::min(options_.block_bytes, j.tensor.bytes - off);
    if (!jobs_[index].direct || aligned(data + off, n)) {
      issue(index, header_bytes + off, data + off, n, false, no_staging, nullptr, 0);
      stats_.direct_bytes += n;
    } else {
      const std::size_t s = take_staging();
      const std::size_t padded = round_up(n, io_alignment);
      issue(index, header_bytes + off, staging_[s], padded, false, s, data + off, n);
      stats_.staged_bytes += n;
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
    if (!batch.insert(p).second) {
      throw std::invalid_argument("tensor_swapper: " + p + " appears twice in one batch");
    }
    if (busy_paths_.contains(p)) {
      throw std::invalid_argument("tensor_swapper: " + p + " is in a transfer not yet waited for");
    }
  }
  const std::uint64_t ticket = next_ticket_++;
  auto& members = tickets_[ticket];
  jobs_.reserve(jobs_.size() + tensors.size());  // job references stay valid below
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    jobs_.push_back({});
    job& j = jobs_.back();
    j.ticket = ticket;
    j.path = paths[i];
    j.key = keys.empty() ? paths[i] : keys[i];
    j.tensor = tensors[i];
    busy_paths_.insert(j.path);
    j.out = out;
    j.started = clock::now();
    members.push_back(jobs_.size() - 1);
    if (tensors[i].data == nullptr && tensors[i].bytes != 0) {
      j.error = EINVAL;
      j.message = "null tensor";
    } else {
      // Swap-out writes a new file beside the old one and renames it into place once every
      // byte is written, so the path holds the old contents or the new, never a mix.
      if (out) j.temp_path = j.path + ".tensormem-tmp." + std::to_string(getpid());
      j.fd = open_file(out ? j.temp_path : j.path, out, j.direct);
      if (j.fd < 0) {
        j.error = errno;
        j.message = (out ? "cannot create " : "cannot open ") + (out ? j.temp_path : j.path) + ": " +
                    std::strerror(errno) + (!out && errno == ENOENT ? " (it was never swapped out)" : "");
      } else if (out) {
        start_out(j);
      } else {
        start_in(j);
      }
    }
    jobs_[members.back()].issuing = false;
    if (jobs_[members.back()].requests_left == 0) finish(jobs_[members.back()]);
  }
  return ticket;
}

std::uint64_t tensor_swapper::swap_out(std::span<const tensor_ref> tensors,
                                       std::span<const std::string> paths,
                                       std::span<const std::string> keys) {
  const std::lock_guard lock(mutex_);
  return start(tensors, paths, keys, true);
}

std::uint64_t tensor_swapper::swap_in(std::span<const std::string> paths,
                                      std::span<const tensor_ref> tensors,
                                      std::span<const std::string> keys) {
  const std::lock_guard lock(mutex_);
  return start(tensors, paths, keys, false);
}

void tensor_swapper::drive(std::size_t min_completions) {
  for (const io::io_completion& c : engine_->wait(min_completions)) on_completion(c);
}

void tensor_swapper::on_completion(const io::io_completion& c) {
  const pending_request r = requests_[c.user_data];
  free_requests_.push_back(static_cast<std::size_t>(c.user_data));
  job& j = jobs_[r.job];
  if (c.result < 0) {
    if (j.error == 0) {
      j.error = static_cast<int>(-c.result);
      j.message = std::string(r.write ? "write to " : "read from ") + j.path + " failed: " +
                  std::strerror(j.error);
    }
  } else if (static_cast<std::size_t>(c.result) < r.expected) {
    if (j.error == 0) {
      j.error = EIO;
      j.message = std::string("short ") + (r.write ? "write to " : "read from ") + j.path + ": " +
                  std::to_string(c.result) + " of " + std::to_string(r.expected) + " bytes";
    }
  } else if (r.copy_to != nullptr) {
    std::memcpy(r.copy_to, staging_[r.staging], r.copy_bytes);
  }
  if (r.staging != no_staging) free_staging_.push_back(r.staging);  // its I/O is over
  if (--j.requests_left == 0 && !j.issuing) finish(j);
}

void tensor_swapper::finish(job& j) {
  if (j.fd >= 0) {
    if (close(j.fd) != 0 && j.out && j.error == 0) {
      j.error = errno;
      j.message = "cannot close " + j.temp_path + ": " + std::strerror(errno);
    }
    j.fd = -1;
    if (j.out) {
      // Commit: the complete new file replaces the old one in one step; a failed swap-out
      // leaves the old file (or no file) and removes its partial copy.
      if (j.error == 0 && rename(j.temp_path.c_str(), j.path.c_str()) != 0) {
        j.error = errno;
        j.message = "cannot rename " + j.temp_path + " to " + j.path + ": " + std::strerror(errno);
      }
      if (j.error != 0) unlink(j.temp_path.c_str());
    }
  }
  if (!j.out && j.error == 0 && j.crc_present && options_.checksums) {
    const auto t0 = clock::now();
    const std::uint32_t crc = crc32c(j.tensor.data, j.tensor.bytes);
    timers_["checksum"] += std::chrono::duration<double>(clock::now() - t0).count();
    if (crc != j.crc) {
      j.error = EBADMSG;
      j.message = "checksum mismatch in " + j.path + ": the file is corrupt";
    }
  }
  j.done = true;
  j.finished = clock::now();
}

std::vector<swap_result> tensor_swapper::wait(std::uint64_t ticket) {
  const std::lock_guard lock(mutex_);
  return wait_locked(ticket);
}

std::vector<swap_result> tensor_swapper::wait_locked(std::uint64_t ticket) {
  const auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    throw std::invalid_argument("tensor_swapper: unknown or already waited ticket " +
                                std::to_string(ticket));
  }
  const auto t0 = clock::now();
  for (const std::size_t index : it->second) {
    while (!jobs_[index].done) drive(1);
  }
  const double waited = std::chrono::duration<double>(clock::now() - t0).count();
  stats_.seconds_waiting += waited;
  timers_["wait"] += waited;
  std::vector<swap_result> results;
  clock::time_point first = clock::time_point::max();
  clock::time_point last = clock::time_point::min();
  bool out = true;
  for (const std::size_t index : it->second) {
    first = std::min(first, jobs_[index].started);
    last = std::max(last, jobs_[index].finished);
    out = jobs_[index].out;
  }
  if (!it->second.empty()) {
    (out ? stats_.seconds_out : stats_.seconds_in) += std::chrono::duration<double>(last - first).count();
  }
  for (const std::size_t index : it->second) {
    const job& j = jobs_[index];
    busy_paths_.erase(j.path);
    results.push_back({j.path, j.tensor.bytes, j.error, j.message});
    if (j.error != 0) {
      ++stats_.failed;
    } else if (j.out) {
      ++stats_.tensors_out;
      stats_.bytes_out += j.tensor.bytes;
    } else {
      ++stats_.tensors_in;
      stats_.bytes_in += j.tensor.bytes;
    }
  }
  tickets_.erase(it);
  if (tickets_.empty()) jobs_.clear();  // no job is referenced any more
  return results;
}

void tensor_swapper::synchronize() {
  const std::lock_guard lock(mutex_);
  while (!tickets_.empty()) wait_locked(tickets_.begin()->first);
}

swap_stats tensor_swapper::stats() const {
  const std::lock_guard lock(mutex_);
  return stats_;
}

std::map<std::string, double> tensor_swapper::timers() const {
  const std::lock_guard lock(mutex_);
  return timers_;
}

}  // namespace tensormem::swap
