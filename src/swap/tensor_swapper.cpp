#include "tensormem/swap/tensor_swapper.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "tensormem/swap/crc32c.hpp"

namespace tensormem::swap {

namespace {

constexpr std::size_t header_bytes = 4096;
constexpr std::size_t io_alignment = 4096;
constexpr char magic[8] = {'T', 'M', 'S', 'W', 'A', 'P', '0', '1'};
constexpr std::size_t no_staging = static_cast<std::size_t>(-1);

struct file_header {
  char magic[8];
  std::uint64_t bytes;
  std::uint32_t crc;
  std::uint32_t flags;  // bit 0: crc present
};

std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

bool aligned(const void* p, std::size_t n) {
  return reinterpret_cast<std::uintptr_t>(p) % io_alignment == 0 && n % io_alignment == 0;
}

}  // namespace

struct tensor_swapper::job {
  std::uint64_t ticket = 0;
  std::string path;
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
  const int base = out ? O_WRONLY | O_CREAT : O_RDONLY;
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
  std::memset(staging_[h], 0, header_bytes);
  file_header header{};
  std::memcpy(header.magic, magic, sizeof magic);
  header.bytes = j.tensor.bytes;
  header.crc = j.crc;
  header.flags = j.crc_present ? 1U : 0U;
  std::memcpy(staging_[h], &header, sizeof header);
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
  file_header header{};
  if (got == static_cast<ssize_t>(header_bytes)) std::memcpy(&header, staging_[h], sizeof header);
  free_staging_.push_back(h);
  if (got != static_cast<ssize_t>(header_bytes) || std::memcmp(header.magic, magic, sizeof magic) != 0) {
    j.error = got < 0 ? errno : EINVAL;
    j.message = j.path + " is not a tensormem swap file (or was never written completely)";
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
                                    std::span<const std::string> paths, bool out) {
  if (tensors.size() != paths.size()) {
    throw std::invalid_argument("tensor_swapper: " + std::to_string(tensors.size()) +
                                " tensors for " + std::to_string(paths.size()) + " paths");
  }
  const std::uint64_t ticket = next_ticket_++;
  auto& members = tickets_[ticket];
  jobs_.reserve(jobs_.size() + tensors.size());  // job references stay valid below
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    jobs_.push_back({});
    job& j = jobs_.back();
    j.ticket = ticket;
    j.path = paths[i];
    j.tensor = tensors[i];
    j.out = out;
    j.started = clock::now();
    members.push_back(jobs_.size() - 1);
    if (tensors[i].data == nullptr && tensors[i].bytes != 0) {
      j.error = EINVAL;
      j.message = "null tensor";
    } else {
      j.fd = open_file(j.path, out, j.direct);
      if (j.fd < 0) {
        j.error = errno;
        j.message = (out ? "cannot create " : "cannot open ") + j.path + ": " + std::strerror(errno) +
                    (!out && errno == ENOENT ? " (it was never swapped out)" : "");
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
                                       std::span<const std::string> paths) {
  return start(tensors, paths, true);
}

std::uint64_t tensor_swapper::swap_in(std::span<const std::string> paths,
                                      std::span<const tensor_ref> tensors) {
  return start(tensors, paths, false);
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
    if (j.out && j.error == 0) {
      // Cut the file to this tensor's length: a smaller tensor leaves no old tail behind.
      const auto length = static_cast<off_t>(header_bytes + round_up(j.tensor.bytes, io_alignment));
      if (ftruncate(j.fd, length) != 0) {
        j.error = errno;
        j.message = "cannot set the length of " + j.path + ": " + std::strerror(errno);
      }
    }
    close(j.fd);
    j.fd = -1;
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
  while (!tickets_.empty()) wait(tickets_.begin()->first);
}

}  // namespace tensormem::swap
