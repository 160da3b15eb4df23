#pragma once
// 32-bit unsigned integer lanes beside simd_ops' floats, for the compressed moment codecs
// (stochastic rounding's random bits, 8-bit codes): bit casts, index sequences, narrow
// loads and stores of 8- and 16-bit codes. Generic xsimd code, with instructions where
// xsimd 8.1 goes lane by lane (narrowing) or takes more shuffles than needed.
// Integer arithmetic is exact, so every path gives the same bits.
//
// Only included by the per-instruction-set translation units (cpu_adam/arch_*.cpp).

#include <array>
#include <cstddef>
#include <cstdint>

#include "simd_ops.hpp"

namespace hostopt::detail {
namespace HOSTOPT_KERNEL_NS {

template <class Arch>
struct uint_ops;

template <>
struct uint_ops<scalar_arch> {
  using vec = float;
  using uvec = std::uint32_t;
  static uvec splat(std::uint32_t x) noexcept { return x; }
  static uvec bits(vec x) noexcept { return float_bits(x); }
  static vec from_bits(uvec u) noexcept { return bits_float(u); }
  /// Whether scale_pow2 is one instruction (else the codec scales by exponent arithmetic).
  static constexpr bool has_scale_pow2 = false;
  template <std::uint32_t Step>
  static uvec iota_by(std::uint32_t first) noexcept { return first; }
  static uvec select_lt(uvec a, uvec b, uvec yes, uvec no) noexcept { return a < b ? yes : no; }
  static vec select_lt(uvec a, uvec b, vec yes, vec no) noexcept { return a < b ? yes : no; }
  static uvec min(uvec a, uvec b) noexcept { return a < b ? a : b; }
  static uvec max(uvec a, uvec b) noexcept { return a < b ? b : a; }
  static uvec add_where_lt(uvec a, uvec b, uvec x, uvec y) noexcept { return a < b ? x + y : x; }
  static uvec add_where_lt(uvec a, uvec b, uvec x, vec y) noexcept { return a < b ? bits(from_bits(x) + y) : x; }
  static vec sub_where_lt(uvec a, uvec b, vec x, vec y) noexcept { return a < b ? x - y : x; }
  static std::uint32_t reduce_max(uvec a) noexcept { return a; }
  /// acc = min(acc, x) (unsigned, every 32 bits) in the lanes where f's magnitude is nonzero.
  static uvec min_where_magnitude(uvec acc, uvec x, vec f) noexcept {
    return (bits(f) & 0x7FFFFFFFu) != 0 && x < acc ? x : acc;
  }
  /// Whether a < b (unsigned, every 32 bits) in some lane.
  static bool any_lt_unsigned(uvec a, uvec b) noexcept { return a < b; }
  static uvec load_u8(const std::uint8_t* p) noexcept { return *p; }
  static void store_u8(std::uint8_t* p, uvec x) noexcept { *p = std::uint8_t(x); }
  /// Lanes above 255 store 255 (every kernel, for lanes below 2^15: the codes passed are below 2^12).
  static void store_u8_saturated(std::uint8_t* p, uvec x) noexcept { store_u8(p, min(x, 255)); }
  static uvec load_u16(const std::uint16_t* p) noexcept { return *p; }
  static void store_u16(std::uint16_t* p, uvec x) noexcept { *p = std::uint16_t(x); }
  static void store_high_halves(std::uint16_t* a, std::uint16_t* b, uvec x, uvec y) noexcept {
    *a = std::uint16_t(x >> 16);
    *b = std::uint16_t(y >> 16);
  }
};

#if defined(HOSTOPT_USE_XSIMD)
template <class Arch>
struct xsimd_uint_ops {
  using vec = xsimd::batch<float, Arch>;
  using uvec = xsimd::batch<std::uint32_t, Arch>;
  static constexpr std::size_t width = vec::size;
  static uvec splat(std::uint32_t x) noexcept { return uvec(x); }
  static uvec bits(vec x) noexcept { return xsimd::bitwise_cast<uvec>(x); }
  static vec from_bits(uvec u) noexcept { return xsimd::bitwise_cast<vec>(u); }
  static constexpr bool has_scale_pow2 = false;
  /// first, first + Step, first + 2 Step, ... (mod 2^32): a constant vector plus a
  /// broadcast (building it through memory each call would stall on store forwarding).
  template <std::uint32_t Step>
  static uvec iota_by(std::uint32_t first) noexcept {
    static_assert(width <= 16);
    alignas(64) static constexpr std::array<std::uint32_t, 16> lanes = [] {
      std::array<std::uint32_t, 16> a{};
      for (std::uint32_t i = 0; i < 16; ++i) a[i] = i * Step;
      return a;
    }();
    return uvec::load_aligned(lanes.data()) + uvec(first);
  }
  // Operands below 2^31 only (magnitudes' bits, codes): a signed compare is exact there,
  // and every instruction set has one.
  static uvec select_lt(uvec a, uvec b, uvec yes, uvec no) noexcept {
    using ivec = xsimd::batch<std::int32_t, Arch>;
    const auto lt = xsimd::bitwise_cast<ivec>(a) < xsimd::bitwise_cast<ivec>(b);
    return xsimd::bitwise_cast<uvec>(
        xsimd::select(lt, xsimd::bitwise_cast<ivec>(yes), xsimd::bitwise_cast<ivec>(no)));
  }
  static vec select_lt(uvec a, uvec b, vec yes, vec no) noexcept {
    return from_bits(select_lt(a, b, bits(yes), bits(no)));
  }
  static uvec min(uvec a, uvec b) noexcept { return select_lt(a, b, a, b); }
  static uvec max(uvec a, uvec b) noexcept { return select_lt(a, b, b, a); }
  /// Where a < b: x + y (integers), bits(from_bits(x) + y) (floats), x - y; elsewhere x.
  /// (Masked arithmetic where AVX-512 has it: one instruction instead of two.)
  static uvec add_where_lt(uvec a, uvec b, uvec x, uvec y) noexcept { return select_lt(a, b, x + y, x); }
  static uvec add_where_lt(uvec a, uvec b, uvec x, vec y) noexcept {
    return select_lt(a, b, bits(from_bits(x) + y), x);
  }
  static vec sub_where_lt(uvec a, uvec b, vec x, vec y) noexcept { return select_lt(a, b, x - y, x); }
  static std::uint32_t reduce_max(uvec a) noexcept {
    alignas(64) std::uint32_t t[width];
    a.store_aligned(t);
    std::uint32_t r = t[0];
    for (std::size_t i = 1; i < width; ++i) r = t[i] > r ? t[i] : r;
    return r;
  }
  /// acc = min(acc, x) (unsigned, every 32 bits) in the lanes where f's magnitude is nonzero.
  static uvec min_where_magnitude(uvec acc, uvec x, vec f) noexcept {
    return xsimd::select((bits(f) & uvec(0x7FFFFFFFu)) != uvec(0), xsimd::min(acc, x), acc);
  }
  /// Whether a < b (unsigned, every 32 bits) in some lane.
  static bool any_lt_unsigned(uvec a, uvec b) noexcept { return xsimd::any(a < b); }
  static uvec load_u8(const std::uint8_t* p) noexcept {
    alignas(64) std::uint32_t t[width];
    for (std::size_t i = 0; i < width; ++i) t[i] = p[i];
    return uvec::load_aligned(t);
  }
  static void store_u8(std::uint8_t* p, uvec x) noexcept {
    alignas(64) std::uint32_t t[width];
    x.store_aligned(t);
    for (std::size_t i = 0; i < width; ++i) p[i] = std::uint8_t(t[i]);
  }
  /// Lanes above 255 store 255 (every kernel, for lanes below 2^15: the codes passed are below 2^12).
  static void store_u8_saturated(std::uint8_t* p, uvec x) noexcept {
    uint_ops<Arch>::store_u8(p, uint_ops<Arch>::min(x, uvec(255)));
  }
  static uvec load_u16(const std::uint16_t* p) noexcept {
    alignas(64) std::uint32_t t[width];
    for (std::size_t i = 0; i < width; ++i) t[i] = p[i];
    return uvec::load_aligned(t);
  }
  static void store_u16(std::uint16_t* p, uvec x) noexcept {
    alignas(64) std::uint32_t t[width];
    x.store_aligned(t);
    for (std::size_t i = 0; i < width; ++i) p[i] = std::uint16_t(t[i]);
  }
  /// The high halves of x's lanes to a, of y's to b (two 16-bit code stores at once).
  static void store_high_halves(std::uint16_t* a, std::uint16_t* b, uvec x, uvec y) noexcept {
    uint_ops<Arch>::store_u16(a, x >> 16);
    uint_ops<Arch>::store_u16(b, y >> 16);
  }
};

template <class Arch>
struct uint_ops : xsimd_uint_ops<Arch> {};
#endif

#if defined(HOSTOPT_USE_XSIMD) && defined(__AVX512BW__)
template <>
struct uint_ops<xsimd::avx512bw> : xsimd_uint_ops<xsimd::avx512bw> {
  /// x * 2^e for integral e (vscalefps), rounded once as IEEE multiplication rounds: exact
  /// unless the result is subnormal (then to nearest even), subnormal inputs taken as they
  /// are. Both need FTZ and DAZ off, as every entry point sets them (ieee_float_mode).
  static constexpr bool has_scale_pow2 = true;
  static vec scale_pow2(vec x, vec e) noexcept { return _mm512_scalef_ps(x, e); }
  static uvec select_lt(uvec a, uvec b, uvec yes, uvec no) noexcept {
    return _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, b), no, yes);
  }
  static vec select_lt(uvec a, uvec b, vec yes, vec no) noexcept {
    return _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(a, b), no, yes);
  }
  static uvec min(uvec a, uvec b) noexcept { return _mm512_min_epu32(a, b); }
  static uvec max(uvec a, uvec b) noexcept { return _mm512_max_epu32(a, b); }
  static uvec add_where_lt(uvec a, uvec b, uvec x, uvec y) noexcept {
    return _mm512_mask_add_epi32(x, _mm512_cmplt_epu32_mask(a, b), x, y);
  }
  static uvec add_where_lt(uvec a, uvec b, uvec x, vec y) noexcept {
    const __m512 f = _mm512_castsi512_ps(x);
    return _mm512_castps_si512(_mm512_mask_add_ps(f, _mm512_cmplt_epu32_mask(a, b), f, y));
  }
  static vec sub_where_lt(uvec a, uvec b, vec x, vec y) noexcept {
    return _mm512_mask_sub_ps(x, _mm512_cmplt_epu32_mask(a, b), x, y);
  }
  static std::uint32_t reduce_max(uvec a) noexcept { return _mm512_reduce_max_epu32(a); }
  static uvec min_where_magnitude(uvec acc, uvec x, vec f) noexcept { // vptestmd, masked vpminud
    return _mm512_mask_min_epu32(acc, _mm512_test_epi32_mask(_mm512_castps_si512(f), _mm512_set1_epi32(0x7FFFFFFF)),
                                 acc, x);
  }
  static bool any_lt_unsigned(uvec a, uvec b) noexcept { return _mm512_cmplt_epu32_mask(a, b) != 0; }
  static uvec load_u8(const std::uint8_t* p) noexcept {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_u8(std::uint8_t* p, uvec x) noexcept {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  static void store_u8_saturated(std::uint8_t* p, uvec x) noexcept { // vpmovusdb
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtusepi32_epi8(x));
  }
  static uvec load_u16(const std::uint16_t* p) noexcept {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_u16(std::uint16_t* p, uvec x) noexcept {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
  }
  /// One two-source word permute (vpermt2w) gathers both vectors' high halves: two
  /// instructions fewer than shifting and narrowing each.
  static void store_high_halves(std::uint16_t* a, std::uint16_t* b, uvec x, uvec y) noexcept {
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                         23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512i both = _mm512_permutex2var_epi16(x, odd, y);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), _mm512_castsi512_si256(both));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b), _mm512_extracti64x4_epi64(both, 1));
  }
};
#endif

