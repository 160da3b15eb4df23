#pragma once
/// \file dtype.hpp
/// Element types hostopt reads and writes, and the views that carry them.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace hostopt {

/// Storage type of a gradient or a parameter copy-out buffer. Master parameters and
/// moments are always f32.
enum class dtype : std::uint8_t {
  f32 = 0,  ///< IEEE binary32
  bf16 = 1, ///< bfloat16 (upper half of a binary32), round-to-nearest-even on write
  f16 = 2,  ///< IEEE binary16, round-to-nearest-even on write
};

/// Bytes per element of `t`; throws std::invalid_argument for a value outside the enum.
std::size_t dtype_size(dtype t);

/// "f32", "bf16" or "f16"; throws std::invalid_argument for a value outside the enum.
std::string_view dtype_name(dtype t);

/// Parses "f32"/"float32", "bf16"/"bfloat16", "f16"/"float16"; throws
/// std::invalid_argument naming the string otherwise.
dtype parse_dtype(std::string_view name);

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
