#include "tensormem/offload/swap_space.hpp"

#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "tensormem/io/path_argument.hpp"

namespace tensormem::offload {

namespace {

constexpr std::uint64_t page = 4096;

std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

bool portable_name(const std::string& name) {
  if (name.empty() || name == "." || name == "..") return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

// Stripe c of a tensor goes to folder (tensor + c) mod N, at (c / N) * stripe in that folder's
// file: consecutive stripes on different devices, small tensors spread over the folders.
template <class F>
void for_each_stripe(std::size_t id, std::uint64_t padded, std::uint64_t stripe, std::size_t folders, F f) {
  for (std::uint64_t c = 0, at = 0; at < padded; ++c, at += stripe) {
    const std::size_t folder = (id + c) % folders;
    f(folder, at, (c / folders) * stripe, std::min(stripe, padded - at));
  }
}

}  // namespace

std::vector<std::uint64_t> detail::stripe_shares(std::size_t id, std::uint64_t padded, std::uint64_t stripe,
                                                 std::size_t folders) {
  std::vector<std::uint64_t> share(folders, 0);
  const std::uint64_t whole = padded / stripe;  // stripes 0 .. whole - 1 are full
  const std::uint64_t n = folders;
  for (std::uint64_t f = 0; f < n; ++f) {
    const std::uint64_t first = (f + n - id % n) % n;  // the first stripe c with (id + c) mod n = f
    if (first < whole) share[f] = ((whole - 1 - first) / n + 1) * stripe;
  }
  if (const std::uint64_t rest = padded % stripe; rest != 0) share[(id + whole) % n] += rest;
  return share;
}

namespace {

// The space's files are its own: a symbolic link where one of them goes is refused, never
// followed to a file elsewhere.
io::file_io_options own_files(io::file_io_options options) {
  options.follow_links = false;
  return options;
}

}  // namespace

swap_space::swap_space(swap_space_options options)
    : options_(std::move(options)), io_(own_files(options_.io)) {
  if (options_.folders.empty()) throw std::invalid_argument("swap_space: no folders");
  if (options_.stripe_bytes == 0 || options_.stripe_bytes % page != 0) {
    throw std::invalid_argument("swap_space: stripe_bytes must be a positive multiple of 4096, not " +
                                std::to_string(options_.stripe_bytes));
  }
  if (!options_.capacity_bytes.empty() && options_.capacity_bytes.size() != options_.folders.size()) {
    throw std::invalid_argument("swap_space: " + std::to_string(options_.capacity_bytes.size()) +
                                " capacities for " + std::to_string(options_.folders.size()) + " folders");
  }
  for (const std::string& folder : options_.folders) {
    io::check_path_argument("swap_space: folder", folder);
    std::error_code ec;
    if (const auto status = std::filesystem::status(folder, ec); !std::filesystem::is_directory(status)) {
      // (ENOTDIR where something else is there, ENOENT where nothing is, or the cause of a
      // failed look, EACCES or ELOOP.)
      const bool other = std::filesystem::exists(status);
      const int e = other ? ENOTDIR : ec && ec != std::errc::no_such_file_or_directory ? ec.value() : ENOENT;
      throw std::system_error(e, std::generic_category(), "swap folder " + folder);
    }
    std::filesystem::path dir = std::filesystem::path(folder) / ("rank" + std::to_string(options_.rank));
    if (std::find(dirs_.begin(), dirs_.end(), dir) != dirs_.end()) {
      throw std::invalid_argument("swap_space: folder " + folder + " is listed twice");
    }
    std::filesystem::create_directory(dir, ec);  // kept afterwards: other spaces may share it
    if (ec) throw std::system_error(ec, "cannot create " + dir.string());
    dirs_.push_back(std::move(dir));
  }
  reserved_.assign(dirs_.size(), 0);
}

swap_space::~swap_space() {
  // In a forked child the files are the parent's, and so are the transfers: none is waited
  // for and no file is removed.
  if (made_.forked()) return;
  io_.wait();
  if (!options_.remove_files) return;
  std::error_code ec;
  for (std::size_t id = 0; id < entries_->size(); ++id) {
    for (unsigned slot = 0; slot < 2; ++slot) {
      for (std::size_t f = 0; f < dirs_.size(); ++f) std::filesystem::remove(path(id, slot, f), ec);
    }
  }
}

std::string swap_space::path(std::size_t id, unsigned slot, std::size_t folder) const {
  made_.require_same_process(who);
  std::string name;
  {
    const std::lock_guard lock(mutex_);
    name = at(id).name;
  }
  return file_path(name, slot, folder);
}

std::string swap_space::file_path(const std::string& name, unsigned slot, std::size_t folder) const {
  return (dirs_.at(folder) / (name + ".g" + std::to_string(slot))).string();
}

// Queues every stripe of a transfer. When queuing a stripe fails (the file cannot be opened,
// or memory runs out), the stripes already queued are waited for before the error is thrown:
// none is left running on a buffer the caller may free (nor uncollected). The tickets' room
// is made first, so that a stripe once queued is never lost to a failing push_back.
void swap_space::queue_stripes(transfer& t, std::byte* buffer, std::uint64_t padded, const std::string& name) {
  std::size_t stripes = 0;
  for_each_stripe(t.tensor, padded, options_.stripe_bytes, dirs_.size(),
                  [&](std::size_t, std::uint64_t, std::uint64_t, std::uint64_t) { ++stripes; });
  t.tickets.reserve(stripes);
  const auto end_queued = [&] {
    for (const std::uint64_t ticket : t.tickets) {
      try {
        io_.wait_for(ticket);  // (once it returns or throws, the stripe's I/O has ended)
      } catch (const std::bad_alloc&) {  // its error's message: the failure reported is the first
      }
    }
    t.tickets.clear();
  };
  try {
    for_each_stripe(t.tensor, padded, options_.stripe_bytes, dirs_.size(),
                    [&](std::size_t f, std::uint64_t at, std::uint64_t file_offset, std::uint64_t n) {
                      const std::string file = file_path(name, t.slot, f);
                      t.tickets.push_back(t.write ? io_.write(buffer + at, n, file, file_offset)
                                                  : io_.read(buffer + at, n, file, file_offset));
                    });
  } catch (const std::system_error& e) {
    end_queued();
    throw offload_error("swap " + std::string(t.write ? "write" : "read") + " of tensor " + name +
                            " failed: " + e.what(),
                        name, {}, e.code().value());
  } catch (...) {  // std::bad_alloc
    end_queued();
    throw;
  }
}

const swap_space::entry& swap_space::at(std::size_t id) const {
  if (id >= entries_->size()) throw std::out_of_range("swap_space: unknown tensor " + std::to_string(id));
  return (*entries_)[id];
}

std::size_t swap_space::add(const std::string& name, std::uint64_t bytes) {
  made_.require_same_process(who);
  if (!portable_name(name)) {
    throw std::invalid_argument("swap_space: tensor name '" + name + "' must be letters, digits, '.', '_' or '-'");
  }
  if (bytes > (std::uint64_t{1} << 62)) {
    throw std::invalid_argument("swap_space: tensor " + name + " of " + std::to_string(bytes) + " bytes is too large");
  }
  const std::lock_guard lock(mutex_);
  for (const entry& e : *entries_) {
    if (e.name == name) throw std::invalid_argument("swap_space: tensor " + name + " is already registered");
  }
  // Another space (or an earlier run that was killed) using these files would be clobbered.
  for (unsigned slot = 0; slot < 2; ++slot) {
    for (std::size_t f = 0; f < dirs_.size(); ++f) {
      const std::string file = file_path(name, slot, f);
      if (const auto mode = io::mode_at(file)) {  // a link counts, dangling or not
        throw offload_error("swap file " + file + " already exists (" + io::kind_of_file(*mode) +
                                "): another swap space uses the name " + name +
                                " in this folder, or an earlier run left it (remove it)",
                            name, file, EEXIST);
      }
    }
  }
  entry e;
  e.name = name;
  e.bytes = bytes;
  e.padded = round_up(bytes, page);
  const std::size_t id = entries_->size();
  e.folder_share = detail::stripe_shares(id, e.padded, options_.stripe_bytes, dirs_.size());
  for (std::size_t f = 0; f < dirs_.size(); ++f) {
    const std::uint64_t cap = options_.capacity_bytes.empty() ? 0 : options_.capacity_bytes[f];
    // (2 x a share is at most 2^63; what is left of the capacity is compared, never a sum.)
    if (cap != 0 && 2 * e.folder_share[f] > cap - std::min(cap, reserved_[f])) {
      throw offload_error("swap folder " + options_.folders[f] + " is full: tensor " + name + " needs " +
                              std::to_string(2 * e.folder_share[f]) + " bytes (two generations), " +
                              std::to_string(cap - std::min(cap, reserved_[f])) + " of its capacity " +
                              std::to_string(cap) + " are left",
                          name, dirs_[f].string(), ENOSPC);
    }
  }
  entries_->push_back(std::move(e));  // first: a failure here must not leave its share reserved
  for (std::size_t f = 0; f < dirs_.size(); ++f) reserved_[f] += 2 * entries_->back().folder_share[f];
  return id;
}

std::size_t swap_space::size() const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return entries_->size();
}
const std::string& swap_space::name(std::size_t id) const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return at(id).name;
}
std::uint64_t swap_space::bytes(std::size_t id) const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return at(id).bytes;
}
std::uint64_t swap_space::padded_bytes(std::size_t id) const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return at(id).padded;
}
bool swap_space::committed(std::size_t id) const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return at(id).committed >= 0;
}

