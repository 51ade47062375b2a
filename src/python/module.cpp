// The `tensormem` Python module (compiled part, `tensormem._tensormem`).

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlpack/dlpack.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <future>
#include <functional>
#include <map>
#include <set>
#include <optional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "tensormem/arena/contiguous_arena.hpp"
#include "tensormem/core/best_fit_allocator.hpp"
#include "tensormem/core/graph.hpp"
#include "tensormem/core/planner.hpp"
#include "tensormem/core/tlsf_allocator.hpp"
#include "tensormem/core/transformer_step.hpp"
#include "tensormem/memory/host_resource.hpp"
#include "tensormem/memory/cuda_resources.hpp"
#include "tensormem/io/file_io.hpp"
#include "tensormem/io/fork_guard.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"
#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/swap/tensor_swapper.hpp"
#include "tensormem/trace/arena_svg.hpp"
#include "tensormem/trace/plan_svg.hpp"
#include "tensormem/trace/trace_io.hpp"
#include "engine_name.hpp"
#include "file_name.hpp"
#include "numpy_abi.hpp"
#include "signals.hpp"
#include "whole_number.hpp"
#include "../trace/write_file.hpp"
#include "tensormem/core/detail/thread_start.hpp"

namespace py = pybind11;
using namespace tensormem;
using python::u64;  // sizes, offsets, alignments, ids: ValueError outside 0..2^64 - 1
using python::whole;
using python::engine_kinds;  // "uring", "threads": what an `engine` argument names
using python::engine_of;
using python::file_name;  // str, bytes or os.PathLike: the bytes os.fsencode gives
using python::message_text;
using python::python_file_name;
using python::set_python_error;
using python::signal_check_interval;
using python::wait_answering_signals;

namespace {

// The name of an object's type, for errors ("not int").
std::string type_name(const py::handle& object) {
  return py::str(py::type::handle_of(object).attr("__name__")).cast<std::string>();
}

// ---------------------------------------------------------------- memory views and DLPack

/// Bytes owned by something else (an arena, a pool buffer) that Python may view without a
/// copy, through the buffer protocol and DLPack. `owner` keeps the memory alive.
struct memory_view {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  py::object owner;
  DLDeviceType device = kDLCPU;  ///< kDLCUDA for device memory (DLPack only, no buffer protocol)
};

struct dlpack_context {
  std::int64_t shape[1];
  py::object owner;
  std::function<void()> on_release;  // called (GIL held) when the consumer lets go
};

void delete_managed(DLManagedTensor* self) {
  auto* ctx = static_cast<dlpack_context*>(self->manager_ctx);
  {
    py::gil_scoped_acquire gil;
    if (ctx->on_release) ctx->on_release();
    delete ctx;
  }
  delete self;
}

py::capsule to_dlpack(const memory_view& v, py::object self, std::function<void()> on_release = {}) {
  auto* ctx = new dlpack_context{{static_cast<std::int64_t>(v.bytes)}, std::move(self), std::move(on_release)};
  auto* managed = new DLManagedTensor{};
  managed->dl_tensor.data = v.data;
  managed->dl_tensor.device = {v.device, 0};
  managed->dl_tensor.ndim = 1;
  managed->dl_tensor.dtype = {kDLUInt, 8, 1};
  managed->dl_tensor.shape = ctx->shape;
  managed->dl_tensor.strides = nullptr;
  managed->dl_tensor.byte_offset = 0;
  managed->manager_ctx = ctx;
  managed->deleter = delete_managed;
  return py::capsule(managed, "dltensor", [](PyObject* capsule) {
    // Called when the capsule dies unconsumed (a consumer renames it "used_dltensor").
    if (PyCapsule_IsValid(capsule, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
      if (m != nullptr && m->deleter != nullptr) m->deleter(m);
    }
  });
}

// ---------------------------------------------------------------- arena with move log

class py_arena {
 public:
  py_arena(std::uint64_t capacity, std::uint64_t alignment, const std::string& policy, const std::string& device)
      : resource_(make_resource(device)),
        arena_(*resource_, capacity,
               {.alignment = alignment,
                .policy = policy == "full" ? arena::defrag_policy::full_compaction
                                           : arena::defrag_policy::minimal_move}) {
    if (policy != "full" && policy != "minimal") {
      throw std::invalid_argument("policy must be 'minimal' or 'full', not '" + policy + "'");
    }
  }
  py::tuple allocate(u64 bytes) {
    const arena::tensor_block b = arena_.allocate(bytes);
    arena_.bind(b.id, [this](const arena::tensor_block& moved) {
      moves_.emplace_back(moved.id, moved.offset);
    });
    return py::make_tuple(b.id, b.offset);
  }
  void release(u64 id) { arena_.release(id); }
  std::uint64_t offset(u64 id) const { return arena_.block(id).offset; }
  std::vector<std::pair<std::uint64_t, std::uint64_t>> take_moves() {
    return std::exchange(moves_, {});
  }
  memory_view view(py::object self) const {
    const bool device = resource_->kind() == memory::memory_kind::cuda_device;
    return {arena_.base(), arena_.capacity(), std::move(self), device ? kDLCUDA : kDLCPU};
  }
  arena::contiguous_arena& get() { return arena_; }

 private:
  // "cpu": host memory; "cuda" or "cuda:0": device memory of CUDA device 0 (moves by device
  // copies); device_unavailable says why when there is none.
  static std::unique_ptr<memory::memory_resource> make_resource(const std::string& device) {
    if (device == "cpu") return std::make_unique<memory::host_resource>();
    if (device == "cuda" || device == "cuda:0") return std::make_unique<memory::cuda_device_resource>();
    throw std::invalid_argument("device must be 'cpu', 'cuda' or 'cuda:0', not '" + device + "'");
  }
  std::unique_ptr<memory::memory_resource> resource_;
  arena::contiguous_arena arena_;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> moves_;
};

// ---------------------------------------------------------------- pinned buffers

/// A pool buffer seen from Python. Every export (buffer-protocol view, DLPack capsule) is
/// counted; `free()` with exports alive raises BufferError, so no view ever aliases memory
/// the pool hands out again. The memory also goes back when the object dies, which cannot
/// happen while a view exists (each view holds a reference to the object).
struct pinned_buffer {
  std::shared_ptr<memory::pinned_pool> pool;
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  bool live = true;
  std::size_t exports = 0;
  pinned_buffer() = default;
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  void free() {
    if (!live) throw py::buffer_error("PinnedBuffer.free(): already freed");
    if (exports != 0) {
      throw py::buffer_error("PinnedBuffer.free(): " + std::to_string(exports) +
                             " view(s) of it are alive (memoryview, numpy array, DLPack tensor); "
                             "release them first");
    }
    live = false;  // (under the GIL: no other Python thread sees it live meanwhile)
    py::gil_scoped_release unlocked;  // a slab of its own is unmapped (a tenth of a second for 256 MiB)
    if (pool) pool->free(data);
  }
  void release() noexcept {
    if (live && pool) pool->free(data);
    live = false;
  }
  ~pinned_buffer() { release(); }  // with the GIL: a last reference may go during the interpreter's teardown
};

// A buffer getter's refusal: BufferError with `message`, no view.
int refuse_buffer(Py_buffer* view, const char* message) {
  PyErr_SetString(PyExc_BufferError, message);
  view->obj = nullptr;
  return -1;
}

// Buffer protocol of MemoryView: unsigned bytes, writable. Never lets a C++ exception out:
// device memory (a CUDA arena's) sets BufferError and returns -1.
int memory_view_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  try {
    const auto& v = py::handle(self).cast<const memory_view&>();
    if (v.device != kDLCPU) return refuse_buffer(view, "device memory has no buffer protocol; use DLPack");
    return PyBuffer_FillInfo(view, self, v.data, static_cast<Py_ssize_t>(v.bytes), 0, flags);
  } catch (...) {
    return refuse_buffer(view, "MemoryView: cannot export a buffer");
  }
}

// Buffer protocol of PinnedBuffer, counting exports. Never lets a C++ exception out: a
// freed buffer sets BufferError and returns -1.
int pinned_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  try {
    auto& b = py::handle(self).cast<pinned_buffer&>();
    if (!b.live) return refuse_buffer(view, "PinnedBuffer was freed");
    if (PyBuffer_FillInfo(view, self, b.data, static_cast<Py_ssize_t>(b.bytes), 0, flags) != 0) return -1;
    ++b.exports;
    return 0;
  } catch (...) {
    return refuse_buffer(view, "PinnedBuffer: cannot export a buffer");
  }
}

