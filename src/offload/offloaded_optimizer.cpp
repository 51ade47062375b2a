#include "tensormem/offload/offloaded_optimizer.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <new>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "tensormem/io/detail/blocking.hpp"
#include "tensormem/io/file_io.hpp"
#include "tensormem/io/path_argument.hpp"
#include "tensormem/memory/errors.hpp"
#include "tensormem/swap/crc32c.hpp"

namespace tensormem::offload {

namespace {

constexpr std::uint64_t page_floats = 1024;  // 4096 bytes
constexpr char checkpoint_magic[8] = {'T', 'M', 'O', 'P', 'T', 'C', 'K', '1'};
// Version 2 ends with the caller's note and a tail: note bytes, CRC-32C of everything before
// the tail (header, records, note), 8 bytes of end marker. Version 1 had neither.
constexpr std::uint64_t checkpoint_version = 2;
constexpr char checkpoint_end[8] = {'T', 'M', 'O', 'P', 'T', 'E', 'N', 'D'};
constexpr std::uint64_t tail_bytes = 24;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// A file descriptor closed on every path.
struct file {
  int fd = -1;
  std::string path;
  // A checkpoint to read is a regular file only (anything else is refused, EINVAL, or EISDIR
  // for a folder). The open never waits (O_NONBLOCK, cleared once open): a pipe there is
  // refused, not a wait for its other end. `what` begins the message of a failed open
  // (default: "cannot open checkpoint PATH").
  file(const std::string& p, int flags, const std::string& what = {}) : path(p) {
    const char* refused = nullptr;
    fd = io::keep_opened_file(::open(p.c_str(), flags | O_CLOEXEC | O_NONBLOCK, 0600), p.c_str(), refused);
    if (fd < 0) {
      const int e = errno;
      const std::string why = refused == nullptr ? "" : std::string(": it is ") + refused + ", not a regular file";
      throw std::system_error(e, std::generic_category(), (what.empty() ? "cannot open checkpoint " + p : what) + why);
    }
  }
  // A file opened already (the temporary file a save makes; its path is set after: a copy
  // of the name can fail).
  explicit file(int opened) noexcept : fd(opened) {}
  ~file() {
    if (fd >= 0) ::close(fd);
  }
  file(const file&) = delete;
  file& operator=(const file&) = delete;
  void write_all(const void* data, std::size_t bytes, std::uint64_t offset) const {
    const io::detail::transferred done = io::detail::pwrite_fully(fd, data, bytes, offset);
    if (done.bytes < bytes) {
      throw std::system_error(done.error != 0 ? done.error : EIO, std::generic_category(),
                              "cannot write checkpoint " + path);
    }
  }
  void read_all(void* data, std::size_t bytes, std::uint64_t offset) const {
    const io::detail::transferred done = io::detail::pread_fully(fd, data, bytes, offset);
    if (done.error != 0) throw std::system_error(done.error, std::generic_category(), "cannot read checkpoint " + path);
    if (done.bytes < bytes) throw std::runtime_error("checkpoint " + path + " is truncated");
  }
};

// The checkpoint header: magic, then u64 fields, then per parameter (numel, step).
std::vector<std::uint64_t> header_words(const offloaded_optimizer& o) {
  std::vector<std::uint64_t> w = {checkpoint_version,
                                  static_cast<std::uint64_t>(o.options().kind),
                                  o.options().offload_master ? 1U : 0U,
                                  o.fields().size(),
                                  o.numels().size(),
                                  o.groups().empty() ? 0 : o.groups().front().elements,
                                  o.groups().size()};
  for (std::size_t i = 0; i < o.numels().size(); ++i) {
    w.push_back(o.numels()[i]);
    w.push_back(o.steps()[i]);
  }
  return w;
}

std::uint64_t header_bytes(std::size_t params) { return round_up(8 + 8 * (7 + 2 * params), 4096); }

}  // namespace

offloaded_optimizer::offloaded_optimizer(std::vector<std::uint64_t> numels, optimizer_options options)
    : numels_(std::move(numels)), options_(std::move(options)), steps_(numels_.size(), 0) {
  if (options_.simd < 0) {
    simd_ = best_simd_level();
  } else {
    simd_ = static_cast<simd_level>(options_.simd);
    if (options_.simd > static_cast<int>(simd_level::avx512) || !simd_supported(simd_)) {
      throw std::invalid_argument("offloaded_optimizer: simd level " + std::to_string(options_.simd) +
                                  " is not supported by this processor");
    }
  }
  if (options_.name.empty()) {
    static std::atomic<std::uint64_t> counter{0};
    options_.name = "opt-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  }
  if (options_.offload_master) fields_.push_back("master");
  if (options_.kind == optimizer_kind::sgd) {
    fields_.push_back("momentum_buffer");
  } else {
    fields_.push_back("exp_avg");
    fields_.push_back("exp_avg_sq");
  }
  if (options_.group_bytes < 4096) {
    throw std::invalid_argument("offloaded_optimizer: group_bytes must be at least 4096, not " +
                                std::to_string(options_.group_bytes));
  }
  const std::uint64_t group_elements = round_up(options_.group_bytes / 4, page_floats);
  // Parameters laid end to end, cut into groups of group_elements.
  for (std::size_t p = 0; p < numels_.size(); ++p) {
    for (std::uint64_t at = 0; at < numels_[p];) {
      if (groups_.empty() || groups_.back().elements == group_elements) {
        groups_.push_back({groups_.size(), 0, 0, 0, {}});
      }
      group& g = groups_.back();
      const std::uint64_t n = std::min(numels_[p] - at, group_elements - g.elements);
      g.pieces.push_back({p, at, n, g.elements});
      g.elements += n;
      at += n;
    }
  }
  std::uint64_t largest = 0;
  for (group& g : groups_) {
    g.stride = round_up(g.elements, page_floats);
    largest = std::max(largest, record_bytes(g));
  }
  // Checked before the swap space exists: a refused optimizer leaves no folder behind.
  if (options_.pipeline.pinned_budget / std::max<std::uint64_t>(largest, 4096) < 2) {
    throw std::invalid_argument("offloaded_optimizer: a pinned budget of " +
                                std::to_string(options_.pipeline.pinned_budget) + " bytes holds fewer than two " +
                                "sub-group records of " + std::to_string(largest) + " bytes; lower group_bytes");
  }
  memory::pool_options pool;
  pool.alignment = 4096;
  pool.slab_bytes = std::max<std::uint64_t>(largest, 4096);
  pool.max_locked_bytes = options_.pipeline.pinned_budget;
  pool.allow_unlocked_fallback = options_.allow_unlocked_fallback;
  pool_ = std::make_unique<memory::pinned_pool>(pool);
  space_ = std::make_unique<swap_space>(options_.swap);
  for (group& g : groups_) {
    g.tensor = space_->add(options_.name + ".group" + std::to_string(g.index), record_bytes(g));
  }
}

namespace {
std::string not_undone_message(const std::exception& step_error, const std::exception& restore_error,
                               const std::vector<std::size_t>& parameters) {
  std::string listed;
  for (const std::size_t i : parameters) listed += (listed.empty() ? "" : ", ") + std::to_string(i);
  return std::string(step_error.what()) + "; the step could not be undone (putting the parameters back from the " +
         "master copy failed: " + restore_error.what() + "), so parameters " + listed +
         " may hold this step's values; the state on disk and the step counts are the previous step's, and "
         "restore_parameters copies its master copy into the parameters";
}

// The tensor, file and errno of a step's error: an offload_error's own, ENOMEM for
// std::bad_alloc, else none.
offload_error as_offload_error(const std::exception& e) {
  if (const auto* o = dynamic_cast<const offload_error*>(&e)) return *o;
  return {e.what(), {}, {}, dynamic_cast<const std::bad_alloc*>(&e) != nullptr ? ENOMEM : 0};
}
}  // namespace

step_not_undone::step_not_undone(const std::exception& step_error, const std::exception& restore_error,
                                 std::vector<std::size_t> parameters)
    : step_not_undone(as_offload_error(step_error), not_undone_message(step_error, restore_error, parameters),
                      std::move(parameters)) {}

step_not_undone::step_not_undone(const offload_error& step_error, const std::string& message,
                                 std::vector<std::size_t>&& parameters)
    : offload_error(message, step_error.tensor(), step_error.path(), step_error.error()),
      parameters_(std::move(parameters)) {}

offloaded_optimizer::~offloaded_optimizer() = default;

offloaded_optimizer::exclusive_call::exclusive_call(const offloaded_optimizer& o, const char* what) : o_(o) {
  o.made_.require_same_process(who);
  if (o.called_from_this_thread()) {
    throw std::logic_error(std::string("offloaded_optimizer::") + what +
                           " called from inside the callback of visit or rewrite on the same optimizer: it would "
                           "change the records being streamed; call it after visit or rewrite returns");
  }
  o.calls_.lock();
  o.caller_.store(std::this_thread::get_id());
}

offloaded_optimizer::exclusive_call::~exclusive_call() {
  o_.caller_.store(std::thread::id{});
  o_.calls_.unlock();
}

std::vector<std::uint64_t> offloaded_optimizer::steps() const {
  made_.require_same_process(who);
  if (called_from_this_thread()) return steps_;
  const std::lock_guard lock(calls_);
  return steps_;
}

bool offloaded_optimizer::initialized() const {
  made_.require_same_process(who);
  if (called_from_this_thread()) return initialized_;
  const std::lock_guard lock(calls_);
  return initialized_;
}

std::uint64_t offloaded_optimizer::record_bytes(const group& g) const { return fields_.size() * g.stride * 4; }

std::vector<std::size_t> offloaded_optimizer::order() const {
  std::vector<std::size_t> o;
  o.reserve(groups_.size());
  for (const group& g : groups_) o.push_back(g.tensor);
  return o;
}

void offloaded_optimizer::commit_all(const std::vector<std::size_t>& tensors) {
  for (const std::size_t t : tensors) space_->commit(t);
}

// Fills every record with `fill` and writes it, as many buffers in rotation as the budget
// holds (at least two, checked at construction); commits when all writes succeeded.
namespace {
template <class Fill>
void write_every_record(const std::vector<offloaded_optimizer::group>& groups, swap_space& space,
                        memory::pinned_pool& pool, std::uint64_t largest_bytes, std::uint64_t budget, Fill fill,
                        bool commit = true) {
  const std::size_t bytes = std::max<std::uint64_t>(largest_bytes, 4096);
  const std::size_t count = static_cast<std::size_t>(std::clamp<std::uint64_t>(budget / bytes, 1, groups.size()));
  std::vector<std::byte*> buffers;
  std::vector<swap_space::transfer> pending(count);
  const auto release = [&] {
    for (auto& t : pending) {
      try {
        if (!t.tickets.empty()) space.finish(t);
      } catch (const std::exception&) {  // already failing
      }
    }
    for (std::byte* b : buffers) pool.free(b);
  };
  buffers.reserve(count);  // a buffer taken is never lost to a failing push_back
  try {
    for (std::size_t i = 0; i < count; ++i) buffers.push_back(static_cast<std::byte*>(pool.allocate(bytes, 4096)));
    for (const auto& g : groups) {
      const std::size_t k = g.index % count;
      if (!pending[k].tickets.empty()) space.finish(pending[k]);
      fill(g, reinterpret_cast<float*>(buffers[k]));
      pending[k] = space.write(g.tensor, buffers[k]);
    }
    for (auto& t : pending) {
      if (!t.tickets.empty()) space.finish(t);
    }
  } catch (...) {
    release();
    throw;
  }
  release();
  if (!commit) return;
  for (const auto& g : groups) space.commit(g.tensor);
}
}  // namespace

void offloaded_optimizer::initialize(std::span<const float* const> params) {
  const exclusive_call call(*this, "initialize");
  if (params.size() != numels_.size()) {
    throw std::invalid_argument("offloaded_optimizer::initialize: " + std::to_string(params.size()) +
                                " parameters, expected " + std::to_string(numels_.size()));
  }
  std::uint64_t largest = 0;
  for (const group& g : groups_) largest = std::max(largest, record_bytes(g));
  try {
    write_every_record(groups_, *space_, *pool_, largest, options_.pipeline.pinned_budget,
                       [&](const group& g, float* record) {
      std::memset(record, 0, record_bytes(g));
      if (!options_.offload_master) return;
      for (const piece& p : g.pieces) {
        std::memcpy(record + p.group_offset, params[p.param] + p.param_offset, p.count * 4);
      }
    });
  } catch (const memory::lock_limit_error& e) {
    // The first locked buffers (refused only where the unlocked fallback is off): say which
    // options size them or allow it, in the optimizer's words.
    throw e.without_fallback(". The offloaded optimizer locks at least two records of its largest group (" +
                             std::to_string(largest) + " bytes each, within a pinned budget of " +
                             std::to_string(options_.pipeline.pinned_budget) +
                             " bytes): a smaller group_bytes makes them smaller, or allow_unlocked_fallback "
                             "(Python: allow_unlocked=True) uses unlocked memory");
  }
  std::fill(steps_.begin(), steps_.end(), 0);
  initialized_ = true;
}

void offloaded_optimizer::update_group(const group& g, float* record, std::span<float* const> params,
                                       std::span<const float* const> grads, std::span<const param_hyper> hyper,
                                       bool& dirty) const {
  float* master = options_.offload_master ? record : nullptr;
  float* state = record + (options_.offload_master ? g.stride : 0);
  for (const piece& p : g.pieces) {
    if (grads[p.param] == nullptr) continue;
    dirty = true;
    const param_hyper& h = hyper[p.param];
    const std::uint64_t step = steps_[p.param] + 1;
    float* param = params[p.param] + p.param_offset;
    const float* grad = grads[p.param] + p.param_offset;
    float* mp = master != nullptr ? master + p.group_offset : nullptr;
    if (options_.kind == optimizer_kind::sgd) {
      sgd_update(param, grad, mp, state + p.group_offset, p.count,
                 make_sgd_scalars(h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov, step), simd_);
    } else {
      adam_update(param, grad, mp, state + p.group_offset, state + g.stride + p.group_offset, p.count,
                  make_adam_scalars(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
                                    options_.kind == optimizer_kind::adamw, step, options_.arithmetic),
                  simd_);
    }
  }
}

step_stats offloaded_optimizer::step(std::span<float* const> params, std::span<const float* const> grads,
                                     std::span<const param_hyper> hyper, const std::function<bool()>& stop) {
  const exclusive_call call(*this, "step");
  if (!initialized_) throw std::logic_error("offloaded_optimizer::step before initialize or load");
  if (params.size() != numels_.size() || grads.size() != numels_.size() || hyper.size() != numels_.size()) {
    throw std::invalid_argument("offloaded_optimizer::step: " + std::to_string(params.size()) + " parameters, " +
                                std::to_string(grads.size()) + " gradients, " + std::to_string(hyper.size()) +
                                " hyperparameter sets; expected " + std::to_string(numels_.size()) + " of each");
  }
  check_not_null(params, "step");
  step_stats st;
  const double start = now_seconds();
  std::vector<std::size_t> updated;  // groups whose parameters changed in memory
  // Its room first: a group whose parameters have changed must be in it, or a failure after
  // the change (std::bad_alloc in the push_back) would leave them changed.
  updated.reserve(groups_.size());
  // And the list of parameters a step that cannot be undone names (no allocation there).
  std::vector<std::size_t> changed;
  changed.reserve(numels_.size());
  std::vector<std::size_t> written;
  pipeline_stats ps;
  try {
    prefetch_pipeline pipe(*space_, *pool_, order(), options_.pipeline);
    for (const group& g : groups_) {
      if (stop && (options_.offload_master || updated.empty()) && stop()) {
        throw step_interrupted("offloaded_optimizer::step: interrupted before group " + std::to_string(g.index) +
                               " of " + std::to_string(groups_.size()) + "; the step was undone");
      }
      auto* record = reinterpret_cast<float*>(pipe.acquire(g.index));
      const double t0 = now_seconds();
      bool dirty = false;
      update_group(g, record, params, grads, hyper, dirty);
      st.compute_seconds += now_seconds() - t0;
      if (dirty) updated.push_back(g.index);
      pipe.release(g.index, dirty);
    }
    pipe.finish();
    written = pipe.written();
    ps = pipe.stats();
  } catch (const std::exception& e) {
    if (options_.offload_master && !updated.empty()) {
      try {
        roll_back(updated, params);
      } catch (const std::exception& r) {
        for (const std::size_t g : updated) {
          for (const piece& p : groups_[g].pieces) {
            if (grads[p.param] != nullptr) changed.push_back(p.param);
          }
        }
        std::sort(changed.begin(), changed.end());
        changed.erase(std::unique(changed.begin(), changed.end()), changed.end());
        throw step_not_undone(e, r, std::move(changed));
      }
    }
    throw;
  }
  commit_all(written);
  for (std::size_t i = 0; i < numels_.size(); ++i) {
    if (grads[i] != nullptr) {
      ++steps_[i];
      st.elements += numels_[i];
    }
  }
  st.seconds = now_seconds() - start;
  st.io_wait_seconds = ps.acquire_wait_seconds + ps.finish_wait_seconds;
  st.overlap_ratio = st.seconds > 0 ? 1 - st.io_wait_seconds / st.seconds : 1;
  st.bytes_read = ps.bytes_read;
  st.bytes_written = ps.bytes_written;
  st.pinned_bytes = ps.pinned_bytes;
  const memory::pool_stats pool = pool_->stats();
  st.pinned_high_water = pool.peak_in_use_bytes;
  st.unlocked_slabs = pool.unlocked_fallbacks;
  st.groups = groups_.size();
  st.collector_thread = ps.collector_thread;
  return st;
}

void offloaded_optimizer::check_not_null(std::span<float* const> params, const char* what) const {
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i] == nullptr && numels_[i] != 0) {
      throw std::invalid_argument(std::string("offloaded_optimizer::") + what + ": parameter " + std::to_string(i) +
                                  " is null");
    }
  }
}

