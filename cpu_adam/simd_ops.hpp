#pragma once
// Loads, stores and dtype conversions per instruction set, so the Adam kernel is written
// once. Generic xsimd arches convert 16-bit types lane by lane through a small buffer;
// x86 arches override that with their conversion instructions. Every path produces the
// same bits (half_conversion.hpp is the reference they are tested against).
//
// Only included by the per-instruction-set translation units (cpu_adam/arch_*.cpp).

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "half_conversion.hpp"

#if defined(HOSTOPT_USE_XSIMD)
#include <xsimd/xsimd.hpp>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#ifndef HOSTOPT_KERNEL_NS
#error "HOSTOPT_KERNEL_NS must name this translation unit's instruction set"
#endif

namespace hostopt::detail {
// Each instruction set's file gets its own namespace, so no inline function compiled with
// one ISA's flags can be merged by the linker into another ISA's code (ODR).
namespace HOSTOPT_KERNEL_NS {

/// The portable scalar "instruction set": one float per vector.
struct scalar_arch {};

/// The one NaN every kernel stores (positive, quiet, no payload). Operations that create a
/// NaN give x86's "indefinite" 0xFFC00000 but AArch64's 0x7FC00000, and NaN operands
/// propagate by rules that differ too: stores canonicalise, so the bits are the same on
/// every CPU.
inline constexpr std::uint32_t canonical_nan_bits = 0x7FC00000u;
inline float canonical_nan() noexcept { return std::bit_cast<float>(canonical_nan_bits); }

template <class Arch>
struct simd_ops;

template <>
struct simd_ops<scalar_arch> {
  using vec = float;
  static constexpr std::size_t width = 1;
  static vec splat(float x) noexcept { return x; }
  static vec load(const float* p) noexcept { return *p; }
  static void store(float* p, vec x) noexcept { *p = x; }
  static vec sqrt(vec x) noexcept { return std::sqrt(x); }
  static vec div(vec a, vec b) noexcept { return a / b; }
  static vec canon(vec x) noexcept { return x != x ? canonical_nan() : x; }
  static vec load(const bf16_t* p) noexcept { return bf16_to_f32(p->bits); }
  static vec load(const f16_t* p) noexcept { return f16_to_f32(p->bits); }
  static void store(bf16_t* p, vec x) noexcept { p->bits = f32_to_bf16(x); }
  static void store(f16_t* p, vec x) noexcept { p->bits = f32_to_f16(x); }
  // Non-temporal stores (see stream_copy_out): none here; stream() is store().
  static constexpr bool streams_f32 = false, streams_16 = false;
  template <class T>
  static void stream(T* p, vec x) noexcept { store(p, x); }
  static void stream_fence() noexcept {}
};

#if defined(HOSTOPT_USE_XSIMD)
/// Any xsimd arch: float arithmetic from xsimd, 16-bit conversions through a buffer.
template <class Arch>
struct xsimd_ops {
  using vec = xsimd::batch<float, Arch>;
  static constexpr std::size_t width = vec::size;
  static vec splat(float x) noexcept { return vec(x); }
  static vec load(const float* p) noexcept { return vec::load_unaligned(p); }
  static void store(float* p, vec x) noexcept { x.store_unaligned(p); }
  static vec sqrt(vec x) noexcept { return xsimd::sqrt(x); }
  static vec div(vec a, vec b) noexcept { return a / b; }
  // isnan, not x != x: AVX compares "not equal" ordered, false for NaN.
  static vec canon(vec x) noexcept { return xsimd::select(xsimd::isnan(x), vec(canonical_nan()), x); }
  static vec load(const bf16_t* p) noexcept {
    alignas(64) float tmp[width];
    for (std::size_t i = 0; i < width; ++i) tmp[i] = bf16_to_f32(p[i].bits);
    return vec::load_aligned(tmp);
  }
  static vec load(const f16_t* p) noexcept {
    alignas(64) float tmp[width];
    for (std::size_t i = 0; i < width; ++i) tmp[i] = f16_to_f32(p[i].bits);
    return vec::load_aligned(tmp);
  }
  static void store(bf16_t* p, vec x) noexcept {
    alignas(64) float tmp[width];
    x.store_aligned(tmp);
    for (std::size_t i = 0; i < width; ++i) p[i].bits = f32_to_bf16(tmp[i]);
  }
  static void store(f16_t* p, vec x) noexcept {
    alignas(64) float tmp[width];
    x.store_aligned(tmp);
    for (std::size_t i = 0; i < width; ++i) p[i].bits = f32_to_f16(tmp[i]);
  }
  static constexpr bool streams_f32 = false, streams_16 = false;
  template <class T>
  static void stream(T* p, vec x) noexcept { simd_ops<Arch>::store(p, x); }
  static void stream_fence() noexcept {}
};

template <class Arch>
struct simd_ops : xsimd_ops<Arch> {};
#endif

#if defined(HOSTOPT_USE_XSIMD) && defined(__AVX512BW__)
template <>
struct simd_ops<xsimd::avx512bw> : xsimd_ops<xsimd::avx512bw> {
  using xsimd_ops::load;
  using xsimd_ops::store;
  // 16-bit words to and from the high halves of 32-bit lanes with one word permute each
  // (vpermw): the widen-and-shift and shift-and-narrow pairs they replace cost one and two
  // more instructions per vector, in kernels bound by instruction throughput.
  /// Word j of x into the high half of lane j, zeros below.
  static __m512i words_to_high_halves(__m256i x) noexcept {
    const __m512i to_high = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4,
                                             0, 3, 0, 2, 0, 1, 0, 0, 0);
    return _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, to_high, _mm512_castsi256_si512(x));
  }
  /// The high half of each lane of x, as 16 words.
  static __m256i high_halves(__m512i x) noexcept {
    const __m512i from_high = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 31, 29, 27,
                                               25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi16(from_high, x));
  }
  static vec load(const bf16_t* p) noexcept {
    return _mm512_castsi512_ps(words_to_high_halves(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static vec load(const f16_t* p) noexcept {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  /// Round to nearest even in the high halves (a NaN: its quiet bit set, bit 22), then
  /// those halves: the bits of f32_to_bf16.
  static __m256i bf16_bits(vec x) noexcept {
    const __m512 f = x;
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    const __m512i u = _mm512_castps_si512(f);
    return high_halves(_mm512_mask_or_epi32(rounded_high_halves(u), nan, u, _mm512_set1_epi32(0x00400000)));
  }
  /// bf16_bits of x whose only NaN is the canonical one (the kernels' results): rounding
  /// 0x7FC00000 to nearest even gives its quiet NaN already, so the NaN test goes.
  static __m256i bf16_bits_of_canonical(vec x) noexcept {
    return high_halves(rounded_high_halves(_mm512_castps_si512(x)));
  }
  /// u rounded to nearest even at bit 16: its high halves are the bf16 of each lane.
  static __m512i rounded_high_halves(__m512i u) noexcept {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  }
  static void store_canonical(bf16_t* p, vec x) noexcept {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits_of_canonical(x));
  }
  static void stream_canonical(bf16_t* p, vec x) noexcept {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bf16_bits_of_canonical(x));
  }
  static __m256i f16_bits(vec x) noexcept { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store(bf16_t* p, vec x) noexcept { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x)); }
  static void store(f16_t* p, vec x) noexcept { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f16_bits(x)); }
  // Non-temporal stores, to addresses aligned to a vector's bytes.
  static constexpr bool streams_f32 = true, streams_16 = true;
  static void stream(float* p, vec x) noexcept { _mm512_stream_ps(p, x); }
  static void stream(bf16_t* p, vec x) noexcept { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x)); }
  static void stream(f16_t* p, vec x) noexcept { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), f16_bits(x)); }
  static void stream_fence() noexcept { _mm_sfence(); }
};
#endif