void pinned_releasebuffer(PyObject* self, Py_buffer*) {
  try {
    auto& b = py::handle(self).cast<pinned_buffer&>();
    if (b.exports != 0) --b.exports;
  } catch (...) {
  }
}

/// The memory of one tensor of a ticket, held for as long as this object lives: a Python
/// buffer (numpy array, bytearray, memoryview...) as an open contiguous view, which also keeps
/// its exporter from resizing or freeing it, or a CPU torch tensor (any dtype) by reference,
/// with its storage: a tensor given other memory before the transfer ends (`t.set_(...)`,
/// `p.data = ...`) would otherwise free the memory the transfer reads or writes.
struct held_view {
  std::optional<py::buffer_info> info;
  py::object tensor;
  // A torch tensor's storage, kept alive and its size held (tensormem._storage_hold.hold): a
  // resize_ that would free its memory raises instead (where the PyTorch extension is built).
  py::object storage;
  swap::tensor_ref ref;
};

/// Why a swap-in into a torch tensor cannot be trusted although the swapper finished it, or
/// empty: the tensor was given other memory before the wait (its bytes went to the memory it
/// had, kept alive meanwhile). Resizing it in place to more bytes is refused meanwhile by the
/// size hold (where the PyTorch extension is built).
std::string moved_since(const held_view& v) {
  if (!v.tensor || v.ref.bytes == 0) return {};  // a buffer, not a torch tensor
  if (v.tensor.attr("data_ptr")().cast<std::uintptr_t>() != reinterpret_cast<std::uintptr_t>(v.ref.data)) {
    return "the tensor was given other memory (set_, .data =) before the wait; the file's bytes went to the "
           "memory it had, and it does not hold them";
  }
  return {};
}

/// True if a buffer's struct format (PEP 3118) has an item that is a Python object ('O'):
/// such bytes are pointers that own references, not data. Field names (":name:") are skipped.
bool holds_python_objects(const std::string& format) {
  bool in_name = false;
  for (const char c : format) {
    if (c == ':') in_name = !in_name;
    else if (c == 'O' && !in_name) return true;
  }
  return false;
}

held_view hold(const py::handle& object, bool writable) {
  held_view h;
  if (PyObject_CheckBuffer(object.ptr()) != 0) {
    h.info = py::reinterpret_borrow<py::buffer>(object).request(writable);
    if (!PyBuffer_IsContiguous(h.info->view(), 'C')) throw std::invalid_argument("buffer is not contiguous");
    // Writing file bytes over object pointers would corrupt the interpreter; writing the
    // pointers to a file would save addresses, not the data.
    if (holds_python_objects(h.info->format)) {
      throw py::type_error("a buffer of Python objects (format '" + h.info->format +
                           "', such as a numpy array of dtype object) cannot be swapped: its bytes are "
                           "references, not data");
    }
    h.ref = {h.info->ptr, static_cast<std::size_t>(h.info->size * h.info->itemsize)};
    return h;
  }
  // torch tensors have no buffer protocol; they are recognized by what they answer.
  const bool tensor_like = py::hasattr(object, "data_ptr") && py::hasattr(object, "element_size") &&
                           py::hasattr(object, "numel") && py::hasattr(object, "device") &&
                           py::hasattr(object, "is_contiguous");
  if (!tensor_like) {
    throw py::type_error("a tensor must be a buffer (numpy array, bytearray, memoryview...) or a CPU torch "
                         "tensor, not " + type_name(object));
  }
  const auto device = py::str(object.attr("device")).cast<std::string>();
  if (device != "cpu") {
    throw std::invalid_argument("a tensor on " + device + ": the swapper moves host memory (copy it to the "
                                "CPU, or use tensormem.torch.AsyncTensorSwapper)");
  }
  if (py::hasattr(object, "layout")) {
    if (const auto layout = py::str(object.attr("layout")).cast<std::string>(); layout != "torch.strided") {
      throw std::invalid_argument("a tensor of layout " + layout + " has no one block of memory holding its "
                                  "values: swap a dense one (to_dense()) or its parts");
    }
  }
  if (!object.attr("is_contiguous")().cast<bool>()) throw std::invalid_argument("tensor is not contiguous");
  // A lazy conjugate or negative view reads its memory through an operation: its bytes are not
  // its values, so a swap-out would save (and a swap-in fill) other values than the tensor's.
  if (py::hasattr(object, "is_conj") && object.attr("is_conj")().cast<bool>()) {
    throw std::invalid_argument("a conjugate view (is_conj(): its memory holds the values unconjugated): swap "
                                "t.resolve_conj(), a copy");
  }
  if (py::hasattr(object, "is_neg") && object.attr("is_neg")().cast<bool>()) {
    throw std::invalid_argument("a negative view (is_neg(): its memory holds the values negated): swap "
                                "t.resolve_neg(), a copy");
  }
  const auto bytes = object.attr("numel")().cast<std::size_t>() * object.attr("element_size")().cast<std::size_t>();
  h.tensor = py::reinterpret_borrow<py::object>(object);
  // PyTorch 2.x has untyped_storage(); 1.x has storage() alone (2.x warns that it is deprecated).
  h.storage = py::module_::import("tensormem._storage_hold")
                  .attr("hold")(py::hasattr(object, "untyped_storage") ? object.attr("untyped_storage")()
                                                                        : object.attr("storage")());
  h.ref = {reinterpret_cast<void*>(object.attr("data_ptr")().cast<std::uintptr_t>()), bytes};
  return h;
}