void offloaded_optimizer::restore_parameters(std::span<float* const> params) {
  const exclusive_call call(*this, "restore_parameters");
  if (!initialized_) throw std::logic_error("offloaded_optimizer::restore_parameters before initialize or load");
  if (!options_.offload_master) {
    throw std::logic_error("offloaded_optimizer::restore_parameters: the master copy is not offloaded "
                           "(offload_master false), so there is none to restore from");
  }
  if (params.size() != numels_.size()) {
    throw std::invalid_argument("offloaded_optimizer::restore_parameters: " + std::to_string(params.size()) +
                                " parameters, expected " + std::to_string(numels_.size()));
  }
  check_not_null(params, "restore_parameters");
  std::vector<std::size_t> all(groups_.size());
  for (std::size_t g = 0; g < all.size(); ++g) all[g] = g;
  roll_back(all, params);
}

// The parameters of `groups` go back to the committed master copy (the previous step's).
void offloaded_optimizer::roll_back(const std::vector<std::size_t>& groups, std::span<float* const> params) {
  std::vector<std::size_t> tensors;
  for (const std::size_t g : groups) tensors.push_back(groups_[g].tensor);
  prefetch_pipeline pipe(*space_, *pool_, tensors, options_.pipeline);
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const group& g = groups_[groups[i]];
    const auto* master = reinterpret_cast<const float*>(pipe.acquire(i));
    for (const piece& p : g.pieces) {
      std::memcpy(params[p.param] + p.param_offset, master + p.group_offset, p.count * 4);
    }
    pipe.release(i, false);
  }
}

