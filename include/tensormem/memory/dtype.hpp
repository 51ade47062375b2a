#pragma once
// Element types of tensors, for element-count allocation APIs.

#include <cstddef>
#include <string_view>

namespace tensormem::memory {

enum class dtype { f16, bf16, f32, f64, i8, u8, i16, i32, i64, boolean };

constexpr std::size_t dtype_bytes(dtype t) noexcept {
  switch (t) {
    case dtype::i8: case dtype::u8: case dtype::boolean: return 1;
    case dtype::f16: case dtype::bf16: case dtype::i16: return 2;
    case dtype::f32: case dtype::i32: return 4;
    case dtype::f64: case dtype::i64: return 8;
  }
  return 1;
}

std::string_view to_string(dtype t) noexcept;

}  // namespace tensormem::memory