/// TensorSwapper for Python: the buffers of each ticket are held until it is collected, and
/// no call blocks with the GIL held (the swapper's own lock is taken with the GIL released).
/// `wait` and `synchronize` answer Ctrl-C: interrupted, they collect no more tickets, and the
/// outstanding ones keep their buffers held, to be waited for again.
class py_swapper {
 public:
  py_swapper(std::shared_ptr<memory::pinned_pool> pool, swap::swap_options options) : pool_(std::move(pool)) {
    py::gil_scoped_release release;  // staging buffers (maybe a new slab), a ring, threads
    swapper_ = std::make_unique<swap::tensor_swapper>(*pool_, options);
  }
  ~py_swapper() {
    {
      py::gil_scoped_release release;
      swapper_.reset();  // waits for every transfer
    }
    held_.clear();  // GIL held again: the views can be released
  }
  std::uint64_t start(const std::vector<py::object>& tensors, const std::vector<file_name>& names,
                      const std::vector<python::name_text>& key_names, bool out) {
    const std::vector<std::string> paths = python::name_bytes(names);
    const std::vector<std::string> keys = python::name_bytes(key_names);
    std::vector<held_view> views;
    views.reserve(tensors.size());
    for (const auto& t : tensors) views.push_back(hold(t, !out));
    std::vector<swap::tensor_ref> refs;
    for (const auto& v : views) refs.push_back(v.ref);
    // A swap-in changes a torch tensor's values in place: counted in its version, as an
    // in-place operation's, so that autograd refuses a backward through values saved before
    // it. The counts are made ready first and taken once the transfers are queued, so that a
    // refused batch counts nothing.
    std::vector<py::object> markers;
    if (!out) {
      const py::object marker_of = py::module_::import("tensormem._storage_hold").attr("write_marker");
      for (const auto& v : views) {
        if (!v.tensor) continue;
        if (py::object m = marker_of(v.tensor); !m.is_none()) markers.push_back(std::move(m));
      }
    }
    std::uint64_t ticket = 0;
    {
      py::gil_scoped_release release;
      ticket = out ? swapper_->swap_out(refs, paths, keys) : swapper_->swap_in(paths, refs, keys);
    }
    held_[ticket] = std::move(views);
    if (!out) swap_ins_.insert(ticket);
    for (const auto& m : markers) m();  // (a zero-element copy: allocates nothing)
    return ticket;
  }
  std::vector<swap::swap_result> wait(std::uint64_t ticket) {
    std::optional<std::vector<swap::swap_result>> r;
    try {
      // The ticket is held from the first slice to the last: no other thread's wait or
      // synchronize takes it in between. Interrupted, the claim is let go (GIL released: it
      // takes the swapper's lock), and the ticket stays outstanding.
      std::optional<swap::tensor_swapper::ticket_wait> claim;
      struct let_go_without_gil {
        std::optional<swap::tensor_swapper::ticket_wait>& claim;
        ~let_go_without_gil() {
          py::gil_scoped_release release;
          claim.reset();
        }
      } let_go{claim};
      {
        py::gil_scoped_release release;
        claim.emplace(*swapper_, ticket);
      }
      wait_answering_signals([&](auto deadline) {
        r = claim->until(deadline);
        return r.has_value();
      });
    } catch (...) {
      release_collected();  // another thread's synchronize may have collected it
      throw;
    }
    // A swap-in whose tensor was given other memory meanwhile fails its result, so that no
    // tensor seems to hold bytes that went to the memory it had.
    if (const auto it = held_.find(ticket); it != held_.end() && swap_ins_.contains(ticket)) {
      for (std::size_t i = 0; i < it->second.size() && i < r->size(); ++i) {
        swap::swap_result& result = (*r)[i];
        if (result.error != 0) continue;
        if (std::string why = moved_since(it->second[i]); !why.empty()) {
          result.error = EFAULT;
          result.message = "swap-in of " + result.path + ": " + why;
        }
      }
    }
    held_.erase(ticket);  // GIL held again: the views can be released
    swap_ins_.erase(ticket);
    return std::move(*r);
  }
  void synchronize() {
    try {
      wait_answering_signals([&](auto deadline) { return swapper_->synchronize_until(deadline); });
    } catch (...) {
      release_collected();  // those collected before the interruption
      throw;
    }
    // It collects the tickets other threads start while it runs, too; one started after it
    // ended is still outstanding, and its buffers stay held.
    release_collected();
  }
  swap::tensor_swapper& get() { return *swapper_; }

 private:
  // Lets go of the buffers of every ticket the swapper has collected (its transfers ended),
  // by whichever call and thread collected it. Called with the GIL held; the swapper is
  // asked with it released, as everywhere. A collected ticket never comes back, so a ticket
  // another thread starts meanwhile is simply not among those erased.
  void release_collected() {
    std::vector<std::uint64_t> tickets;
    for (const auto& entry : held_) tickets.push_back(entry.first);
    {
      py::gil_scoped_release release;
      std::erase_if(tickets, [this](std::uint64_t ticket) { return swapper_->outstanding(ticket); });
    }
    for (const std::uint64_t ticket : tickets) {
      held_.erase(ticket);
      swap_ins_.erase(ticket);
    }
  }

  std::shared_ptr<memory::pinned_pool> pool_;
  std::unique_ptr<swap::tensor_swapper> swapper_;
  std::map<std::uint64_t, std::vector<held_view>> held_;  // touched only with the GIL held
  std::set<std::uint64_t> swap_ins_;                      // the tickets of held_ that are swap-ins
};

py::list results_to_python(const std::vector<swap::swap_result>& results) {
  py::list out;
  for (const auto& r : results) {
    py::dict d;
    d["path"] = python_file_name(r.path);
    d["bytes"] = r.bytes;
    d["error"] = r.error;
    d["message"] = message_text(r.message);
    out.append(d);
  }
  return out;
}

// Refuses (MemoryError) `count` things of about `bytes_each` bytes where together they pass
// the memory this process can have (the machine's, or its memory cgroup's limit): made and
// touched, they would have the kernel's out-of-memory killer end the interpreter.
void refuse_past_memory(const std::string& who, std::size_t count, const char* things, const char* thing,
                        std::uint64_t bytes_each) {
  if (const auto shortfall = memory::memory_shortfall_for(count, bytes_each)) {
    throw memory::out_of_memory(who + ": " + std::to_string(count) + " " + things + " need about " +
                                std::to_string(shortfall->need_bytes) + " bytes of memory (about " +
                                std::to_string(bytes_each) + " a " + thing + "), more than the " +
                                std::to_string(shortfall->memory_bytes) + " bytes this process can have");
  }
}

template <class Allocator>
void bind_allocator(py::module_& m, const char* name, const char* doc) {
  py::class_<Allocator> cls(m, name, doc);
  cls.attr("reserve_bytes_per_block") = Allocator::reserve_bytes_per_block;
  cls
      .def(py::init<u64, u64>(), py::arg("capacity") = core::growing,
           py::arg("alignment") = 256)
      .def("allocate",
           [](Allocator& a, u64 bytes) -> py::object {
             const auto r = a.allocate(bytes);
             if (!r) return py::none();
             return py::cast(*r);
           },
           py::arg("bytes"), "Returns an Allocation, or None when it does not fit.")
      // (members inherited from the block-chain base are adapted or wrapped to take an
      // Allocator; pybind11's adaptor does not take noexcept members)
      .def("deallocate", py::method_adaptor<Allocator>(&Allocator::deallocate), py::arg("allocation"))
      .def("reserve",
           [name](Allocator& a, u64 blocks) {
             // The nodes are made here: a count past the process's memory would have the
             // kernel's out-of-memory killer end the interpreter, so it is refused first.
             const std::size_t n = a.blocks_to_reserve(static_cast<std::size_t>(std::uint64_t{blocks}));
             if (n <= Allocator::max_reserved_blocks) {
               refuse_past_memory(std::string(name) + ".reserve", n, "blocks", "block", Allocator::reserve_bytes_per_block);
             }
             a.reserve(n);
           },
           py::arg("blocks"),
           "Room for this many blocks, live and free together, so that allocating and "
           "deallocating by handle ask for no memory until more exist (with a fixed capacity, "
           "at most one block per alignment unit of it); ValueError for 2**32 - 18 or more, "
           "MemoryError for more than this process's memory can hold, changing nothing.")
      .def("free", [](Allocator& a, u64 offset, u64 bytes) { a.free(offset, bytes); }, py::arg("offset"), py::arg("bytes"),
           "InfiniTensor-style free; raises ValueError on misuse, changing nothing.")
      .def_property_readonly("peak", [](const Allocator& a) { return a.peak(); })
      .def_property_readonly("used", [](const Allocator& a) { return a.used(); })
      .def("check_invariants", &Allocator::check_invariants)
      .def("stats", [](const Allocator& a) {
        const core::allocator_stats s = a.stats();
        py::dict d;
        d["used_bytes"] = s.used_bytes;
        d["peak_bytes"] = s.peak_bytes;
        d["free_bytes"] = s.free_bytes;
        d["free_blocks"] = s.free_blocks;
        d["largest_free_bytes"] = s.largest_free_bytes;
        d["live_allocations"] = s.live_allocations;
        d["fragmentation"] = s.fragmentation();
        return d;
      });
}

