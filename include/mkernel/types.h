// mkernel/types.h - element types.
#pragma once

#include <cstddef>

namespace mk {

enum class DType { kBF16, kF16, kF32 };

constexpr std::size_t dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }
constexpr const char* dtype_name(DType t) {
  return t == DType::kBF16 ? "bf16" : t == DType::kF16 ? "f16" : "f32";
}

}  // namespace mk
