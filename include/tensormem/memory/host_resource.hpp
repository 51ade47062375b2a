#pragma once
// Aligned pageable host memory.

#include "tensormem/memory/memory_resource.hpp"

namespace tensormem::memory {

/// Aligned `operator new` / `operator delete`. Thread-safe.
class host_resource final : public memory_resource {
 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  memory_kind do_kind() const noexcept override { return memory_kind::host; }
  bool do_thread_safe() const noexcept override { return true; }
};

}  // namespace tensormem::memory
