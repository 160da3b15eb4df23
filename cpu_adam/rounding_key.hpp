#pragma once
// The counter-based generator behind stochastic rounding of compressed moments: the random
// bits of element i at step t are a hash of (seed, t, i) and nothing else, so a step gives
// the same bits whatever the kernel, threads, chunks or shards that run it.

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

/// The 32-bit key of elements [2^32 k, 2^32 (k + 1)): kernels hash the index's low 32 bits
/// xor this (lowbias32, below), so a key covers one such span of the arena.
static inline std::uint32_t span_key(std::uint64_t step_key, std::uint64_t first_index) noexcept {
  return std::uint32_t(splitmix64(step_key ^ (first_index >> 32)));
}

/// lowbias32 (C. Wellons' hash-prospector): a bijective 32-bit hash with a low avalanche
/// bias; the kernels compute the same on vectors.
static inline std::uint32_t lowbias32(std::uint32_t x) noexcept {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

} // namespace hostopt::detail
