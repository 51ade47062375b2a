#pragma once
// An optimizer whose state lives in a swap space: AdamW, Adam or SGD with momentum over fp32
// parameters held by the caller, with the moments (and, by default, an fp32 master copy of
// the parameters) on disk. The parameters are cut into sub-groups of about `group_bytes`;
// a step streams the groups through a prefetch pipeline: group k+1 is read while group k is
// updated (vectorized kernels) and group k-1 written back. Steps are atomic on disk: every
// group's new state goes to the uncommitted generation and is committed only when all of
// them are written; a failed step leaves the previous state committed and, with the master
// copy offloaded, the parameters as they were before the step.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/offload/optimizer_kernels.hpp"
#include "tensormem/offload/prefetch_pipeline.hpp"
#include "tensormem/offload/swap_space.hpp"

namespace tensormem::offload {

enum class optimizer_kind { adamw, adam, sgd };

/// A step given up on request (`offloaded_optimizer::step`'s `stop`): nothing of it stays.
class step_interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A failed step that could not be undone: putting the parameters back from the committed
/// master copy failed too (say, memory ran out again). The message holds both errors; the
/// tensor, file and errno are the step's own error's where it had them (ENOMEM for
/// std::bad_alloc). The committed state and the step counts are the previous step's, as after
/// any failed step, but the parameters of `parameters()` may hold this step's values:
/// `offloaded_optimizer::restore_parameters` copies the committed master copy into them.
class step_not_undone : public offload_error {
 public:
  step_not_undone(const std::exception& step_error, const std::exception& restore_error,
                  std::vector<std::size_t> parameters);
  const std::vector<std::size_t>& parameters() const noexcept { return parameters_; }

 private:
  // (`parameters` by reference: the message is made from it before it is moved.)
  step_not_undone(const offload_error& step_error, const std::string& message, std::vector<std::size_t>&& parameters);
  std::vector<std::size_t> parameters_;
};

/// Hyperparameters of one parameter for one step (torch.optim's names and defaults).
struct param_hyper {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0;
  double momentum = 0, dampening = 0;
  bool nesterov = false;
};

struct optimizer_options {
  optimizer_kind kind = optimizer_kind::adamw;
  bool offload_master = true;                      ///< keep an fp32 master copy on disk
  std::uint64_t group_bytes = std::uint64_t{32} << 20;  ///< parameter bytes per sub-group
  pipeline_options pipeline;                       ///< the pinned budget
  swap_space_options swap;
  /// Prefix of the swap files; empty: "opt-<pid>-<n>", unique in this process.
  std::string name;
  int simd = -1;                                   ///< a simd_level, or -1 for the best one
  /// Adam/AdamW: whose rounding to reproduce (tensormem.offload picks the installed PyTorch's).
  adam_arithmetic arithmetic = adam_arithmetic::torch1;
  /// Where the memory-lock limit (RLIMIT_MEMLOCK, a user without CAP_IPC_LOCK) refuses to lock
  /// a staging buffer, use it unlocked (O_DIRECT needs no locked memory; a GPU's copies from
  /// it are slower), counted in step_stats::unlocked_slabs. Off: the lock_limit_error.
  bool allow_unlocked_fallback = false;
};

struct step_stats {
  double seconds = 0;               ///< the whole step
  double compute_seconds = 0;       ///< in the update kernels
  double io_wait_seconds = 0;       ///< blocked on reads (acquire) and write-backs (finish)
  /// Share of the step not spent waiting for I/O: 1 - io_wait / seconds.
  double overlap_ratio = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t pinned_bytes = 0;   ///< staging buffers held by the step
  std::uint64_t pinned_high_water = 0;  ///< the pool's peak bytes in use since construction
  std::uint64_t groups = 0;
  std::uint64_t elements = 0;       ///< parameters updated
  /// Staging slabs the memory-lock limit left unlocked since construction (allow_unlocked_fallback).
  std::uint64_t unlocked_slabs = 0;
  /// False where the pipeline's collector thread could not be started (a limit on threads):
  /// the step collected its write-backs itself (pipeline_stats::collector_thread).
  bool collector_thread = true;
};

/// Thread safety: calls from several threads run one at a time (`initialize`, `step`,
/// `restore_parameters`, `visit`, `rewrite`, `save`, `load`, `stage_load`, `commit_load` and
/// `drop_staged_load`, "the guarded calls", take one mutex for their whole run; `steps`,
/// `initialized` and `load_staged` read under it). A guarded call from inside the
/// callback of `visit` or `rewrite` on the same optimizer would change the records being
/// streamed, or wait for itself: it throws std::logic_error and changes nothing. Inside a callback,
/// `steps` and `initialized` read the state directly. In a child forked after the optimizer
/// was made, those calls and the three readers throw io::forked_child_error, and the destructor waits for
/// nothing and removes no file (its swap files are the parent's).
class offloaded_optimizer {
 public:
  /// One element range of a parameter inside a group's record.
  struct piece {
    std::size_t param = 0;
    std::uint64_t param_offset = 0;  ///< first element in the parameter
    std::uint64_t count = 0;
    std::uint64_t group_offset = 0;  ///< first element in each field of the record
  };
  struct group {
    std::size_t index = 0;
    std::size_t tensor = 0;          ///< id in the swap space
    std::uint64_t elements = 0;
    std::uint64_t stride = 0;        ///< floats between the fields of the record (4096-byte multiple)
    std::vector<piece> pieces;
  };