void offloaded_optimizer::visit(const std::function<void(const group&, const float* record)>& f) {
  const exclusive_call call(*this, "visit");
  visit_records(f);
}

void offloaded_optimizer::visit_records(const std::function<void(const group&, const float* record)>& f) {
  if (!initialized_) throw std::logic_error("offloaded_optimizer: no state before initialize or load");
  prefetch_pipeline pipe(*space_, *pool_, order(), options_.pipeline);
  for (const group& g : groups_) {
    f(g, reinterpret_cast<const float*>(pipe.acquire(g.index)));
    pipe.release(g.index, false);
  }
}

void offloaded_optimizer::rewrite(const std::function<void(const group&, float* record)>& edit,
                                  std::vector<std::uint64_t> steps) {
  const exclusive_call call(*this, "rewrite");
  if (!initialized_) throw std::logic_error("offloaded_optimizer: no state before initialize or load");
  if (!steps.empty() && steps.size() != numels_.size()) {
    throw std::invalid_argument("offloaded_optimizer::rewrite: " + std::to_string(steps.size()) +
                                " step counts for " + std::to_string(numels_.size()) + " parameters");
  }
  std::vector<std::size_t> written;
  {
    prefetch_pipeline pipe(*space_, *pool_, order(), options_.pipeline);
    for (const group& g : groups_) {
      edit(g, reinterpret_cast<float*>(pipe.acquire(g.index)));
      pipe.release(g.index, true);
    }
    pipe.finish();
    written = pipe.written();
  }
  commit_all(written);
  if (!steps.empty()) steps_ = std::move(steps);
}