void swap_space::check_free_space(const entry& e, unsigned slot) const {
  for (std::size_t f = 0; f < dirs_.size(); ++f) {
    if (e.folder_share[f] == 0) continue;
    struct statvfs st {};
    if (::statvfs(dirs_[f].c_str(), &st) != 0) {
      const int err = errno;
      throw offload_error("cannot query the free space of " + dirs_[f].string() + ": " +
                              std::generic_category().message(err),
                          e.name, dirs_[f].string(), err);
    }
    const std::uint64_t free_bytes = static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
    if (free_bytes < e.folder_share[f]) {
      throw offload_error("swap folder " + options_.folders[f] + " is full: writing tensor " + e.name + " needs " +
                              std::to_string(e.folder_share[f]) + " bytes there, " + std::to_string(free_bytes) +
                              " are free",
                          e.name, file_path(e.name, slot, f), ENOSPC);
    }
  }
}

// Picks the generation (reads: the committed one; writes: the other, its folders' free
// space checked when its files are new) and queues the stripes.
swap_space::transfer swap_space::start(std::size_t id, std::byte* buffer, bool write) {
  made_.require_same_process(who);
  if (reinterpret_cast<std::uintptr_t>(buffer) % page != 0) {
    throw std::invalid_argument("swap_space: buffers must be 4096-aligned");
  }
  transfer t;
  std::uint64_t padded = 0;
  std::string name;
  {
    const std::lock_guard lock(mutex_);
    const entry& e = at(id);
    if (write) {
      t = {id, true, e.committed == 0 ? 1U : 0U, {}};
      if (!e.created[t.slot]) check_free_space(e, t.slot);
      ++writes_started_;  // counted before any stripe is queued: a failed write counts too
    } else {
      if (e.committed < 0) {
        throw offload_error("swap_space: tensor " + e.name + " has no committed generation to read", e.name);
      }
      t = {id, false, static_cast<unsigned>(e.committed), {}};
    }
    padded = e.padded;
    name = e.name;
  }
  queue_stripes(t, buffer, padded, name);
  return t;
}

