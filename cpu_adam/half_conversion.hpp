#pragma once
// Scalar bf16/f16 <-> f32 conversions, bit-exact with the x86 hardware paths (F16C,
// AVX-512) so that every kernel writes identical bits. Everything here is `static inline`:
// this header is compiled into each per-instruction-set file, and a shared inline
// definition could let the linker hand one ISA's copy to another (ODR).

#include <cstdint>
#include <cstring>

namespace hostopt::detail {

/// Storage tags for 16-bit floating types (the bits, little-endian).
struct bf16_t {
  std::uint16_t bits;
};
struct f16_t {
  std::uint16_t bits;
};

static inline std::uint32_t float_bits(float x) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

static inline float bits_float(std::uint32_t u) noexcept {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

static inline float bf16_to_f32(std::uint16_t h) noexcept {
  return bits_float(std::uint32_t(h) << 16);
}

// Round to nearest even; NaN stays NaN (quiet bit set) instead of rounding to infinity.
static inline std::uint16_t f32_to_bf16(float x) noexcept {
  const std::uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return std::uint16_t((u >> 16) | 0x0040u);
  return std::uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Exact (every f16 is an f32); signalling NaNs come back quiet, as VCVTPH2PS does.
static inline float f16_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    exp = 1;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    mant &= 0x3FFu;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even with subnormals, overflow to infinity and quiet NaNs that keep
// their top payload bits: the results of VCVTPS2PH with imm8 = round-to-nearest.
static inline std::uint16_t f32_to_f16(float f) noexcept {
  std::uint32_t x = float_bits(f);
  const std::uint16_t sign = std::uint16_t((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) {
    if (x > 0x7F800000u) return std::uint16_t(sign | 0x7E00u | ((x >> 13) & 0x3FFu));
    return std::uint16_t(sign | 0x7C00u);
  }
  if (x >= 0x47800000u) return std::uint16_t(sign | 0x7C00u); // >= 65536: infinity
  if (x >= 0x38800000u) { // normal half (rounding may carry into the exponent, or to inf)
    return std::uint16_t(sign | ((x + 0xC8000FFFu + ((x >> 13) & 1u)) >> 13));
  }
  if (x < 0x33000000u) return sign; // below 2^-25: rounds to zero
  const std::uint32_t full = (x & 0x7FFFFFu) | 0x800000u;
  const std::uint32_t shift = 126u - (x >> 23);
  std::uint32_t q = full >> shift;
  const std::uint32_t rem = full & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
  return std::uint16_t(sign | q);
}

} // namespace hostopt::detail