namespace {

// What a save renames onto `path` replaces what is there: only a regular file (or a symbolic
// link, itself replaced) may be. A device node (/dev/null, as root), a pipe, a socket or a
// folder there is refused before anything is written.
void check_replaceable(const std::string& path) {
  const auto there = io::not_a_file_at(path, /*link_allowed=*/true);
  if (!there) return;
  throw std::system_error(there->error, std::generic_category(),
                          "cannot save checkpoint " + path + ": it is " + there->kind +
                              "; a checkpoint replaces only a regular file");
}

// After a failed save: the save's temporary file is removed where it is still a regular
// file (anything put there since is not the save's to remove).
void remove_temporary(const std::string& tmp) noexcept {
  if (const auto mode = io::mode_at(tmp); mode && S_ISREG(*mode)) ::unlink(tmp.c_str());
}

}  // namespace

void offloaded_optimizer::save(const std::string& path, std::string_view note) {
  const exclusive_call call(*this, "save");
  io::check_path_argument("offloaded_optimizer::save", path);
  check_replaceable(path);
  const std::string folder = io::folder_of(path);  // (named now: nothing may fail after the rename)
  // A new file under a name no file has (O_EXCL): nothing already beside the checkpoint (a
  // user's file, a link, another process's save to the same path) is opened or changed.
  // Where the file system can, the file has no name until it is whole: a process killed while
  // saving leaves nothing.
  std::string tmp;
  const int fd = io::create_temporary_beside(path, tmp, 0600);
  if (fd < 0) {
    throw std::system_error(errno, std::generic_category(),
                            "cannot save checkpoint " + path + ": cannot create its temporary file " + tmp);
  }
  file out(fd);
  try {
    out.path = io::temporary_in_messages(path, tmp);
    // A checkpoint that replaces a regular file keeps its permission bits (a new one is 0600).
    struct stat old {};
    if (::lstat(path.c_str(), &old) == 0 && S_ISREG(old.st_mode) && ::fchmod(out.fd, old.st_mode & 0777) != 0) {
      throw std::system_error(errno, std::generic_category(),
                              "cannot save checkpoint " + path + ": cannot set the mode of " + out.path);
    }
    const std::vector<std::uint64_t> words = header_words(*this);
    std::vector<char> head(header_bytes(numels_.size()), 0);
    std::memcpy(head.data(), checkpoint_magic, 8);
    std::memcpy(head.data() + 8, words.data(), words.size() * 8);
    out.write_all(head.data(), head.size(), 0);
    std::uint32_t crc = swap::crc32c(head.data(), head.size());
    std::uint64_t at = head.size();
    visit_records([&](const group& g, const float* record) {
      out.write_all(record, record_bytes(g), at);
      crc = swap::crc32c(record, record_bytes(g), crc);
      at += record_bytes(g);
    });
    out.write_all(note.data(), note.size(), at);
    at += note.size();
    crc = swap::crc32c(note.data(), note.size(), crc);
    char tail[tail_bytes];
    const std::uint64_t tail_words[2] = {note.size(), crc};
    std::memcpy(tail, tail_words, 16);
    std::memcpy(tail + 16, checkpoint_end, 8);
    out.write_all(tail, tail_bytes, at);
    const int synced = io::detail::repeat_interrupted([&] { return ::fsync(out.fd); });
    if (synced != 0) throw std::system_error(errno, std::generic_category(), "cannot sync " + out.path);
    if (io::name_temporary(out.fd, path, tmp) != 0) {
      throw std::system_error(errno, std::generic_category(),
                              "cannot save checkpoint " + path + ": cannot give its new file a name beside it");
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      throw std::system_error(errno, std::generic_category(),
                              "cannot save checkpoint " + path + ": cannot rename " + tmp + " onto it");
    }
  } catch (...) {
    remove_temporary(tmp);  // a failed save (a full disk) leaves no partial file behind
    throw;
  }
  // The new checkpoint is in place; it survives a crash once its folder is synced too.
  io::sync_folder("offloaded_optimizer::save", folder, path);
}