  /// `numels`: elements of each parameter. Throws std::invalid_argument for bad options.
  offloaded_optimizer(std::vector<std::uint64_t> numels, optimizer_options options);
  ~offloaded_optimizer();

  /// Writes the first state: the master copy from `params`, the moments zero. Once, before
  /// the first step (or `load` instead).
  void initialize(std::span<const float* const> params);
  /// One step. `grads[i]` null skips parameter i (its state and step count stay; so does a
  /// zero-element parameter's step count when its gradient pointer is null). Throws
  /// offload_error naming the tensor that failed; see the class comment for what stays.
  /// `stop`, when given, is asked before each group: once it answers true the step is given
  /// up and undone as a failed step is (the previous state committed, the parameters as they
  /// were) and step_interrupted is thrown. It is asked only while the step can be undone:
  /// with the master copy offloaded, before every group; without it, until the first
  /// parameter changes (the values before the step are kept nowhere else), after which the
  /// step runs to its end.
  step_stats step(std::span<float* const> params, std::span<const float* const> grads,
                  std::span<const param_hyper> hyper, const std::function<bool()>& stop = {});

  /// Copies the committed master copy into the parameters (the values they had after the last
  /// step that succeeded, or as given to `initialize` or saved with a loaded checkpoint): the
  /// way back after step_not_undone. Needs the master copy offloaded (std::logic_error
  /// otherwise, as before `initialize` or `load`); the same argument checks as `step`. A
  /// failure (offload_error, std::bad_alloc) may leave some parameters restored and others not,
  /// and can be retried; the state on disk is only read.
  void restore_parameters(std::span<float* const> params);
  /// Fields of a record: "master" (when offloaded), then "exp_avg", "exp_avg_sq" (Adam) or
  /// "momentum_buffer" (SGD).
  const std::vector<std::string>& fields() const noexcept { return fields_; }
  const std::vector<group>& groups() const noexcept { return groups_; }
  /// Steps taken per parameter (a copy: another thread's step may change them).
  std::vector<std::uint64_t> steps() const;
  const std::vector<std::uint64_t>& numels() const noexcept { return numels_; }
  simd_level simd() const noexcept { return simd_; }
  bool initialized() const;

