// PyTorch's own hook for CPU memory (c10::SetCPUAllocator): a wrapping allocator that records
// every allocation and free of CPU tensor memory while a capture runs; and holds on the size
// of a storage whose memory a transfer uses (StorageImpl's resizable flag). Built as its own
// module (tensormem._tensormem_torch) against the libc10 of the PyTorch its interpreter
// imports (python/CMakeLists.txt), so that `import tensormem` never needs libtorch.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// One record: (sequence number of the allocation, bytes, true for an allocation).
using event = std::tuple<std::uint64_t, std::uint64_t, bool>;

// c10::Allocator's interface as PyTorch 1.x declares it (`allocate` const) or as 2.x does
// (`allocate` not const, and `copy_data` to define); the derived class implements
// `make(n)`. Only the specialization for the headers at hand is instantiated.
template <class Base, bool Copies = requires(const Base& a, void* d, const void* s) { a.copy_data(d, s, 0); }>
struct allocator_interface;

template <class Base>
struct allocator_interface<Base, false> : Base {  // PyTorch 1.x
  c10::DataPtr allocate(size_t n) const override { return make(n); }
  virtual c10::DataPtr make(size_t n) const = 0;
};

template <class Base>
struct allocator_interface<Base, true> : Base {  // PyTorch 2.x
  c10::DataPtr allocate(size_t n) override { return make(n); }
  void copy_data(void* dest, const void* src, size_t count) const override { this->default_copy_data(dest, src, count); }
  virtual c10::DataPtr make(size_t n) const = 0;
};

class recording_allocator final : public allocator_interface<c10::Allocator> {
 public:
  // The data pointer is also the context (PyTorch's raw_allocate requires it): the wrapped
  // allocation is found again by its address when PyTorch frees it.
  c10::DataPtr make(size_t n) const override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // nothing to track (zero bytes)
    const std::lock_guard lock(mutex_);
    const std::uint64_t id = next_id_++;
    if (active_) events_.emplace_back(id, n, true);
    live_.emplace(data, entry{std::move(inner), id, session_});
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  // Starts recording: this allocator wraps the one PyTorch uses now.
  void start() {
    const std::lock_guard lock(mutex_);
    if (active_) throw std::logic_error("a capture is already running");
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current != this) inner_ = current;
    events_.clear();
    ++session_;
    active_ = true;
    c10::SetCPUAllocator(this, priority);
    if (c10::GetCPUAllocator() != this) {
      active_ = false;
      throw std::runtime_error("PyTorch kept its CPU allocator (a higher-priority one is set)");
    }
  }

  // Stops recording, gives PyTorch its allocator back and returns the events in order.
  std::vector<event> stop() {
    const std::lock_guard lock(mutex_);
    if (!active_) throw std::logic_error("no capture is running");
    active_ = false;
    c10::SetCPUAllocator(inner_, priority);
    return std::exchange(events_, {});
  }

  bool active() const {
    const std::lock_guard lock(mutex_);
    return active_;
  }

  static recording_allocator& instance() {
    // Never destroyed: tensors allocated through it may outlive everything else.
    static auto* a = new recording_allocator();
    return *a;
  }

 private:
  static constexpr std::uint8_t priority = 0;  // the default CPU allocator's priority

  struct entry {
    c10::DataPtr inner;  // frees the memory through the wrapped allocator
    std::uint64_t id;
    std::uint64_t session;
  };

  static void release(void* data) {
    recording_allocator& self = instance();
    c10::DataPtr inner;
    {
      const std::lock_guard lock(self.mutex_);
      const auto it = self.live_.find(data);
      if (it == self.live_.end()) return;  // cannot happen: every pointer handed out is listed
      if (self.active_ && it->second.session == self.session_) self.events_.emplace_back(it->second.id, 0, false);
      inner = std::move(it->second.inner);
      self.live_.erase(it);
    }
    // `inner` frees the memory here, outside the lock.
  }

  mutable std::mutex mutex_;
  mutable std::vector<event> events_;
  mutable std::unordered_map<void*, entry> live_;
  mutable std::uint64_t next_id_ = 0;
  std::uint64_t session_ = 0;
  bool active_ = false;
  c10::Allocator* inner_ = nullptr;
};