std::string offloaded_optimizer::load(const std::string& path) {
  const exclusive_call call(*this, "load");
  std::string note = stage(path);
  commit_staged();
  return note;
}

std::string offloaded_optimizer::stage_load(const std::string& path) {
  const exclusive_call call(*this, "stage_load");
  return stage(path);
}

void offloaded_optimizer::commit_load() {
  const exclusive_call call(*this, "commit_load");
  if (!still_staged()) {
    throw std::logic_error("offloaded_optimizer::commit_load: no checkpoint is staged (none was, it was dropped, "
                           "or a write since stage_load, by initialize, step, rewrite or another load, took its "
                           "generation)");
  }
  commit_staged();
}

void offloaded_optimizer::drop_staged_load() {
  const exclusive_call call(*this, "drop_staged_load");
  staged_ = false;
}

bool offloaded_optimizer::load_staged() const {
  made_.require_same_process(who);
  if (called_from_this_thread()) return still_staged();
  const std::lock_guard lock(calls_);
  return still_staged();
}

bool offloaded_optimizer::still_staged() const { return staged_ && space_->writes_started() == staged_writes_; }

void offloaded_optimizer::commit_staged() {
  for (const group& g : groups_) space_->commit(g.tensor);  // (in memory: the writes are done)
  steps_.swap(staged_steps_);
  initialized_ = true;
  staged_ = false;
}