#if defined(HOSTOPT_USE_XSIMD) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <>
struct simd_ops<xsimd::fma3<xsimd::avx2>> : xsimd_ops<xsimd::fma3<xsimd::avx2>> {
  using xsimd_ops::load;
  using xsimd_ops::store;
  /// The eight bf16 in both 128-bit lanes (a load, no shuffle), then one byte shuffle puts
  /// each lane's four in the high halves of its 32-bit lanes, zeros below: no shift.
  static vec load(const bf16_t* p) noexcept {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i to_high = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7, //
                                             -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(both, to_high));
  }
  static vec load(const f16_t* p) noexcept {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  /// u's lanes rounded to nearest even at bit 16, shifted down: the bf16 of each lane.
  static __m256i rounded_high_halves(__m256i u) noexcept {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  }
  static __m128i narrow(__m256i r) noexcept {
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static __m128i bf16_bits(vec x) noexcept {
    const __m256 f = x;
    const __m256i u = _mm256_castps_si256(f);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return narrow(_mm256_blendv_epi8(rounded_high_halves(u), quiet, nan));
  }
  /// bf16_bits of x whose only NaN is the canonical one (the kernels' results): rounding
  /// 0x7FC00000 to nearest even gives its quiet NaN already, so the NaN test goes.
  static __m128i bf16_bits_of_canonical(vec x) noexcept {
    return narrow(rounded_high_halves(_mm256_castps_si256(x)));
  }
  static void store_canonical(bf16_t* p, vec x) noexcept {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits_of_canonical(x));
  }
  static void stream_canonical(bf16_t* p, vec x) noexcept {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), bf16_bits_of_canonical(x));
  }
  static __m128i f16_bits(vec x) noexcept { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store(bf16_t* p, vec x) noexcept { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x)); }
  static void store(f16_t* p, vec x) noexcept { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f16_bits(x)); }
  static constexpr bool streams_f32 = true, streams_16 = true;
  static void stream(float* p, vec x) noexcept { _mm256_stream_ps(p, x); }
  static void stream(bf16_t* p, vec x) noexcept { _mm_stream_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x)); }
  static void stream(f16_t* p, vec x) noexcept { _mm_stream_si128(reinterpret_cast<__m128i*>(p), f16_bits(x)); }
  static void stream_fence() noexcept { _mm_sfence(); }
};
#endif