// Storages whose size is held: how many holds each has, and whether it was resizable before
// the first. A storage that is not resizable refuses `resize_` to more bytes than it has, of
// a tensor on it or of the storage itself, with a RuntimeError; growing a resizable one
// frees its memory. Touched with the GIL held; the mutex keeps it consistent regardless.
class size_holds {
 public:
  static size_holds& instance() {
    static auto* h = new size_holds();  // never destroyed: holds may be released at exit
    return *h;
  }
  void hold(c10::StorageImpl* s) {
    const std::lock_guard lock(mutex_);
    auto [it, first] = held_.try_emplace(s, 0, s->resizable());
    ++it->second.first;
    s->set_resizable(false);
  }
  void release(c10::StorageImpl* s) {
    const std::lock_guard lock(mutex_);
    const auto it = held_.find(s);
    if (it == held_.end() || --it->second.first != 0) return;
    s->set_resizable(it->second.second);
    held_.erase(it);
  }
  std::size_t count(c10::StorageImpl* s) {
    const std::lock_guard lock(mutex_);
    const auto it = held_.find(s);
    return it == held_.end() ? 0 : it->second.first;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<c10::StorageImpl*, std::pair<std::size_t, bool>> held_;
};

// One hold on a storage's size, for as long as this object lives; it keeps the storage (the
// Python object, and through it the StorageImpl) alive too.
class storage_size_hold {
 public:
  explicit storage_size_hold(py::object storage) : storage_(std::move(storage)), impl_(storage_impl(storage_)) {
    size_holds::instance().hold(impl_);
  }
  storage_size_hold(const storage_size_hold&) = delete;
  storage_size_hold& operator=(const storage_size_hold&) = delete;
  ~storage_size_hold() { size_holds::instance().release(impl_); }
  std::size_t holds() const { return size_holds::instance().count(impl_); }

 private:
  // The StorageImpl of a torch storage (untyped, or typed as PyTorch 1.x's storage() gives),
  // whose `_cdata` is its address. Anything else is refused: a tensor's `_cdata` is the
  // address of a TensorImpl.
  static c10::StorageImpl* storage_impl(const py::object& storage) {
    const py::module_ torch = py::module_::import("torch");
    const bool is_storage =
        py::isinstance(storage, torch.attr("UntypedStorage")) || py::isinstance(storage, torch.attr("TypedStorage"));
    if (!is_storage) {
      throw py::type_error("StorageSizeHold: expected a torch storage (UntypedStorage or TypedStorage), not " +
                           py::str(py::type::of(storage).attr("__name__")).cast<std::string>());
    }
    auto* impl = reinterpret_cast<c10::StorageImpl*>(storage.attr("_cdata").cast<std::uintptr_t>());
    if (impl == nullptr) throw std::invalid_argument("StorageSizeHold: the storage has no StorageImpl");
    return impl;
  }

  py::object storage_;
  c10::StorageImpl* impl_;
};

}  // namespace

PYBIND11_MODULE(_tensormem_torch, m) {
  m.doc() = "tensormem's hook into PyTorch's CPU allocator (capture of allocations and frees)";
  m.def("start_capture", [] { recording_allocator::instance().start(); },
        "Records every CPU tensor allocation and free from now on.");
  m.def("stop_capture", [] { return recording_allocator::instance().stop(); },
        "Stops recording; returns [(id, bytes, is_allocation)] in order (frees carry 0 bytes).");
  m.def("capturing", [] { return recording_allocator::instance().active(); });
  py::class_<storage_size_hold>(m, "StorageSizeHold",
                                "Holds a torch storage's size while it lives: resize_ to more bytes than the "
                                "storage has raises RuntimeError instead of freeing memory a transfer uses. "
                                "Holds on one storage nest; the last one gone restores its resizable flag.")
      .def(py::init<py::object>(), py::arg("storage"))
      .def_property_readonly("holds", &storage_size_hold::holds, "Holds on this storage now.");
  // torch.__version__ of the PyTorch whose c10 this module was built against (defined by
  // python/CMakeLists.txt, which builds the module only against a PyTorch it asked).
  m.attr("TORCH_VERSION") = TENSORMEM_TORCH_VERSION;
}
