#pragma once
// The resource interface every memory in tensormem is handed out through.

#include <cstddef>
#include <string_view>

namespace tensormem::memory {

enum class memory_kind {
  host,              ///< pageable host memory
  pinned_host,       ///< page-locked host memory (mlock)
  cuda_pinned_host,  ///< page-locked host memory registered with CUDA
  cuda_device,       ///< CUDA device memory: not addressable from the host
};

std::string_view to_string(memory_kind kind) noexcept;

/// A source of memory. The public functions are non-virtual and do the checks every
/// resource needs once; implementations override the private hooks.
///
/// Contract:
/// - `allocate(bytes, alignment)`: alignment must be a power of two (else
///   std::invalid_argument); the result is aligned to it and not null. A zero-byte request
///   returns a distinct pointer that must be deallocated like any other. Failure throws
///   out_of_memory (or a subclass) and changes nothing.
/// - `deallocate(p, bytes, alignment)` takes exactly what `allocate` returned and was given;
///   it never throws. Null is ignored.
/// - Whether a resource may be used from several threads at once is stated by
///   `thread_safe()`.
class memory_resource {
 public:
  memory_resource() = default;
  memory_resource(const memory_resource&) = delete;
  memory_resource& operator=(const memory_resource&) = delete;
  virtual ~memory_resource() = default;

  void* allocate(std::size_t bytes, std::size_t alignment = alignof(std::max_align_t));
  void deallocate(void* p, std::size_t bytes,
                  std::size_t alignment = alignof(std::max_align_t)) noexcept;
  memory_kind kind() const noexcept { return do_kind(); }
  bool thread_safe() const noexcept { return do_thread_safe(); }
  /// True when the host may read and write the memory directly.
  bool host_accessible() const noexcept { return kind() != memory_kind::cuda_device; }

 protected:
  /// The checks of `allocate` (an alignment that is a power of two, a size that can be padded
  /// to it): the size an implementation is asked for (1 for 0). For allocation paths of a
  /// resource's own beside `allocate`.
  static std::size_t checked_request(std::size_t bytes, std::size_t alignment);

 private:
  virtual void* do_allocate(std::size_t bytes, std::size_t alignment) = 0;
  virtual void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept = 0;
  virtual memory_kind do_kind() const noexcept = 0;
  virtual bool do_thread_safe() const noexcept = 0;
};

}  // namespace tensormem::memory
