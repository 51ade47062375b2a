#include "tensormem/memory/pinned_pool.hpp"

#include <algorithm>
#include <bit>
#include <stdexcept>
#include <string>

#include "tensormem/memory/detail/poison.hpp"
#include "tensormem/memory/errors.hpp"

namespace tensormem::memory {

pinned_pool::pinned_pool(pool_options options)
    : options_(options), upstream_(pinned_options{options.allow_unlocked_fallback, options.register_with_cuda}) {
  if (!std::has_single_bit(options_.alignment) ||
      options_.alignment > pinned_host_resource::page_bytes()) {
    throw std::invalid_argument("pinned_pool: alignment " + std::to_string(options_.alignment) +
                                " must be a power of two no larger than a page");
  }
  if (options_.slab_bytes == 0) throw std::invalid_argument("pinned_pool: slab_bytes is 0");
  const std::size_t page = pinned_host_resource::page_bytes();
  options_.slab_bytes = (options_.slab_bytes + page - 1) / page * page;
  slab_size_ = options_.slab_bytes;
}

pinned_pool::~pinned_pool() {
  for (auto& s : slabs_) detail::unpoison(s->base, s->bytes);
  for (auto& s : slabs_) upstream_.deallocate(s->base, s->bytes, pinned_host_resource::page_bytes());
}

// Maps a slab of `bytes` (outside the pool's lock, which `lock` holds on entry and on
// return) and adds it. The bytes count against max_locked_bytes while they are mapped, so
// that threads mapping at once cannot pass the cap together. Other threads allocate from
// existing slabs and free meanwhile, and a fork() does not wait for the system calls.
pinned_pool::slab& pinned_pool::add_slab(pool_lock& lock, std::size_t bytes, bool dedicated, bool locked_only) {
  const std::uint64_t committed = slab_bytes_total_ + mapping_bytes_;
  if (bytes > options_.max_locked_bytes - std::min<std::uint64_t>(committed, options_.max_locked_bytes)) {
    throw out_of_memory("pinned_pool: a slab of " + std::to_string(bytes) +
                        " bytes would pass the cap of " + std::to_string(options_.max_locked_bytes) +
                        " locked bytes (" + std::to_string(slab_bytes_total_) + " in slabs, " +
                        std::to_string(mapping_bytes_) + " being mapped, " + std::to_string(in_use_) +
                        " in use)");
  }
  const std::size_t page = pinned_host_resource::page_bytes();
  mapping_bytes_ += bytes;
  std::byte* base = nullptr;
  lock.unlock();
  try {
    base = static_cast<std::byte*>(locked_only ? upstream_.allocate_locked(bytes, page)
                                               : upstream_.allocate(bytes, page));
    detail::poison(base, bytes);  // nothing in it is handed out yet
  } catch (...) {
    lock.lock();
    mapping_bytes_ -= bytes;
    throw;
  }
  lock.lock();
  mapping_bytes_ -= bytes;
  try {
    auto made = std::make_unique<slab>(base, bytes, dedicated, options_.alignment);
    made->offsets.reserve(2);  // the first allocation in it then allocates no node (cannot fail)
    slabs_.push_back(std::move(made));
  } catch (...) {
    detail::unpoison(base, bytes);
    upstream_.deallocate(base, bytes, page);
    throw;
  }
  slab_bytes_total_ += bytes;
  return *slabs_.back();
}

// Takes slab s out of the pool; its memory stays mapped until unmap_slab.
void pinned_pool::detach_slab(slab* s) noexcept {
  slab_bytes_total_ -= s->bytes;
  const auto it = std::find_if(slabs_.begin(), slabs_.end(),
                               [s](const std::unique_ptr<slab>& x) { return x.get() == s; });
  if (it != slabs_.end()) {
    it->release();  // the caller's s now owns it
    slabs_.erase(it);
  }
}

void pinned_pool::unmap_slab(slab* s) noexcept {
  detail::unpoison(s->base, s->bytes);  // the pages may be mapped again for anything
  upstream_.deallocate(s->base, s->bytes, pinned_host_resource::page_bytes());
  delete s;
}

// A block of `need` bytes in the first shared slab that has room, else in a new slab (its
// own when `need` is more than a slab). Where the memory-lock limit refuses a shared slab,
// slabs of half the size are tried, down to the pages `need` takes, and later shared slabs
// are made at the size that was locked: a request the limit leaves room for is locked (the
// unlocked fallback, where allowed, only for one that does not fit). While a slab is mapped
// the lock is let go (add_slab): another thread may add a slab meanwhile, which is looked
// at again before this one is mapped.
std::pair<pinned_pool::slab*, core::allocation> pinned_pool::place(pool_lock& lock, std::size_t need, bool& made) {
  made = false;
  const std::size_t page = pinned_host_resource::page_bytes();
  const std::size_t own = (need + page - 1) / page * page;
  for (;;) {
    for (auto& s : slabs_) {
      if (s->dedicated) continue;
      if (const auto where = s->offsets.allocate(need)) return {s.get(), *where};
    }
    if (need > slab_size_) {
      slab& s = add_slab(lock, own, true);
      made = true;
      return {&s, *s.offsets.allocate(need)};
    }
    const std::size_t size = slab_size_;
    const bool smallest = size <= own;  // no smaller slab holds the request
    try {
      slab& s = add_slab(lock, size, false, !smallest);
      made = true;
      if (const auto where = s.offsets.allocate(need)) return {&s, *where};
      // (a new shared slab of at least `own` bytes always holds the request)
    } catch (const lock_limit_error&) {
      if (smallest) throw;
      // Halved once for this refusal, unless another thread has changed the size meanwhile.
      if (slab_size_ == size) slab_size_ = std::max(own, (size / 2 + page - 1) / page * page);
    }
  }
}

void* pinned_pool::do_allocate(std::size_t bytes, std::size_t alignment) {
  made_.refuse_allocation_in_child("a pinned_pool");
  // Alignments above the pool's unit (up to a page): a block of whole alignment units is
  // tried first and kept when it starts aligned, which it always does in a pool used with one
  // such alignment (slabs start on a page, and every block and hole is then a multiple of the
  // alignment). Otherwise, and above a page, a block with room to align inside: it used to be
  // taken every time, up to 3,840 more locked bytes for each 4096-aligned buffer.
  const std::size_t slack = alignment > options_.alignment ? alignment - options_.alignment : 0;
  if (bytes > std::numeric_limits<std::size_t>::max() / 2 - slack) {
    throw out_of_memory("pinned_pool: " + std::to_string(bytes) + " bytes cannot be allocated");
  }
  const bool try_whole_units = slack != 0 && alignment <= pinned_host_resource::page_bytes();
  pool_lock lock(mutex_);
  bool made = false;  // whether place made the slab (which the strong guarantee then takes away)
  auto [owner, where] =
      place(lock, try_whole_units ? (bytes + alignment - 1) / alignment * alignment : bytes + slack, made);
  auto addr = reinterpret_cast<std::uintptr_t>(owner->base + where.offset);
  if (try_whole_units && addr % alignment != 0) {
    owner->offsets.deallocate(where);  // (an existing shared slab: a new one starts on a page)
    std::tie(owner, where) = place(lock, bytes + slack, made);
    addr = reinterpret_cast<std::uintptr_t>(owner->base + where.offset);
  }
  addr = (addr + alignment - 1) / alignment * alignment;
  void* p = reinterpret_cast<void*>(addr);
  try {
    live_.emplace(p, live{owner, where});
  } catch (...) {
    owner->offsets.deallocate(where);
    if (made) {  // no slab stays behind a failed allocation (an empty one of its own would until trim)
      detach_slab(owner);
      unmap_slab(owner);
    }
    throw;
  }
  in_use_ += where.bytes;
  peak_in_use_ = std::max(peak_in_use_, in_use_);
  ++total_allocations_;
  detail::unpoison(p, bytes);
  return p;
}

void* pinned_pool::allocate(std::size_t elements, dtype type) {
  const std::size_t size = dtype_bytes(type);
  if (elements > std::numeric_limits<std::size_t>::max() / size) {
    throw out_of_memory("pinned_pool: " + std::to_string(elements) + " elements of " +
                        std::string(to_string(type)) + " overflow");
  }
  return memory_resource::allocate(elements * size, options_.alignment);
}

bool pinned_pool::free(void* p) noexcept {
  slab* emptied = nullptr;  // a slab of its own, unmapped after the lock is let go
  {
    const std::lock_guard lock(mutex_);
    const auto it = live_.find(p);
    if (it == live_.end()) return false;
    const live l = it->second;
    live_.erase(it);
    l.owner->offsets.deallocate(l.where);
    detail::poison(l.owner->base + l.where.offset, static_cast<std::size_t>(l.where.bytes));
    in_use_ -= l.where.bytes;
    if (l.owner->dedicated) {
      detach_slab(l.owner);
      emptied = l.owner;
    }
  }
  if (emptied != nullptr) unmap_slab(emptied);
  return true;
}

void pinned_pool::do_deallocate(void* p, std::size_t /*bytes*/, std::size_t /*alignment*/) noexcept {
  free(p);
}

bool pinned_pool::owns(const void* p) const {
  const std::lock_guard lock(mutex_);
  return live_.contains(p);
}

void pinned_pool::trim() noexcept {
  // Releases one empty slab at a time (no list of them is built, so nothing allocates), each
  // unmapped with the lock let go.
  for (;;) {
    slab* s = nullptr;
    {
      const std::lock_guard lock(mutex_);
      const auto it = std::find_if(slabs_.begin(), slabs_.end(),
                                   [](const std::unique_ptr<slab>& x) { return x->offsets.used() == 0; });
      if (it == slabs_.end()) return;
      s = it->get();
      detach_slab(s);
    }
    unmap_slab(s);
  }
}

pool_stats pinned_pool::stats() const {
  const std::lock_guard lock(mutex_);
  const pinned_stats up = upstream_.stats();
  pool_stats s;
  s.slabs = slabs_.size();
  s.slab_bytes = slab_bytes_total_;
  s.locked_bytes = up.locked_bytes;
  s.in_use_bytes = in_use_;
  s.peak_in_use_bytes = peak_in_use_;
  s.allocations = live_.size();
  s.total_allocations = total_allocations_;
  s.system_calls = up.system_calls;
  s.unlocked_fallbacks = up.unlocked_fallbacks;
  s.registered_bytes = up.registered_bytes;
  s.current_slab_bytes = slab_size_;
  return s;
}

}  // namespace tensormem::memory
