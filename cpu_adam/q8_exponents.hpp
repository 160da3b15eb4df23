#pragma once
// The block exponent bytes ("bases") the 8-bit moment encoder writes, for whoever reads
// them from outside the kernels (checkpoints): anything else is corrupt input.

#include <cstdint>

namespace hostopt::detail {

/// A block whose moment is NaN (or m infinite): it decodes as NaN.
inline constexpr std::uint32_t q8_poisoned_base = 255;
/// The largest finite base of m (7-bit magnitude codes) and v (8-bit): the top code's
/// exponent stays at most 254.
inline constexpr std::uint32_t q8_m_max_base = 254 - (127u >> 3), q8_v_max_base = 254 - (255u >> 3);

/// Whether the encoder can write `base` for m (second = false) or v (second = true).
inline bool q8_base_is_written(std::uint8_t base, bool second) noexcept {
  return base == q8_poisoned_base || base <= (second ? q8_v_max_base : q8_m_max_base);
}

} // namespace hostopt::detail