swap_space::transfer swap_space::read(std::size_t id, void* buffer) {
  return start(id, static_cast<std::byte*>(buffer), false);
}

swap_space::transfer swap_space::write(std::size_t id, const void* buffer) {
  // The engines never write into a write's buffer.
  return start(id, const_cast<std::byte*>(static_cast<const std::byte*>(buffer)), true);
}

void swap_space::finish(transfer& t) {
  made_.require_same_process(who);
  io::file_io_error first;
  for (const std::uint64_t ticket : t.tickets) {
    io::file_io_error e = io_.wait_for(ticket);
    if (e.error != 0 && first.error == 0) first = std::move(e);
  }
  t.tickets.clear();
  const std::lock_guard lock(mutex_);
  entry& e = entries_->at(t.tensor);
  if (first.error != 0) {
    throw offload_error("swap " + std::string(t.write ? "write" : "read") + " of tensor " + e.name +
                            " failed: " + first.message,
                        e.name, first.path, first.error);
  }
  if (t.write) {
    e.created[t.slot] = true;
    e.written = static_cast<int>(t.slot);
    bytes_written_ += e.padded;
    ++writes_;
  } else {
    bytes_read_ += e.padded;
    ++reads_;
  }
}

void swap_space::commit(std::size_t id) {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  entry& e = entries_->at(id);
  if (e.written < 0) throw std::logic_error("swap_space: tensor " + e.name + " has no finished write to commit");
  e.committed = e.written;
  e.written = -1;
}

std::uint64_t swap_space::writes_started() const {
  made_.require_same_process(who);
  const std::lock_guard lock(mutex_);
  return writes_started_;
}

swap_space_stats swap_space::stats() const {
  made_.require_same_process(who);
  swap_space_stats s;
  s.io = io_.stats();
  const std::lock_guard lock(mutex_);
  s.bytes_read = bytes_read_;
  s.bytes_written = bytes_written_;
  s.reads = reads_;
  s.writes = writes_;
  s.folder_bytes.assign(dirs_.size(), 0);
  for (const entry& e : *entries_) {
    for (std::size_t f = 0; f < dirs_.size(); ++f) {
      s.folder_bytes[f] += e.folder_share[f] * ((e.created[0] ? 1U : 0U) + (e.created[1] ? 1U : 0U));
    }
  }
  return s;
}

}  // namespace tensormem::offload
