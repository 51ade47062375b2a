#include "tensormem/memory/host_resource.hpp"

#include <new>
#include <string>

#include "tensormem/memory/errors.hpp"

namespace tensormem::memory {

void* host_resource::do_allocate(std::size_t bytes, std::size_t alignment) {
  void* p = ::operator new(bytes, std::align_val_t{alignment}, std::nothrow);
  if (p == nullptr) {
    throw out_of_memory("host_resource: cannot allocate " + std::to_string(bytes) +
                        " bytes aligned to " + std::to_string(alignment));
  }
  return p;
}

void host_resource::do_deallocate(void* p, std::size_t /*bytes*/,
                                  std::size_t alignment) noexcept {
  ::operator delete(p, std::align_val_t{alignment});
}

}  // namespace tensormem::memory