/// The elements of a list or tuple of Python integers, each in [0, 2^64); anything else is a
/// ValueError naming the argument and the element.
std::vector<std::uint64_t> unsigned_elements(const py::sequence& items, const char* name) {
  std::vector<std::uint64_t> out;
  out.reserve(items.size());
  for (const py::handle item : items) {
    // The message is built on the error branches only: a valid element costs no string.
    const auto refuse = [&](const char* why) {
      return std::invalid_argument(std::string(name) + "[" + std::to_string(out.size()) + "] is " +
                                   py::repr(item).cast<std::string>().substr(0, 40) + why);
    };
    if (!PyLong_Check(item.ptr()) || PyBool_Check(item.ptr())) throw refuse(", not an integer");
    if (py::int_(0) > item) throw refuse("; values must be >= 0");
    const unsigned long long value = PyLong_AsUnsignedLongLong(item.ptr());
    if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      throw refuse(", which does not fit in 64 bits");
    }
    out.push_back(static_cast<std::uint64_t>(value));
  }
  return out;
}

/// A one-dimensional array of non-negative integers, as uint64. Floats, booleans, objects
/// and negative values are refused with a ValueError naming the argument and the element:
/// a silent cast would turn -1 into 2^64 - 1 and 1.5 into 1.
std::vector<std::uint64_t> unsigned_array(const py::handle& object, const char* name) {
  python::require_numpy_abi(name);
  const py::array a = py::module_::import("numpy").attr("asarray")(object);
  if (a.ndim() != 1) {
    throw std::invalid_argument(std::string(name) + " must be one-dimensional, not " +
                                std::to_string(a.ndim()) + "-dimensional");
  }
  if (a.size() == 0) return {};  // an empty list is an array of floats to numpy
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u' &&
      (py::isinstance<py::list>(object) || py::isinstance<py::tuple>(object))) {
    // Python integers that no one numpy integer type holds ([0, 2**64 - 1], [-1, 2**63])
    // become floats or objects to numpy: read them one by one, which also names the first
    // element that is not an integer.
    return unsigned_elements(py::reinterpret_borrow<py::sequence>(object), name);
  }
  if (kind != 'i' && kind != 'u') {
    throw std::invalid_argument(std::string(name) + " must hold integers, not " +
                                py::str(a.dtype()).cast<std::string>());
  }
  std::vector<std::uint64_t> out(static_cast<std::size_t>(a.size()));
  if (kind == 'i') {
    const auto signed_values = py::array_t<std::int64_t, py::array::forcecast>::ensure(a);
    const auto v = signed_values.unchecked<1>();
    for (py::ssize_t i = 0; i < v.shape(0); ++i) {
      if (v(i) < 0) {
        throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) + "] is " +
                                    std::to_string(v(i)) + "; values must be >= 0");
      }
      out[static_cast<std::size_t>(i)] = static_cast<std::uint64_t>(v(i));
    }
  } else {
    const auto unsigned_values = py::array_t<std::uint64_t, py::array::forcecast>::ensure(a);
    const auto v = unsigned_values.unchecked<1>();
    for (py::ssize_t i = 0; i < v.shape(0); ++i) out[static_cast<std::size_t>(i)] = v(i);
  }
  return out;
}

std::vector<core::buffer> buffers_from(const py::handle& lower, const py::handle& upper,
                                       const py::handle& size) {
  const auto l = unsigned_array(lower, "lower");
  const auto u = unsigned_array(upper, "upper");
  const auto s = unsigned_array(size, "size");
  if (l.size() != u.size() || l.size() != s.size()) {
    throw std::invalid_argument("lower, upper and size must have the same length");
  }
  std::vector<core::buffer> b(l.size());
  for (std::size_t i = 0; i < l.size(); ++i) b[i] = {std::to_string(i), l[i], u[i], s[i], {}};
  return b;
}

// core::plan on a thread of its own, while the calling thread, every 50 ms, lets Python run
// its signal handlers (they run only on the main thread, and only when it runs Python code),
// looks at `stop` (None, or an object with is_set(), as threading.Event) and hands the
// planner's latest progress, if new, to `progress` (None or a callable taking a dict). So
// the Python calls all come on the calling thread, one at a time. Ctrl-C's
// KeyboardInterrupt, or any exception a handler, is_set() or `progress` raises, stops the
// planner (plan_options::stop) and is raised once the planner has ended, its plan dropped;
// `stop` set stops it too, and its best plan so far is returned (plan_result::stopped).
// Called with the GIL held.
core::plan_result plan_interruptibly(const std::vector<core::buffer>& buffers, core::plan_options o,
                                     const py::object& stop, const py::object& progress) {
  std::atomic<bool> stop_flag{false};
  o.stop = &stop_flag;
  std::mutex latest_mutex;
  std::optional<core::plan_progress> latest;  // the planner's last report not yet handed on
  if (!progress.is_none()) {
    o.progress = [&](const core::plan_progress& p) {
      const std::lock_guard lock(latest_mutex);
      latest = p;
    };
  }
  // Hands the planner's latest report, if new, to `progress` (with the GIL).
  auto hand_on = [&] {
    std::optional<core::plan_progress> now;
    {
      const std::lock_guard lock(latest_mutex);
      now = std::exchange(latest, std::nullopt);
    }
    if (!now) return;
    py::dict d;
    d["seconds"] = now->seconds;
    d["best_arena_bytes"] = now->best_arena_bytes;
    d["lower_bound"] = now->lower_bound;
    d["phase"] = now->phase;
    progress(d);
  };
  std::packaged_task<core::plan_result()> task([&] {
    core::detail::prepare_thread_for_exceptions();
    return core::plan(buffers, o);
  });
  std::future<core::plan_result> result = task.get_future();
  std::jthread planner;
  try {
    planner = std::jthread([&task] { task(); });  // (the task stays here, to run here if need be)
  } catch (const std::system_error& e) {
    // No thread for it (a limit on threads or on the address space): it plans on this one,
    // without the GIL, and Ctrl-C, `stop` and `progress` are answered once it has ended.
    {
      py::gil_scoped_release release;
      task();
    }
    hand_on();
    core::plan_result r = result.get();
    const std::string note = std::string("the planner's thread could not be started (") + e.what() +
                             "): it planned on the calling thread, where Ctrl-C, stop and progress wait for it";
    r.fallback = r.fallback.empty() ? note : note + "; " + r.fallback;
    return r;
  }
  try {
    wait_answering_signals([&](auto deadline) { return result.wait_until(deadline) == std::future_status::ready; },
                           [&] {
                             if (!stop.is_none() && !stop_flag.load() && stop.attr("is_set")().cast<bool>()) {
                               stop_flag.store(true);
                             }
                             hand_on();
                           });
  } catch (...) {  // raised once the planner has ended, its plan dropped
    stop_flag.store(true);
    py::gil_scoped_release release;
    planner.join();
    throw;
  }
  hand_on();  // its last report, so that a progress display ends where the plan did
  return result.get();
}

}  // namespace

void bind_offload(py::module_& m);  // offload_bindings.cpp