#if defined(HOSTOPT_USE_XSIMD) && defined(__SSE2__) && !defined(__AVX__)
// f16 has no SSE2 instruction: it keeps the generic (buffered scalar) conversion.
template <>
struct simd_ops<xsimd::sse2> : xsimd_ops<xsimd::sse2> {
  using xsimd_ops::load;
  using xsimd_ops::store;
  static vec load(const bf16_t* p) noexcept {
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
  }
  static void store(bf16_t* p, vec x) noexcept {
    const __m128 f = x;
    const __m128i u = _mm_castps_si128(f);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i r = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(lsb, _mm_set1_epi32(0x7FFF))), 16);
    const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(f, f));
    const __m128i quiet = _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x40));
    r = _mm_or_si128(_mm_and_si128(nan, quiet), _mm_andnot_si128(nan, r));
    // Sign-extend the 16-bit values so the signed saturating pack keeps their bits.
    r = _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(r, r));
  }
  // Four 16-bit values are 8 bytes, below SSE2's non-temporal vector store: f32 only.
  static constexpr bool streams_f32 = true, streams_16 = false;
  using xsimd_ops::stream;
  static void stream(float* p, vec x) noexcept { _mm_stream_ps(p, x); }
  static void stream_fence() noexcept { _mm_sfence(); }
};
#endif

#if defined(HOSTOPT_USE_XSIMD) && defined(__aarch64__)
// xsimd 8.1 gives neon64 no float division or square root of its own: it falls back to
// 32-bit NEON's reciprocal estimates refined by Newton steps, which are not correctly
// rounded (and so differ from every other kernel). AArch64 has the IEEE instructions.
template <>
struct simd_ops<xsimd::neon64> : xsimd_ops<xsimd::neon64> {
  static vec sqrt(vec x) noexcept { return vsqrtq_f32(x); }
  static vec div(vec a, vec b) noexcept { return vdivq_f32(a, b); }
};
#endif

} // namespace HOSTOPT_KERNEL_NS
} // namespace hostopt::detail
