#pragma once
// The counter-based generator behind stochastic rounding of compressed moments: the random
// bits of element i at step t are a function of (seed, t, i) and nothing else, so a step
// gives the same bits whatever the kernel, threads, chunks or shards that run it.

#include <cstdint>

namespace hostopt::detail {

/// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mix.
static inline std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// One step's key: the seed and the step number mixed.
static inline std::uint64_t rounding_key(std::uint64_t seed, std::int64_t step) noexcept {
  return splitmix64(seed ^ splitmix64(std::uint64_t(step)));
}

/// The 32-bit key of elements [2^32 k, 2^32 (k + 1)): rounding_sequence takes the index's
/// low 32 bits, so a key covers one such span of the arena.
static inline std::uint32_t span_key(std::uint64_t step_key, std::uint64_t first_index) noexcept {
  return std::uint32_t(splitmix64(step_key ^ (first_index >> 32)));
}

/// The step of the rounding sequence: odd (so index -> bits is a bijection), its high bits
/// sqrt(2) - 1 and its low 16 golden-ratio bits, so neighbours' thresholds spread evenly in
/// both halves, each half at its own pace.
inline constexpr std::uint32_t rounding_step = 0x6A099E37u;

/// x of element `index` (low 32 bits) in a span keyed `key`: an additive sequence. The
/// kernels round v with x's high 16 bits and m with its low 16 xor its high 16
/// (moment_codec::random). With the key uniform and fresh each step, every element's bits
/// are uniform each step (its rounding unbiased), m's independent of v's, and independent of
/// its bits at any other step. Within a step neighbours' bits spread evenly. The xor is for
/// m: x's low 16 bits alone repeat every 2^16 elements, so a 65536-wide tensor's column would
/// round its m in lockstep (and a 4096-wide one's through 16 values); its high half varies
/// along any stride below 2^28. One add, one shift and one xor per vector, where a hash
/// costs two multiplies per element.
static inline std::uint32_t rounding_sequence(std::uint32_t key, std::uint32_t index) noexcept {
  return key + index * rounding_step;
}

} // namespace hostopt::detail
