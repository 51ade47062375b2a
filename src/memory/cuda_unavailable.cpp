// Stand-ins for the CUDA resources in a build without CUDA: they report why and throw.

#include "tensormem/memory/cuda_resources.hpp"
#include "tensormem/memory/errors.hpp"

namespace tensormem::memory {

namespace {
constexpr const char* reason = "built without CUDA (configure with TENSORMEM_CUDA=ON)";
}

bool cuda_built() noexcept { return false; }
std::string cuda_unavailable_reason() { return reason; }

void cuda_move(void*, const void*, std::size_t) { throw device_unavailable(reason); }
void cuda_register_host(void*, std::size_t) { throw device_unavailable(reason); }
void cuda_unregister_host(void*) noexcept {}

cuda_device_resource::cuda_device_resource() { throw device_unavailable(reason); }
void* cuda_device_resource::do_allocate(std::size_t, std::size_t) { throw device_unavailable(reason); }
void cuda_device_resource::do_deallocate(void*, std::size_t, std::size_t) noexcept {}

cuda_pinned_resource::cuda_pinned_resource() { throw device_unavailable(reason); }
void* cuda_pinned_resource::do_allocate(std::size_t, std::size_t) { throw device_unavailable(reason); }
void cuda_pinned_resource::do_deallocate(void*, std::size_t, std::size_t) noexcept {}

}  // namespace tensormem::memory