PYBIND11_MODULE(_tensormem, m) {
  // The importing thread (the interpreter's main thread, as a rule) too: its first throw,
  // a std::bad_alloc to become MemoryError, must not need memory of its own.
  core::detail::prepare_thread_for_exceptions();
  m.doc() = "tensormem: tensor memory planning, arenas, pinned memory and swapping";
  m.attr("__version__") = TENSORMEM_VERSION;

  // A call in a child forked after its object was made (the object's threads stayed behind,
  // or its memory is no longer locked there).
  static PyObject* forked_child = nullptr;  // the class, kept alive by the module
  forked_child = py::register_local_exception<io::forked_child_error>(m, "ForkedChildError", PyExc_RuntimeError).ptr();
  // Local: the translators of this module's functions only. pybind11 shares its registry of
  // global translators with every module built like this one (PyTorch's among them), where
  // the last catch below would take PyTorch's own errors from PyTorch's translator.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const memory::forked_child_error& e) {
      set_python_error(forked_child, e.what());
    } catch (const io::forked_child_error& e) {
      set_python_error(forked_child, e.what());
    } catch (const memory::out_of_memory& e) {
      set_python_error(PyExc_MemoryError, e.what());
    } catch (const std::system_error& e) {
      py::object err = py::module_::import("builtins").attr("OSError")(e.code().value(), message_text(e.what()));
      PyErr_SetObject(PyExc_OSError, err.ptr());
    } catch (const std::invalid_argument& e) {
      set_python_error(PyExc_ValueError, e.what());
    } catch (const trace::trace_error& e) {
      set_python_error(PyExc_ValueError, e.what());
    } catch (const py::error_already_set&) {
      throw;
    } catch (const py::builtin_exception&) {
      throw;
    } catch (const std::exception& e) {
      // Any other: the Python class pybind11 gives it, with a message that may name a file
      // whose name is not UTF-8 (pybind11's own translation would raise UnicodeDecodeError).
      set_python_error(python::python_class_of(e), e.what());
    }
  });

  auto memory_view_class = py::class_<memory_view>(m, "MemoryView", py::buffer_protocol(),
                                                   "Bytes viewed without a copy (buffer protocol and DLPack).");
  {
    // Not def_buffer: pybind11 lets an exception of its function out through the interpreter,
    // which ends the process; device memory must be a BufferError instead.
    auto* type = reinterpret_cast<PyTypeObject*>(memory_view_class.ptr());
    type->tp_as_buffer->bf_getbuffer = memory_view_getbuffer;
    type->tp_as_buffer->bf_releasebuffer = nullptr;
  }
  memory_view_class
      .def("__dlpack__", [](py::object self, py::object /*stream*/) {
             return to_dlpack(self.cast<memory_view&>(), self);
           }, py::arg("stream") = py::none())
      .def("__dlpack_device__", [](const memory_view& v) { return py::make_tuple(static_cast<int>(v.device), 0); })
      .def_property_readonly("nbytes", [](const memory_view& v) { return v.bytes; })
      .def_property_readonly("address", [](const memory_view& v) { return reinterpret_cast<std::uintptr_t>(v.data); });

  py::class_<core::allocation>(m, "Allocation")
      .def_readonly("offset", &core::allocation::offset)
      .def_readonly("bytes", &core::allocation::bytes)
      .def("__repr__", [](const core::allocation& a) {
        return "Allocation(offset=" + std::to_string(a.offset) + ", bytes=" + std::to_string(a.bytes) + ")";
      });
  bind_allocator<core::best_fit_allocator>(m, "BestFitAllocator",
                                           "Exact best fit (InfiniTensor LazyAllocator policy).");
  bind_allocator<core::tlsf_allocator>(m, "TlsfAllocator", "O(1) TLSF-family allocator.");
  m.attr("GROWING") = core::growing;
  m.attr("MAX_QUEUE_DEPTH") = io::max_queue_depth;  // io_uring's limit on one ring
  m.attr("SWAP_BLOCK_ALIGNMENT") = swap::io_alignment;  // swapper block sizes are multiples of it
  py::tuple engines(engine_kinds.size());
  for (std::size_t i = 0; i < engine_kinds.size(); ++i) engines[i] = std::string(io::to_string(engine_kinds[i]));
  m.attr("IO_ENGINES") = engines;  // the names an `engine` argument takes

  m.def("read_trace", [](const file_name& path) {
    python::require_numpy_abi("read_trace");
    // Other threads run meanwhile: a pipe's writer may be one of them.
    const std::vector<core::buffer> b = python::call_resuming_after_signals([&] { return trace::read_trace(path); });
    py::array_t<std::uint64_t> lower(static_cast<py::ssize_t>(b.size()));
    py::array_t<std::uint64_t> upper(static_cast<py::ssize_t>(b.size()));
    py::array_t<std::uint64_t> size(static_cast<py::ssize_t>(b.size()));
    py::list ids;
    for (std::size_t i = 0; i < b.size(); ++i) {
      lower.mutable_at(static_cast<py::ssize_t>(i)) = b[i].lower;
      upper.mutable_at(static_cast<py::ssize_t>(i)) = b[i].upper;
      size.mutable_at(static_cast<py::ssize_t>(i)) = b[i].bytes;
      ids.append(b[i].id);
    }
    py::dict d;
    d["id"] = ids;
    d["lower"] = lower;
    d["upper"] = upper;
    d["size"] = size;
    return d;
  }, py::arg("path"), "Reads an id,lower,upper,size trace into numpy arrays.");

  m.def("lower_bound", [](const py::handle& lower, const py::handle& upper, const py::handle& size,
                          u64 alignment) {
    const auto buffers = buffers_from(lower, upper, size);
    py::gil_scoped_release release;
    return core::lower_bound(buffers, alignment);
  }, py::arg("lower"), py::arg("upper"), py::arg("size"), py::arg("alignment") = 1);

  m.def("plan", [](const py::handle& lower, const py::handle& upper, const py::handle& size,
                   double time_limit, u64 alignment, u64 seed, const py::object& stop,
                   const py::object& progress) {
    if (!stop.is_none() && !py::hasattr(stop, "is_set")) {
      throw py::type_error("plan: stop must be None or have is_set() (a threading.Event), not " + type_name(stop));
    }
    if (!progress.is_none() && !PyCallable_Check(progress.ptr())) {
      throw py::type_error("plan: progress must be None or callable, not " + type_name(progress));
    }
    // Refused before the buffers are made where planning them would pass the process's
    // memory (the kernel's out-of-memory killer would end the interpreter).
    refuse_past_memory("plan", static_cast<std::size_t>(py::len(lower)), "buffers", "buffer", core::plan_bytes_per_buffer);
    const auto buffers = buffers_from(lower, upper, size);
    core::plan_options o;
    o.time_limit_seconds = time_limit;
    o.alignment = alignment;
    o.seed = seed;
    const core::plan_result r = plan_interruptibly(buffers, o, stop, progress);
    py::dict d;
    d["offsets"] = py::array_t<std::uint64_t>(static_cast<py::ssize_t>(r.offsets.size()), r.offsets.data());
    d["arena_bytes"] = r.arena_bytes;
    d["lower_bound"] = r.lower_bound;
    d["ratio"] = r.ratio();
    d["strategy"] = r.strategy;
    d["optimal"] = r.optimal;
    d["seconds"] = r.seconds;
    d["first_plan_seconds"] = r.first_plan_seconds;
    d["best_plan_seconds"] = r.best_plan_seconds;
    d["greedy_seconds"] = r.greedy_seconds;
    d["stopped"] = r.stopped;
    d["fallback"] = r.fallback;
    return d;
  }, py::arg("lower"), py::arg("upper"), py::arg("size"), py::arg("time_limit") = 10.0,
     py::arg("alignment") = 1, py::arg("seed") = 1, py::arg("stop") = py::none(),
     py::arg("progress") = py::none(),
     "Plans buffers with half-open lifetimes [lower, upper) in one arena. 'optimal' is True when no "
     "plan has a smaller arena (at the lower bound, or proven by the search), and the planner then "
     "returns before its time limit. stop: None or a "
     "threading.Event (anything with is_set()); once set, the planner stops within about 0.1 s and the "
     "best plan so far is returned, with 'stopped' True. progress: None or a callable, called on this "
     "thread, at most about ten times a second, with a dict (seconds, best_arena_bytes, lower_bound, "
     "phase). Ctrl-C, or an exception raised by a signal handler, is_set() or progress, stops the "
     "planner too and is raised; that plan is dropped.");

  // The C++ graph front end: operators over tensors of known sizes, their lifetimes.
  py::class_<core::graph>(m, "OperatorGraph", "Operators in execution order over tensors of known sizes.")
      .def(py::init<>())
      .def("add_tensor", [](core::graph& g, std::string name, u64 bytes, const std::string& role) {
             static const std::map<std::string, core::tensor_role> roles = {
                 {"activation", core::tensor_role::activation}, {"weight", core::tensor_role::weight},
                 {"input", core::tensor_role::graph_input}, {"output", core::tensor_role::graph_output}};
             const auto it = roles.find(role);
             if (it == roles.end()) {
               throw std::invalid_argument("role must be activation, weight, input or output, not '" + role + "'");
             }
             return g.add_tensor(std::move(name), bytes, it->second);
           }, py::arg("name"), py::arg("bytes"), py::arg("role") = "activation", "Adds a tensor; returns its index.")
      .def("add_op", &core::graph::add_op, py::arg("name"), py::arg("inputs"), py::arg("outputs"),
           "Appends an op (tensor indices in and out) that runs after every op added before it.")
      .def_property_readonly("tensors", [](const core::graph& g) {
        py::list out;
        static const char* names[] = {"activation", "weight", "input", "output"};
        for (const core::graph_tensor& t : g.tensors()) {
          out.append(py::make_tuple(t.name, t.bytes, names[static_cast<int>(t.role)]));
        }
        return out;
      })
      .def_property_readonly("ops", [](const core::graph& g) {
        py::list out;
        for (const core::graph_op& o : g.ops()) out.append(py::make_tuple(o.name, o.inputs, o.outputs));
        return out;
      });
  m.def("derive_lifetimes", [](const core::graph& g, u64 weight_alignment) {
    python::require_numpy_abi("derive_lifetimes");
    const core::graph_lifetimes life = core::derive_lifetimes(g, weight_alignment);
    const auto n = static_cast<py::ssize_t>(life.buffers.size());
    py::array_t<std::uint64_t> lower(n), upper(n), size(n);
    py::list ids;
    for (py::ssize_t i = 0; i < n; ++i) {
      const core::buffer& b = life.buffers[static_cast<std::size_t>(i)];
      lower.mutable_at(i) = b.lower;
      upper.mutable_at(i) = b.upper;
      size.mutable_at(i) = b.bytes;
      ids.append(b.id);
    }
    py::dict d;
    d["id"] = ids;
    d["lower"] = lower;
    d["upper"] = upper;
    d["size"] = size;
    d["tensor_of"] = life.tensor_of;
    d["weight_bytes"] = life.weight_bytes;
    d["steps"] = life.steps;
    return d;
  }, py::arg("graph"), py::arg("weight_alignment") = 256,
     "Buffer lifetimes of a graph run (activations freed after their last consumer).");
  m.def("make_transformer_step", [](whole<std::uint32_t> layers, u64 hidden, u64 heads, u64 sequence, u64 batch,
                                     u64 vocabulary, u64 dtype_bytes) {
    return core::make_transformer_step({layers, hidden, heads, sequence, batch, vocabulary, dtype_bytes});
  }, py::arg("layers") = 12, py::arg("hidden") = 768, py::arg("heads") = 12, py::arg("sequence") = 1024,
     py::arg("batch") = 8, py::arg("vocabulary") = 50257, py::arg("dtype_bytes") = 2,
     "The demo's model: one training step of a GPT-style transformer, as an OperatorGraph.");

  m.def("_write_file", [](const file_name& path, const std::string& text) {
    // (A pipe's reader may be another thread.)
    python::call_resuming_after_signals([&] {
      trace::detail::write_file(path, [&](std::ostream& out) { out.write(text.data(), static_cast<std::streamsize>(text.size())); });
      return 0;
    });
  }, py::arg("path"), py::arg("text"),
     "Writes text (UTF-8) to a file as the library writes its traces and pictures: a regular file there is "
     "replaced only once the new text is whole, so a failed write (a full disk) keeps it; OSError otherwise.");

  m.def("write_plan_picture", [](const file_name& name, const py::handle& lower, const py::handle& upper,
                                 const py::handle& size, const py::handle& offsets, u64 arena_bytes,
                                 u64 lower_bound, const std::string& title, const py::object& ids) {
    const std::string& path = name;
    auto buffers = buffers_from(lower, upper, size);
    if (!ids.is_none()) {
      const auto names = ids.cast<std::vector<std::string>>();
      if (names.size() != buffers.size()) throw std::invalid_argument("ids: one per buffer");
      for (std::size_t i = 0; i < buffers.size(); ++i) buffers[i].id = names[i];
    }
    const std::vector<std::uint64_t> off = unsigned_array(offsets, "offsets");
    if (off.size() != buffers.size()) throw std::invalid_argument("offsets: one per buffer");
    // (A pipe's reader may be another thread.)
    return python::call_resuming_after_signals([&] {
      if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".html") == 0) {
        return trace::write_plan_html(path, buffers, off, arena_bytes, lower_bound, title);
      }
      return trace::write_plan_svg(path, buffers, off, arena_bytes, lower_bound);
    });
  }, py::arg("path"), py::arg("lower"), py::arg("upper"), py::arg("size"), py::arg("offsets"), py::arg("arena_bytes"),
     py::arg("lower_bound"), py::arg("title") = "plan", py::arg("ids") = py::none(),
     "Draws a plan: an interactive page when the path ends in .html, else an SVG picture. Returns what is "
     "wrong with the plan (validate's message, also shown in the picture), empty when it is valid.");

  m.def("validate", [](const py::handle& lower, const py::handle& upper, const py::handle& size,
                       const py::handle& offsets, u64 arena_bytes, u64 alignment) {
    const std::vector<std::uint64_t> off = unsigned_array(offsets, "offsets");
    const auto buffers = buffers_from(lower, upper, size);
    py::gil_scoped_release release;
    return core::validate(buffers, off, arena_bytes, alignment);
  }, py::arg("lower"), py::arg("upper"), py::arg("size"), py::arg("offsets"), py::arg("arena_bytes"),
     py::arg("alignment") = 1, "Empty string when the plan is valid, else what is wrong.");

  py::class_<py_arena>(m, "ContiguousArena", "A host buffer that hands out tensors and defragments.")
      .def(py::init<u64, u64, const std::string&, const std::string&>(), py::arg("capacity"),
           py::arg("alignment") = 256, py::arg("policy") = "minimal", py::arg("device") = "cpu")
      .def("allocate", &py_arena::allocate, py::arg("bytes"),
           "Returns (id, offset); may defragment first; MemoryError when free bytes are short.")
      .def("release", &py_arena::release, py::arg("id"))
      .def("offset", &py_arena::offset, py::arg("id"))
      .def("take_moves", &py_arena::take_moves,
           "(id, new_offset) of every tensor moved since the last call.")
      .def("buffer", [](py::object self) { return self.cast<py_arena&>().view(self); },
           "The whole arena as a MemoryView (no copy).")
      .def("print_allocation", [](py_arena& a, whole<std::size_t> r) { return a.get().print_allocation(r); },
           py::arg("resolution") = 200)
      .def("allocation_svg",
           [](py_arena& a) {
             std::ostringstream out;
             const trace::arena_snapshot now = trace::snapshot(a.get(), "now");
             trace::write_arena_svg(out, {&now, 1}, a.get().capacity());
             return out.str();
           },
           "The map as an SVG picture: each tensor by offset with its id, size and padding.")
      .def("max_allocated", [](py_arena& a) { return a.get().max_allocated(); })
      .def("stats", [](py_arena& a) {
        const arena::arena_stats s = a.get().stats();
        py::dict d;
        d["capacity_bytes"] = s.capacity_bytes;
        d["used_bytes"] = s.used_bytes;
        d["free_bytes"] = s.free_bytes;
        d["largest_free_bytes"] = s.largest_free_bytes;
        d["max_allocated_bytes"] = s.max_allocated_bytes;
        d["defragmentations"] = s.defragmentations;
        d["bytes_moved"] = s.bytes_moved;
        d["moves"] = s.moves;
        return d;
      });

  // Registered before PinnedPool, whose allocate() signature names it.
  auto pinned_class =
      py::class_<pinned_buffer, std::shared_ptr<pinned_buffer>>(m, "PinnedBuffer", py::buffer_protocol());
  {
    // pybind11's buffer procedures cannot count exports: ours replace them.
    auto* type = reinterpret_cast<PyTypeObject*>(pinned_class.ptr());
    type->tp_as_buffer->bf_getbuffer = pinned_getbuffer;
    type->tp_as_buffer->bf_releasebuffer = pinned_releasebuffer;
  }
  pinned_class
      .def("__dlpack__", [](py::object self, py::object) {
             auto buffer = self.cast<std::shared_ptr<pinned_buffer>>();
             if (!buffer->live) throw py::buffer_error("PinnedBuffer was freed");
             ++buffer->exports;
             return to_dlpack(memory_view{buffer->data, buffer->bytes, py::none()}, self,
                              [buffer] { --buffer->exports; });
           }, py::arg("stream") = py::none())
      .def("__dlpack_device__", [](const pinned_buffer&) { return py::make_tuple(static_cast<int>(kDLCPU), 0); })
      .def("free", &pinned_buffer::free,
           "Returns the memory to the pool now; BufferError while views of it are alive, or when "
           "already freed.")
      .def_property_readonly("exports", [](const pinned_buffer& b) { return b.exports; })
      .def_property_readonly("freed", [](const pinned_buffer& b) { return !b.live; })
      .def_property_readonly("nbytes", [](const pinned_buffer& b) { return b.live ? b.bytes : std::size_t{0}; },
                             "Bytes of the buffer; 0 once freed.")
      .def_property_readonly("address", [](const pinned_buffer& b) {
             if (!b.live) throw py::buffer_error("PinnedBuffer was freed: it has no address");
             return reinterpret_cast<std::uintptr_t>(b.data);
           }, "Address of the first byte; BufferError once freed (the pool may have handed it out again).");

  py::class_<memory::pinned_pool, std::shared_ptr<memory::pinned_pool>>(m, "PinnedPool",
                                                                       "Page-locked host memory, pooled.")
      .def(py::init([](whole<std::size_t> slab_bytes, bool allow_unlocked_fallback, bool register_with_cuda) {
             return std::make_shared<memory::pinned_pool>(memory::pool_options{
                 .slab_bytes = slab_bytes,
                 .allow_unlocked_fallback = allow_unlocked_fallback,
                 .register_with_cuda = register_with_cuda});
           }),
           py::arg("slab_bytes") = std::size_t{64} << 20, py::arg("allow_unlocked_fallback") = false,
           py::arg("register_with_cuda") = false,
           "register_with_cuda: also register every slab with CUDA (direct, asynchronous device "
           "copies); without a CUDA device it raises, saying why.")
      .def("allocate", [](std::shared_ptr<memory::pinned_pool> pool, whole<std::size_t> bytes) {
             auto buffer = std::make_shared<pinned_buffer>();
             buffer->pool = pool;
             {
               py::gil_scoped_release release;  // a new slab is mapped, populated and locked
               buffer->data = static_cast<std::byte*>(pool->allocate(bytes, 4096));
             }
             buffer->bytes = bytes;
             return buffer;
           }, py::arg("bytes"), "A 4096-aligned locked buffer (PinnedBuffer).")
      .def("stats", [](const memory::pinned_pool& pool) {
        const memory::pool_stats s = pool.stats();
        py::dict d;
        d["slabs"] = s.slabs;
        d["locked_bytes"] = s.locked_bytes;
        d["in_use_bytes"] = s.in_use_bytes;
        d["allocations"] = s.allocations;
        d["system_calls"] = s.system_calls;
        d["unlocked_fallbacks"] = s.unlocked_fallbacks;
        d["current_slab_bytes"] = s.current_slab_bytes;
        d["registered_bytes"] = s.registered_bytes;
        d["slab_bytes"] = s.slab_bytes;
        d["peak_in_use_bytes"] = s.peak_in_use_bytes;
        d["total_allocations"] = s.total_allocations;
        return d;
      })
      .def("trim", [](memory::pinned_pool& pool) {
             py::gil_scoped_release release;
             pool.trim();
           }, "Unmaps the slabs no live buffer uses (kept for reuse until then).");

  m.attr("PYBIND11_VERSION") = python::pybind11_version();  // the pybind11 this module was built with
  m.def("numpy_abi_problem", &python::numpy_abi_problem,
        "Empty when this build reads the loaded numpy's arrays correctly, else why not (pybind11 < 2.12 "
        "with numpy 2).");
  m.def("cuda_built", &memory::cuda_built, "True when the CUDA resources were compiled in.");
  m.def("physical_memory_bytes", &memory::physical_memory_bytes,
        "The memory this process can have in bytes: the machine's, or its memory cgroup's limit where lower "
        "(2^64 - 1 when neither can be read).");
  m.def("cgroup_memory_limit_bytes", &memory::cgroup_memory_limit_bytes,
        "The lowest memory limit of this process's cgroup and its ancestors (2^64 - 1 when none).");
  m.def("cgroup_memory_available_bytes", &memory::cgroup_memory_available_bytes,
        "What this process's cgroup and its ancestors leave for new allocations now: the lowest limit less "
        "usage, inactive file cache counted as free (2^64 - 1 when no cgroup has a limit).");
  m.def("cuda_unavailable_reason", [] {
    py::gil_scoped_release release;
    return memory::cuda_unavailable_reason();
  }, "Empty when a CUDA device can be used, else why not (no driver, no device, not built).");

  py::class_<py_swapper>(m, "TensorSwapper", "Tensors out to files and back on io_uring.")
      .def(py::init([](std::shared_ptr<memory::pinned_pool> pool, whole<unsigned> queue_depth,
                       whole<std::size_t> block_bytes, whole<std::size_t> staging_buffers, bool direct,
                       bool checksums, const std::string& engine, bool reuse_files, whole<std::size_t> pack_below) {
             return std::make_unique<py_swapper>(
                 pool, swap::swap_options{.engine = engine_of(engine), .queue_depth = queue_depth,
                                          .block_bytes = block_bytes, .staging_buffers = staging_buffers,
                                          .direct = direct, .checksums = checksums,
                                          .reuse_files = reuse_files, .pack_below = pack_below});
           }),
           py::arg("pool"), py::arg("queue_depth") = 32, py::arg("block_bytes") = std::size_t{1} << 20,
           py::arg("staging_buffers") = 8, py::arg("direct") = true, py::arg("checksums") = true,
           py::arg("engine") = "uring", py::arg("reuse_files") = true, py::arg("pack_below") = 0,
           "pack_below: tensors of at most this many bytes go into one unnamed pack file per "
           "directory, read back by this swapper (no file at the path); 0 = a file per tensor. "
           "staging_buffers: where the pool may lock fewer (RLIMIT_MEMLOCK, no unlocked fallback), the "
           "swapper keeps those it got, two or more; stats()['staging_buffers'] and ['fallback'] say so.")
      .def("swap_out", [](py_swapper& s, const std::vector<py::object>& tensors,
                          const std::vector<file_name>& paths, const std::vector<python::name_text>& keys) {
             return s.start(tensors, paths, keys, true);
           }, py::arg("tensors"), py::arg("paths"), py::arg("keys") = std::vector<python::name_text>{},
           "Queues the writes; returns a ticket. tensors: contiguous buffers (numpy arrays...) or CPU "
           "torch tensors. The buffers are held (not resizable) until wait(), torch tensors by reference "
           "with their storage: one given other memory before wait() (set_, .data =) keeps the memory the "
           "transfer uses alive (a swap-in into it then fails, EFAULT), and a resize_ that would free that memory "
           "raises RuntimeError (where tensormem.torch.size_hold_problem() is empty; else it is warned once, "
           "and must not be done). None may change before it. keys: the identity recorded per file (default: "
           "the path).")
      .def("swap_in", [](py_swapper& s, const std::vector<file_name>& paths,
                         const std::vector<py::object>& tensors, const std::vector<python::name_text>& keys) {
             return s.start(tensors, paths, keys, false);
           }, py::arg("paths"), py::arg("tensors"), py::arg("keys") = std::vector<python::name_text>{},
           "Queues the reads; returns a ticket. tensors as for swap_out, writable. A torch tensor's version "
           "(t._version) counts the swap-in as an in-place change once queued, as copy_ would: autograd refuses "
           "a backward through values saved before it.")
      .def("wait", [](py_swapper& s, u64 ticket) { return results_to_python(s.wait(ticket)); },
           py::arg("ticket"), "One dict per tensor: path, bytes, error (errno or 0), message. Ctrl-C raises "
           "KeyboardInterrupt; the ticket stays outstanding, its buffers held, to be waited for again.")
      .def("done", [](py_swapper& s, u64 ticket) {
             py::gil_scoped_release release;
             return s.get().done(ticket);
           }, py::arg("ticket"), "True when every transfer of the ticket finished (wait() would not block).")
      .def("outstanding", [](py_swapper& s, u64 ticket) {
             py::gil_scoped_release release;
             return s.get().outstanding(ticket);
           }, py::arg("ticket"),
           "True until the ticket is collected by wait() or synchronize(), from any thread; after "
           "that its buffers are no longer held.")
      .def("discard", [](py_swapper& s, const file_name& path) {
             py::gil_scoped_release release;
             s.get().discard(path);
           }, py::arg("path"), "Frees a packed tensor's slot and deletes the path's files.")
      .def("synchronize", &py_swapper::synchronize,
           "Waits for every ticket (results dropped). Ctrl-C raises KeyboardInterrupt; tickets not yet "
           "collected stay outstanding.")
      .def("timers", [](py_swapper& s) { return s.get().timers(); })
      .def("stats", [](py_swapper& s) {
        const swap::swap_stats st = s.get().stats();
        py::dict d;
        d["tensors_out"] = st.tensors_out;
        d["tensors_in"] = st.tensors_in;
        d["bytes_out"] = st.bytes_out;
        d["bytes_in"] = st.bytes_in;
        d["failed"] = st.failed;
        d["write_gbps"] = st.write_gbps();
        d["read_gbps"] = st.read_gbps();
        d["engine"] = st.engine;
        d["direct"] = st.direct;
        d["checksums"] = st.checksums;
        d["fallback"] = st.fallback;
        d["synchronous_requests"] = st.synchronous_requests;
        d["registered_staging"] = st.registered_staging;
        d["staging_buffers"] = st.staging_buffers;
        d["packed_tensors"] = st.packed_tensors;
        d["pack_file_bytes"] = st.pack_file_bytes;
        return d;
      });

  // Raw file I/O of memory the caller owns, given by address: the private engine of
  // tensormem.deepspeed.aio_handle (which keeps the tensors alive until wait()).
  py::class_<io::async_file_io>(m, "AsyncFileIO",
                                "Raw reads and writes of memory given by address (see tensormem.deepspeed).")
      .def(py::init([](whole<std::size_t> block_bytes, whole<unsigned> queue_depth, whole<unsigned> rings, const std::string& engine,
                       bool direct) {
             io::file_io_options o;
             o.block_bytes = block_bytes;
             o.queue_depth = queue_depth;
             o.rings = rings;
             o.engine = engine_of(engine);
             o.direct = direct;
             return std::make_unique<io::async_file_io>(o);
           }),
           py::arg("block_bytes") = std::size_t{1} << 20, py::arg("queue_depth") = 128, py::arg("rings") = 1,
           py::arg("engine") = "uring", py::arg("direct") = true)
      .def("read", [](io::async_file_io& io, std::uintptr_t address, whole<std::size_t> bytes, const file_name& path,
                      u64 offset, bool validate) {
             py::gil_scoped_release release;
             return io.read(reinterpret_cast<void*>(address), bytes, path, offset, validate);
           }, "Queues a read; returns its ticket (named by a failure that wait() reports).", py::arg("address"), py::arg("bytes"), py::arg("path"), py::arg("offset") = 0, py::arg("validate") = false)
      .def("write", [](io::async_file_io& io, std::uintptr_t address, whole<std::size_t> bytes, const file_name& path,
                       u64 offset, bool validate) {
             py::gil_scoped_release release;
             return io.write(reinterpret_cast<const void*>(address), bytes, path, offset, validate);
           }, "Queues a write; returns its ticket.", py::arg("address"), py::arg("bytes"), py::arg("path"), py::arg("offset") = 0, py::arg("validate") = false)
      .def("wait", [](io::async_file_io& io) {
             std::optional<io::async_file_io::wait_result> r;
             wait_answering_signals([&](auto deadline) {
               r = io.wait_until(deadline);
               return r.has_value();
             });
             py::list errors;
             for (const io::file_io_error& e : r->errors) errors.append(py::make_tuple(python_file_name(e.path), e.error, message_text(e.message), e.ticket));
             return py::make_tuple(r->completed, errors);
           }, "Waits for every queued operation: (completed, [(path, errno, message, ticket) per failure]). "
              "Ctrl-C raises KeyboardInterrupt and collects nothing: the operations go on, their buffers "
              "in use, and a later wait() collects them.")
      .def("pending", &io::async_file_io::pending)
      .def("stats", [](const io::async_file_io& io) {
        const io::file_io_stats st = io.stats();
        py::dict d;
        d["ops"] = st.ops;
        d["failed"] = st.failed;
        d["bytes_read"] = st.bytes_read;
        d["bytes_written"] = st.bytes_written;
        d["direct_ops"] = st.direct_ops;
        d["buffered_ops"] = st.buffered_ops;
        d["requests"] = st.requests;
        d["synchronous_requests"] = st.synchronous_requests;
        d["engine"] = st.engine;
        d["fallback"] = st.fallback;
        return d;
      });
  bind_offload(m);
}