std::string offloaded_optimizer::stage(const std::string& path) {
  io::check_path_argument("offloaded_optimizer::load", path);
  const file in(path, O_RDONLY);
  std::vector<char> head(header_bytes(numels_.size()), 0);
  char magic[8];
  in.read_all(magic, 8, 0);
  if (std::memcmp(magic, checkpoint_magic, 8) != 0) {
    throw std::runtime_error("checkpoint " + path + " is not a tensormem optimizer checkpoint");
  }
  in.read_all(head.data(), head.size(), 0);
  std::vector<std::uint64_t> expected = header_words(*this);
  std::vector<std::uint64_t> words(expected.size());
  std::memcpy(words.data(), head.data() + 8, words.size() * 8);
  const std::uint64_t version = words[0];
  if (version != 1 && version != checkpoint_version) {
    throw std::runtime_error("checkpoint " + path + " has version " + std::to_string(version) +
                             "; this build reads versions 1 and " + std::to_string(checkpoint_version));
  }
  static const char* const names[] = {"version", "optimizer kind", "master copy", "fields", "parameters",
                                      "group elements", "groups"};
  for (std::size_t i = 1; i < 7; ++i) {
    if (words[i] != expected[i]) {
      throw std::runtime_error("checkpoint " + path + " does not match this optimizer: " + names[i] + " " +
                               std::to_string(words[i]) + ", expected " + std::to_string(expected[i]));
    }
  }
  std::vector<std::uint64_t> steps(numels_.size());
  for (std::size_t p = 0; p < numels_.size(); ++p) {
    if (words[7 + 2 * p] != numels_[p]) {
      throw std::runtime_error("checkpoint " + path + " does not match this optimizer: parameter " +
                               std::to_string(p) + " has " + std::to_string(words[7 + 2 * p]) +
                               " elements, expected " + std::to_string(numels_[p]));
    }
    steps[p] = words[8 + 2 * p];
  }
  std::uint64_t largest = 0;
  std::uint64_t records = 0;
  for (const group& g : groups_) {
    largest = std::max(largest, record_bytes(g));
    records += record_bytes(g);
  }
  // The size, the end marker and the note are checked before any record is read; the checksum
  // as the last record is read, so that a damaged file leaves the state as it was.
  struct stat st {};
  if (::fstat(in.fd, &st) != 0) throw std::system_error(errno, std::generic_category(), "cannot stat " + path);
  const auto size = static_cast<std::uint64_t>(st.st_size);
  const std::uint64_t body = head.size() + records;
  std::string note;
  std::uint64_t stored_crc = 0;
  if (version == 1) {
    if (size < body) throw std::runtime_error("checkpoint " + path + " is truncated");
    if (size != body) {
      throw std::runtime_error("checkpoint " + path + " has " + std::to_string(size - body) +
                               " bytes more than its records");
    }
  } else {
    char tail[tail_bytes];
    if (size < body + tail_bytes) throw std::runtime_error("checkpoint " + path + " is truncated");
    in.read_all(tail, tail_bytes, size - tail_bytes);
    std::uint64_t tail_words[2];
    std::memcpy(tail_words, tail, 16);
    if (std::memcmp(tail + 16, checkpoint_end, 8) != 0 || tail_words[0] != size - tail_bytes - body) {
      throw std::runtime_error("checkpoint " + path + " is truncated or damaged: its end marker is missing");
    }
    note.resize(tail_words[0]);
    in.read_all(note.data(), note.size(), body);
    stored_crc = tail_words[1];
  }
  std::uint32_t crc = swap::crc32c(head.data(), head.size());
  std::uint64_t at = head.size();
  write_every_record(groups_, *space_, *pool_, largest, options_.pipeline.pinned_budget,
                     [&](const group& g, float* record) {
    in.read_all(record, record_bytes(g), at);
    at += record_bytes(g);
    if (version == 1) return;
    crc = swap::crc32c(record, record_bytes(g), crc);
    if (&g != &groups_.back()) return;
    crc = swap::crc32c(note.data(), note.size(), crc);
    if (crc != stored_crc) {
      throw std::runtime_error("checkpoint " + path + " is damaged: its checksum does not match its contents");
    }
  }, /*commit=*/false);
  staged_steps_ = std::move(steps);
  staged_writes_ = space_->writes_started();
  staged_ = true;
  return note;
}

}  // namespace tensormem::offload