  /// Streams the committed records through `f`, one group at a time.
  void visit(const std::function<void(const group&, const float* record)>& f);
  /// Streams every record through `edit` and commits the edited state (all or nothing).
  /// `steps` (if not empty) replaces the step counts with it.
  void rewrite(const std::function<void(const group&, float* record)>& edit, std::vector<std::uint64_t> steps = {});
  /// Writes a checkpoint file of the committed state (written to a new file in its folder,
  /// synced, named `path`.tensormem-tmp.<pid>.<n> and renamed onto `path`, so an interrupted
  /// save leaves the previous file; then the folder is synced, so that the new file survives a
  /// crash, std::system_error naming the folder if it cannot be: the new file is in place
  /// then). `note` (any bytes: the caller's hyperparameters, say) is kept in the same file, so
  /// the two are replaced together. The file ends with a CRC-32C of all it holds. Never holds
  /// more than the pinned budget. The new file has no name while it is written where the file
  /// system can (O_TMPFILE: a process killed while saving leaves nothing); elsewhere it is
  /// made at once, with O_EXCL, under that name. Either way the name is one no file has:
  /// nothing beside `path` is opened or changed, and saves to one path from several processes
  /// at once each write a whole file of their own (the last rename wins). A failed save
  /// removes its new file; a process killed while saving leaves it only where it was named
  /// from the start. A new checkpoint is readable by its owner only (0600); one that replaces
  /// a regular file keeps that file's permission bits.
  /// `path` must be a regular file, a symbolic link (replaced itself, not followed) or
  /// nothing: anything else there is std::system_error EINVAL (EISDIR for a folder) before
  /// anything is written, and stays as it was.
  /// For `save` and `load`, an empty path or one holding a NUL byte is std::invalid_argument.
  void save(const std::string& path, std::string_view note = {});
  /// Replaces the state with a checkpoint written by `save` for the same parameters and
  /// options, and returns its note. A file of other parameters or options, a truncated or
  /// longer file, or one whose checksum does not match, is std::runtime_error, and the state
  /// stays as it was (the records are committed only once all were read and checked).
  std::string load(const std::string& path);
  /// `load` in two halves, to load several optimizers (one per process, each from its own
  /// file) all or none: `stage_load` on every one, then `commit_load` on every one once every
  /// one has staged, else `drop_staged_load`. `stage_load` reads and checks the file as `load`
  /// does (the same errors) and writes its records to the generation not in use; the state
  /// in use, step counts included, stays as it was until `commit_load`. Returns the note.
  std::string stage_load(const std::string& path);
  /// Makes the staged checkpoint the state: no I/O, nothing that can fail, but
  /// std::logic_error when none is staged: none was, it was dropped, or a write to the swap
  /// space came in between and took the generation it was in (`initialize`, `step`,
  /// `rewrite`, `load`, another `stage_load` that got as far as reading records, or a write
  /// through `space()`).
  void commit_load();
  /// Forgets a staged checkpoint, if one is; the state in use is unchanged.
  void drop_staged_load();
  /// Whether a checkpoint is staged (`stage_load` and nothing since that drops it).
  bool load_staged() const;

  swap_space& space() noexcept { return *space_; }
  memory::pinned_pool& pool() noexcept { return *pool_; }
  const optimizer_options& options() const noexcept { return options_; }

  /// Whether the calling thread is inside one of the guarded calls (in a callback of `visit` or
  /// `rewrite`), where another of them is refused. A caller that hands a call to another
  /// thread asks this first: there the call would not be refused but wait for this one.
  bool called_from_this_thread() const noexcept { return caller_.load() == std::this_thread::get_id(); }

 private:
  std::uint64_t record_bytes(const group& g) const;
  void update_group(const group& g, float* record, std::span<float* const> params,
                    std::span<const float* const> grads, std::span<const param_hyper> hyper, bool& dirty) const;
  void roll_back(const std::vector<std::size_t>& groups, std::span<float* const> params);
  void check_not_null(std::span<float* const> params, const char* what) const;
  void commit_all(const std::vector<std::size_t>& tensors);
  std::string stage(const std::string& path);  // stage_load, unguarded
  void commit_staged();                         // commit_load, unguarded
  bool still_staged() const;                    // load_staged, unguarded
  std::vector<std::size_t> order() const;
  void visit_records(const std::function<void(const group&, const float* record)>& f);  // visit, unguarded

  // Holds calls_ for one of the guarded calls, after refusing one made from inside a callback.
  class exclusive_call {
   public:
    exclusive_call(const offloaded_optimizer& o, const char* what);
    ~exclusive_call();
    exclusive_call(const exclusive_call&) = delete;
    exclusive_call& operator=(const exclusive_call&) = delete;

   private:
    const offloaded_optimizer& o_;
  };

  static constexpr const char* who = "an offloaded optimizer";
  io::detail::fork_guard made_;
  std::vector<std::uint64_t> numels_;
  optimizer_options options_;
  simd_level simd_;
  std::vector<std::string> fields_;
  std::vector<group> groups_;
  std::vector<std::uint64_t> steps_;
  std::unique_ptr<memory::pinned_pool> pool_;
  std::unique_ptr<swap_space> space_;
  bool initialized_ = false;
  // A checkpoint staged by stage_load: its records in the generation not in use, its step
  // counts here, until commit_load or drop_staged_load. It is still there while the swap
  // space has started no write since (staged_writes_, its count when staging ended): any
  // write, by this optimizer or through space(), goes to that generation.
  bool staged_ = false;
  std::uint64_t staged_writes_ = 0;
  std::vector<std::uint64_t> staged_steps_;
  mutable std::mutex calls_;
  mutable std::atomic<std::thread::id> caller_{};  // the thread inside one of the guarded calls
};

}  // namespace tensormem::offload
