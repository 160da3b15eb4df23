#pragma once
/// \file moment_format.hpp
/// How a parameter group stores its Adam moments. Master parameters are always f32.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace hostopt {

/// Storage of exp_avg and exp_avg_sq.
enum class moment_format : std::uint8_t {
  f32 = 0,  ///< IEEE binary32: 8 bytes per element (12 with the master weight)
  bf16 = 1, ///< bfloat16, stochastically rounded: 4 bytes per element (8 in all)
  q8 = 2,   ///< 8-bit block floating point, 32-element blocks with a shared exponent per
            ///< moment, stochastically rounded: 2 + 2/32 bytes per element (6.0625 in all)
};

/// Elements per block of the 8-bit format: blocks never straddle a tensor, a thread's
/// slice, a pipeline chunk or a shard (tensors of 8-bit groups start on a block).
inline constexpr std::size_t q8_block = 32;

namespace detail {
[[noreturn]] inline void bad_moment_format(moment_format f) {
  throw std::invalid_argument("moment_format: value " + std::to_string(int(f)) +
                              " is not a format (expected f32=0, bf16=1 or q8=2)");
}
} // namespace detail

/// "f32", "bf16" or "8bit".
inline std::string_view moment_format_name(moment_format f) {
  switch (f) {
  case moment_format::f32: return "f32";
  case moment_format::bf16: return "bf16";
  case moment_format::q8: return "8bit";
  }
  detail::bad_moment_format(f);
}

/// Parses "f32"/"float32", "bf16"/"bfloat16", "8bit"/"q8"; throws std::invalid_argument
/// naming the string otherwise.
inline moment_format parse_moment_format(std::string_view name) {
  if (name == "f32" || name == "float32" || name == "fp32") return moment_format::f32;
  if (name == "bf16" || name == "bfloat16") return moment_format::bf16;
  if (name == "8bit" || name == "q8") return moment_format::q8;
  throw std::invalid_argument("moment_format: unknown name '" + std::string(name) + "', expected f32, bf16 or 8bit");
}

/// Bytes of one stored moment of one element: 4, 2 or 1 (8-bit: plus its block's exponent).
inline std::size_t moment_code_bytes(moment_format f) {
  switch (f) {
  case moment_format::f32: return 4;
  case moment_format::bf16: return 2;
  case moment_format::q8: return 1;
  }
  detail::bad_moment_format(f);
}

/// Bytes of moment storage (both moments, block exponents included) for `elements`
/// elements laid out from a block boundary.
inline std::size_t moment_bytes(moment_format f, std::size_t elements) {
  switch (f) {
  case moment_format::q8: return 2 * elements + 2 * ((elements + q8_block - 1) / q8_block);
  default: return 2 * moment_code_bytes(f) * elements;
  }
}

} // namespace hostopt
