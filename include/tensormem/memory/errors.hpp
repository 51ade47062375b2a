#pragma once
// Typed errors of the memory layer.

#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tensormem::memory {

/// An allocation that could not be satisfied. The message names the bytes asked for and,
/// where known, what was available.
class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

/// Page-locking failed because RLIMIT_MEMLOCK (or the kernel) refused it. The message says
/// how many bytes were asked, the current limit and how to raise it.
class lock_limit_error : public out_of_memory {
 public:
  /// How a message from a resource that may fall back to unlocked memory ends.
  static constexpr std::string_view fallback_hint = ", or allow the unlocked fallback";

  lock_limit_error(std::string message, std::size_t requested_bytes, std::size_t limit_bytes)
      : out_of_memory(std::move(message)), requested_bytes_(requested_bytes),
        limit_bytes_(limit_bytes) {}
  std::size_t requested_bytes() const noexcept { return requested_bytes_; }
  /// RLIMIT_MEMLOCK's soft limit in bytes (SIZE_MAX when unlimited).
  std::size_t limit_bytes() const noexcept { return limit_bytes_; }
  /// The same error for a caller that has no unlocked fallback to offer: the message without
  /// `fallback_hint`, then `addendum` (what the caller can change instead).
  lock_limit_error without_fallback(const std::string& addendum) const {
    std::string message = what();
    if (message.size() >= fallback_hint.size() &&
        message.compare(message.size() - fallback_hint.size(), fallback_hint.size(), fallback_hint) == 0) {
      message.resize(message.size() - fallback_hint.size());
    }
    return lock_limit_error(message + addendum, requested_bytes_, limit_bytes_);
  }

 private:
  std::size_t requested_bytes_;
  std::size_t limit_bytes_;
};

/// A resource that needs hardware which is not there (no CUDA device, say).
class device_unavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// An allocation asked of a pinned resource or pool in a child process forked after it was
/// made, where none of its memory is locked (detail::fork_record). Python:
/// `tensormem.ForkedChildError`, as the I/O objects' refusal.
class forked_child_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

}  // namespace tensormem::memory