#if defined(HOSTOPT_USE_XSIMD) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <>
struct uint_ops<xsimd::fma3<xsimd::avx2>> : xsimd_uint_ops<xsimd::fma3<xsimd::avx2>> {
  static uvec min(uvec a, uvec b) noexcept { return _mm256_min_epu32(a, b); }
  static uvec max(uvec a, uvec b) noexcept { return _mm256_max_epu32(a, b); }
  /// Lanes where f's magnitude is zero take x | all ones, which never lowers acc.
  static uvec min_where_magnitude(uvec acc, uvec x, vec f) noexcept {
    const __m256i zero = _mm256_cmpeq_epi32(_mm256_slli_epi32(_mm256_castps_si256(f), 1), _mm256_setzero_si256());
    return _mm256_min_epu32(acc, _mm256_or_si256(x, zero));
  }
  static std::uint32_t reduce_max(uvec a) noexcept {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return std::uint32_t(_mm_cvtsi128_si32(m));
  }
  static uvec load_u8(const std::uint8_t* p) noexcept {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_u8(std::uint8_t* p, uvec x) noexcept { // lanes are < 256
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  /// Lanes above 255 store 255 for lanes below 2^15: both packs saturate (no min).
  static void store_u8_saturated(std::uint8_t* p, uvec x) noexcept { store_u8(p, x); }
  static uvec load_u16(const std::uint16_t* p) noexcept {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_u16(std::uint16_t* p, uvec x) noexcept { // lanes are < 65536
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
  }
  /// One pack of both (x's halves and y's interleaved by 128-bit lane), one permute to put
  /// x's eight before y's: two shuffles where two store_u16 take four.
  static void store_high_halves(std::uint16_t* a, std::uint16_t* b, uvec x, uvec y) noexcept {
    const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(x, 16), _mm256_srli_epi32(y, 16));
    const __m256i ordered = _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm256_castsi256_si128(ordered));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b), _mm256_extracti128_si256(ordered, 1));
  }
};
#endif

} // namespace HOSTOPT_KERNEL_NS
} // namespace hostopt::detail
