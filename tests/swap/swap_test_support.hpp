#pragma once
// Helpers shared by the swapper tests: a scratch directory removed with its contents, and
// reproducible tensor bytes.

#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tensormem/io/io_engine.hpp"

namespace tensormem::swap::testing {

/// A fresh directory under the system's temporary directory; `path` is empty when it could
/// not be made.
struct scratch_dir {
  std::filesystem::path path;
  scratch_dir() {
    std::string templ = (std::filesystem::temp_directory_path() / "tensormem-swaptest-XXXXXX").string();
    if (mkdtemp(templ.data()) != nullptr) path = templ;
  }
  ~scratch_dir() {
    if (!path.empty()) std::filesystem::remove_all(path);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
};

/// `n` pseudo-random bytes determined by `seed`.
inline std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

/// An engine that hands everything to another; tests override what they observe or bend.
class forwarding_engine : public io::io_engine {
 public:
  explicit forwarding_engine(std::unique_ptr<io::io_engine> inner) : inner_(std::move(inner)) {}
  void submit(std::span<const io::io_request> requests) override { inner_->submit(requests); }
  std::vector<io::io_completion> wait(std::size_t min_completions) override { return inner_->wait(min_completions); }
  std::size_t outstanding() const noexcept override { return inner_->outstanding(); }
  io::engine_kind kind() const noexcept override { return inner_->kind(); }
  unsigned queue_depth() const noexcept override { return inner_->queue_depth(); }

 protected:
  std::unique_ptr<io::io_engine> inner_;
};

}  // namespace tensormem::swap::testing
