#pragma once
/// \file dtype.hpp
/// Element types hostopt reads and writes, and the views that carry them.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace hostopt {

/// Storage type of a gradient or a parameter copy-out buffer. Master parameters and
/// moments are always f32.
enum class dtype : std::uint8_t {
  f32 = 0,  ///< IEEE binary32
  bf16 = 1, ///< bfloat16 (upper half of a binary32), round-to-nearest-even on write
  f16 = 2,  ///< IEEE binary16, round-to-nearest-even on write
};

namespace detail {
[[noreturn]] inline void bad_dtype(dtype t) {
  throw std::invalid_argument("dtype: value " + std::to_string(int(t)) +
                              " is not a dtype (expected f32=0, bf16=1 or f16=2)");
}
} // namespace detail

/// Bytes per element of `t`; throws std::invalid_argument for a value outside the enum.
inline std::size_t dtype_size(dtype t) {
  switch (t) {
  case dtype::f32: return 4;
  case dtype::bf16: return 2;
  case dtype::f16: return 2;
  }
  detail::bad_dtype(t);
}

/// "f32", "bf16" or "f16"; throws std::invalid_argument for a value outside the enum.
inline std::string_view dtype_name(dtype t) {
  switch (t) {
  case dtype::f32: return "f32";
  case dtype::bf16: return "bf16";
  case dtype::f16: return "f16";
  }
  detail::bad_dtype(t);
}

/// Parses "f32"/"float32", "bf16"/"bfloat16", "f16"/"float16"; throws
/// std::invalid_argument naming the string otherwise.
inline dtype parse_dtype(std::string_view name) {
  if (name == "f32" || name == "float32" || name == "fp32") return dtype::f32;
  if (name == "bf16" || name == "bfloat16") return dtype::bf16;
  if (name == "f16" || name == "float16" || name == "fp16") return dtype::f16;
  throw std::invalid_argument("dtype: unknown name '" + std::string(name) + "', expected f32, bf16 or f16");
}

/// A read-only typed buffer owned by the caller (a gradient).
struct const_view {
  const void* data = nullptr; ///< first element; may be null only when size == 0
  std::size_t size = 0;       ///< number of elements (not bytes)
  dtype type = dtype::f32;    ///< element type
};

/// A writable typed buffer owned by the caller (a parameter copy-out).
/// A default-constructed view (data == nullptr, size == 0) means "no copy-out".
struct mut_view {
  void* data = nullptr;    ///< first element; may be null only when size == 0
  std::size_t size = 0;    ///< number of elements (not bytes)
  dtype type = dtype::f32; ///< element type
};

} // namespace hostopt
