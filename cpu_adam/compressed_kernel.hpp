#pragma once
// The fused Adam step over compressed moments: decode m and v, the update rule of
// adam_kernel.hpp (the same operations in the same order, so p and the copy-out are the
// bits the f32 kernel gives for the decoded moments), encode m and v, one pass.
//
// Formats (moment_format):
// - bf16: m and v as bfloat16, stochastically rounded. With beta2 = 0.999, v moves by
//   1e-3 of itself per step, below bf16's 2^-8 resolution: round to nearest would freeze
//   it. Rounding up with probability (discarded bits) / 2^16 is unbiased instead.
// - q8: 8-bit block floating point over blocks of q8_block elements, each with one shared
//   exponent byte per moment ("base"). m's code is sign | 4-bit exponent | 3-bit mantissa,
//   v's (never negative) a 5-bit exponent | 3-bit mantissa, both relative to the block's
//   base, with subnormals below it: a block spans 2^17 (m) and 2^33 (v) of dynamic range,
//   and a power-of-two scale makes encoding bit arithmetic (no code-book search, no
//   division). Rounding is stochastic as for bf16. A block whose moment is NaN (or m
//   infinite) has base 255 and decodes as NaN; an infinite v saturates (base_for).
//   2 + 2/32 bytes per element. The encode counts poisoned blocks and blocks whose range
//   it exceeded (moment_codec::saturated): scalar tests per block, and one running
//   minimum per vector (the smallest v of the elements that had a gradient).
// The random bits of element i at step t come from rounding_sequence(span_key, i) (rounding_key.hpp).
//
// Only included by the per-instruction-set translation units (cpu_adam/arch_*.cpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "adam_kernel.hpp"
#include "prefetch.hpp"
#include "q8_exponents.hpp"
#include "rounding_key.hpp"
#include "simd_ops.hpp"
#include "simd_uint_ops.hpp"

namespace hostopt::detail {
namespace HOSTOPT_KERNEL_NS {

template <class Arch>
struct moment_codec {
  using ops = simd_ops<Arch>;
  using uo = uint_ops<Arch>;
  using vec = typename ops::vec;
  using uvec = typename uo::uvec;

  /// rounding_sequence's x of lanes at indices lo, lo + 1, ... (low 32 bits) in a span
  /// with `key`.
  static uvec sequence(std::uint32_t lo, std::uint32_t key) noexcept {
    return uo::template iota_by<rounding_step>(rounding_sequence(key, lo));
  }
  /// Random bits of those lanes: m's in the low 16 (x's halves xored), v's in the high 16.
  static uvec random(std::uint32_t lo, std::uint32_t key) noexcept {
    const uvec x = sequence(lo, key);
    return x ^ (x >> 16);
  }

  // --- bf16 -----------------------------------------------------------------------------
  /// Rounds x (canonical) to bf16 up in magnitude when its low 16 bits + r16 carry.
  static void store_bf16(bf16_t* p, vec x, uvec r16) noexcept {
    uo::store_u16(reinterpret_cast<std::uint16_t*>(p), (uo::bits(x) + r16) >> 16);
  }
  /// store_bf16 of m and v with random()'s bits, at once, from the sequence x (its high
  /// half computed once for both: one shift fewer).
  static void store_bf16_pair(bf16_t* m, bf16_t* v, vec mm, vec vv, uvec x) noexcept {
    const uvec high = x >> 16;
    uo::store_high_halves(reinterpret_cast<std::uint16_t*>(m), reinterpret_cast<std::uint16_t*>(v),
                          uo::bits(mm) + ((x ^ high) & uo::splat(0xFFFF)), uo::bits(vv) + high);
  }

  // --- q8 -------------------------------------------------------------------------------
  static constexpr std::uint32_t poisoned = 255;
  /// Magnitude codes: 7 bits for m (a sign beside), 8 for v.
  static constexpr std::uint32_t m_max_code = 127, v_max_code = 255;
  /// Largest base the encoder writes (its top code's exponent is at most 254): larger
  /// bytes (poisoned, or corrupt input) decode as NaN rather than spill into the sign.
  static constexpr std::uint32_t m_max_base = 254 - (m_max_code >> 3), v_max_base = 254 - (v_max_code >> 3);
  static_assert(m_max_base == q8_m_max_base && v_max_base == q8_v_max_base && poisoned == q8_poisoned_base,
                "q8_exponents.hpp states the codec's bases");

  /// One block's base where no instruction scales by a power of two. Below base 127 (every
  /// base a training run's moments get: base 127 is a block whose largest |m| is near 2^15,
  /// or v near 2^31), 2^base and 2^-base as normal floats: one multiplication is then what
  /// scale_pow2 does (decode_magnitude, encode_magnitude). Otherwise exponent arithmetic,
  /// with the float bits of 2^(base-127) (base << 23), the float 2^(base+1-127) (the top of
  /// the subnormal codes), its bits, and the code origin base * 8.
  struct exponent_scale {
    std::uint32_t base;
    bool multiplies;
    vec up, down;
    explicit exponent_scale(std::uint32_t b) noexcept
        : base(b), multiplies(b < 127), up(uo::from_bits(uo::splat(multiplies ? (b + 127) << 23 : 0))),
          down(uo::from_bits(uo::splat(multiplies ? (127 - b) << 23 : 0))) {}
    // The exponent arithmetic's vectors, built only where it runs.
    uvec bits() const noexcept { return uo::splat(base << 23); }
    uvec subnormal_top_bits() const noexcept { return uo::splat((base + 1) << 23); }
    vec subnormal_top() const noexcept { return uo::from_bits(subnormal_top_bits()); }
    uvec origin() const noexcept { return uo::splat(base << 3); }
  };
  /// Where one instruction scales by a power of two (uo::has_scale_pow2): base and -base as
  /// floats. A code is then the top bits of |x| * 2^-base, whose subnormals are exactly the
  /// subnormal codes (decode_magnitude, encode_magnitude).
  struct pow2_scale {
    vec up, down;
    explicit pow2_scale(std::uint32_t base) noexcept : up(ops::splat(float(base))), down(ops::splat(-float(base))) {}
  };
  using scale = std::conditional_t<uo::has_scale_pow2, pow2_scale, exponent_scale>;

  /// The base that puts a block's largest exponent at the top of the code's exponents.
  /// The exponent is the largest value's after rounding up (its 20 discarded bits all
  /// carrying), so no code ever saturates: a base from the exponent alone would clamp a
  /// value just below a power of two (v = 0.999 of 1) to 15/16 of it, biased.
  ///
  /// A NaN poisons the block; so does an infinite m (an infinite gradient: the f32 step
  /// gives NaN there too). An infinite v comes from a finite gradient above ~1.8e19, whose
  /// square overflows: the f32 step then takes a zero step for that element alone, so v
  /// saturates at the top code instead (a step of ~0) rather than poisoning 31 others.
  static std::uint32_t base_for(std::uint32_t max_magnitude_bits, std::uint32_t max_code) noexcept {
    const bool v = max_code == v_max_code;
    if (max_magnitude_bits > 0x7F800000u || (!v && max_magnitude_bits == 0x7F800000u)) return poisoned;
    const std::uint32_t rounded_up = (max_magnitude_bits + 0xFFFFFu) >> 23;
    const std::uint32_t e = rounded_up < 254 ? rounded_up : 254;
    const std::uint32_t top = max_code >> 3; // 15 (m) or 31 (v)
    return e > top ? e - top : 0;
  }
  /// Whether encoding a block with base `v_base` exceeded the format's range, from the
  /// block's largest magnitudes (bits) and `v_low`, per lane the smallest magnitude bits
  /// less one of v among its elements with a nonzero gradient (unsigned: a zero v wraps to
  /// the largest value, as does "none"):
  /// - such an element's v lies below the smallest v code (2^(v_base - 129), more than
  ///   2^33 below the block's largest v), so the floor raises it (encode_v): its steps
  ///   shrink by the square root of that factor, frozen where it is large. Elements
  ///   without a gradient (their v decaying: their m has, too) are not counted;
  /// - or a largest magnitude is in f32's top binade's last eighth or is an infinite v:
  ///   its code clamps at the top (base_for has no larger base to give).
  /// m's own range (2^17) is not counted: m crosses zero, and rounds stochastically
  /// (unbiased) below its block's smallest code. A poisoned block is not saturated.
  static bool saturated(std::uint32_t m_top, std::uint32_t v_top, uvec v_low, std::uint32_t v_base) noexcept {
    constexpr std::uint32_t clamps = 0x7F800000u - 0xFFFFFu; // base_for's rounded-up exponent reaches 255
    if (m_top >= clamps || v_top >= clamps) return true;
    const std::uint32_t smallest = v_base >= 3 ? (v_base - 2) << 23 : 1u << (v_base + 20); // code 1's bits
    return uo::any_lt_unsigned(v_low, uo::splat(smallest - 1));
  }
  /// Magnitude code -> value: code >= 8 is the float with bits (code << 20) + (base << 23)
  /// (exponent base + code / 8, mantissa code % 8); code < 8 is code / 8 * 2^(base + 1),
  /// the same bits plus 2^23 less the float 2^(base + 1) (the subnormals).
  ///
  /// With a power-of-two scale: the float of bits code << 20 is code's value for base 0
  /// (codes below 8 are its subnormals), times 2^base exactly.
  ///
  /// Otherwise, below base 127, the same product by a multiplication: exact too (the
  /// largest code's value for base 0 is below 2^-95, times at most 2^126).
  static vec decode_magnitude(uvec code, const scale& s) noexcept {
    if constexpr (uo::has_scale_pow2) return uo::scale_pow2(uo::from_bits(code << 20), s.up);
    else if (s.multiplies) return uo::from_bits(code << 20) * s.up;
    else return decode_by_exponent(code, s);
  }
  static vec decode_by_exponent(uvec code, const exponent_scale& s) noexcept {
    const uvec eight = uo::splat(8);
    const uvec t = (code << 20) + s.bits();
    const vec x = uo::from_bits(uo::add_where_lt(code, eight, t, uo::splat(1u << 23)));
    return uo::sub_where_lt(code, eight, x, s.subnormal_top());
  }
  /// |x| (magnitude bits a) -> magnitude code, rounding stochastically with r20 (random
  /// bits in [0, 2^20)), not yet clamped to the largest code.
  ///
  /// With a power-of-two scale: the code is the top bits of |x| * 2^-base. Above 2^(base+1)
  /// that is |x|'s bits less base << 23; below, a subnormal rounded to nearest even on the
  /// grid of the add below (2^(base-149)), with the same parity: the same bits either way.
  ///
  /// Otherwise, below base 127, |x| * 2^-base by a multiplication (2^-base is a normal
  /// float): IEEE multiplication rounds once, to nearest even, as scale_pow2 does, so the
  /// bits are scale_pow2's.
  static uvec encode_magnitude(uvec a, const scale& s, uvec r20) noexcept {
    if constexpr (uo::has_scale_pow2) return (uo::bits(uo::scale_pow2(uo::from_bits(a), s.down)) + r20) >> 20;
    else if (s.multiplies) return (uo::bits(uo::from_bits(a) * s.down) + r20) >> 20;
    else return encode_by_exponent(a, s, r20);
  }
  static uvec encode_by_exponent(uvec a, const exponent_scale& s, uvec r20) noexcept {
    // Below 2^(base+1): |x| + 2^(base+1) puts |x|'s eighths of 2^(base+1) in the top
    // mantissa bits (the add rounds to nearest below 2^-20 of them: deterministic), a
    // binade (8 codes) above the origin.
    const uvec y = uo::add_where_lt(a, s.subnormal_top_bits(), a, s.subnormal_top());
    const uvec origin = uo::add_where_lt(a, s.subnormal_top_bits(), s.origin(), uo::splat(8));
    return ((y + r20) >> 20) - origin;
  }
  /// 16 of a lane's random bits (its low half, or its high half) spread over the 20
  /// discarded ones, with their midpoint as offset: P(round up) = discarded fraction (to
  /// 2^-16), exactly unbiased on average.
  static uvec random20_low(uvec r) noexcept { return ((r << 4) & uo::splat(0xFFFF0u)) | uo::splat(8); }
  static uvec random20_high(uvec r) noexcept { return ((r >> 12) & uo::splat(0xFFFF0u)) | uo::splat(8); }

  static vec decode_m(const std::uint8_t* c, std::uint32_t base, const scale& s) noexcept {
    if (base > m_max_base) return ops::splat(canonical_nan());
    const uvec code = uo::load_u8(c);
    const vec mag = decode_magnitude(code & uo::splat(0x7F), s);
    return uo::from_bits(uo::bits(mag) | ((code << 24) & uo::splat(0x80000000u)));
  }
  static vec decode_v(const std::uint8_t* c, std::uint32_t base, const scale& s) noexcept {
    if (base > v_max_base) return ops::splat(canonical_nan());
    return decode_magnitude(uo::load_u8(c), s);
  }
  static void encode_m(std::uint8_t* c, vec x, std::uint32_t base, const scale& s, uvec r20) noexcept {
    if (base == poisoned) return uo::store_u8(c, uo::splat(0));
    const uvec u = uo::bits(x);
    const uvec mag = uo::min(encode_magnitude(u & uo::splat(0x7FFFFFFFu), s, r20), uo::splat(m_max_code));
    uo::store_u8(c, mag | ((u >> 24) & uo::splat(0x80)));
  }
  /// A positive v never codes as 0: beside a block maximum 2^33 larger, v could round to
  /// 0 while m (whose range is 2^17, about 2^34 squared) does not, and the step would be
  /// lr m / eps. The smallest code instead errs toward smaller steps.
  static void encode_v(std::uint8_t* c, vec x, std::uint32_t base, const scale& s, uvec r20) noexcept {
    if (base == poisoned) return uo::store_u8(c, uo::splat(0));
    const uvec a = uo::bits(x) & uo::splat(0x7FFFFFFFu);
    const uvec code = encode_magnitude(a, s, r20);
    static_assert(v_max_code == 255, "the saturating store clamps v's codes (all below 2^12)");
    uo::store_u8_saturated(c, uo::select_lt(uo::splat(0), a, uo::max(code, uo::splat(1)), code));
  }
};

/// The update rule on one vector (adam_kernel's body, non-optax form): new m, v and p.
template <class Arch>
struct adam_rule {
  using ops = simd_ops<Arch>;
  using vec = typename ops::vec;
  struct constants {
    vec grad_scale, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2, eps, eps_root, decay,
        lr, nesterov_m, nesterov_g, lr_wd;
    decay_kind decay_mode;
    bool nesterov;
    explicit constants(const compressed_call& k)
        : grad_scale(ops::splat(k.s.grad_scale)), l2(ops::splat(k.s.l2)), beta1(ops::splat(k.s.beta1)),
          one_minus_beta1(ops::splat(k.s.one_minus_beta1)), beta2(ops::splat(k.s.beta2)),
          one_minus_beta2(ops::splat(k.s.one_minus_beta2)), step_size(ops::splat(k.s.step_size)),
          inv_bc2(ops::splat(k.s.inv_bc2)), eps(ops::splat(k.s.eps)), eps_root(ops::splat(k.s.eps_root)),
          decay(ops::splat(k.s.decay)), lr(ops::splat(k.s.lr)), nesterov_m(ops::splat(k.s.nesterov_m)),
          nesterov_g(ops::splat(k.s.nesterov_g)), lr_wd(ops::splat(k.s.lr_wd)), decay_mode(k.decay),
          nesterov(k.nesterov) {}
  };
  /// m and v in, new m and v out (canonical NaNs when CanonMoments: the 8-bit codec
  /// poisons a block for any NaN, so it skips that); returns the new p (canonical), or with
  /// Delta (the optax form) the update new_p - p as adam_kernel's Delta computes it.
  template <bool CanonMoments = true, bool Delta = false>
  static vec apply(const constants& c, vec g, vec pp, vec& m, vec& v) noexcept {
    g = g * c.grad_scale;
    if (c.decay_mode == decay_kind::coupled) g = g + c.l2 * pp;
    const vec mm = c.beta1 * m + c.one_minus_beta1 * g;
    const vec vv = c.beta2 * v + c.one_minus_beta2 * (g * g);
    if constexpr (CanonMoments) {
      m = ops::canon(mm);
      v = ops::canon(vv);
    } else {
      m = mm;
      v = vv;
    }
    const vec denom = ops::sqrt(vv * c.inv_bc2 + c.eps_root) + c.eps;
    if constexpr (Delta) {
      const vec step = c.nesterov ? ops::div(c.lr * (c.nesterov_m * mm + c.nesterov_g * g), denom)
                                  : ops::div(c.step_size * mm, denom);
      vec u = ops::splat(0.0f) - step;
      if (c.decay_mode == decay_kind::decoupled) u = u - c.lr_wd * pp;
      return ops::canon(u);
    }
    if (c.decay_mode == decay_kind::decoupled) pp = pp * c.decay;
    if (c.nesterov) pp = pp - ops::div(c.lr * (c.nesterov_m * mm + c.nesterov_g * g), denom);
    else pp = pp - ops::div(c.step_size * mm, denom);
    return ops::canon(pp);
  }
};

/// Runs fn(call, p, m, v, scales, grad, out, n) on pieces that each lie in one 2^32-element
/// span of indices (one span key), advancing every pointer.
template <class Step>
inline void by_index_span(const compressed_call& k, std::size_t n, Step&& step) noexcept {
  std::size_t done = 0;
  while (done < n) {
    const std::uint64_t first = k.first + done;
    const std::uint64_t span_end = ((first >> 32) + 1) << 32;
    const std::size_t len = std::size_t(std::min<std::uint64_t>(n - done, span_end - first));
    step(done, len, span_key(k.key, first), std::uint32_t(first));
    done += len;
  }
}

/// The names both compressed kernels use.
template <class Arch>
struct compressed_kernel_base {
  using ops = simd_ops<Arch>;
  using uo = uint_ops<Arch>;
  using codec = moment_codec<Arch>;
  using rule = adam_rule<Arch>;
  using vec = typename ops::vec;
  using uvec = typename uo::uvec;
  static constexpr std::size_t W = ops::width;

  /// Prefetches every line of a unit's streams ahead (prefetch.hpp): a q8 block's 32
  /// elements, or a bf16 vector's. A null p (Delta without decay) is skipped.
  template <bool Delta, class M, class G>
  static void prefetch_ahead(const float* p, const M* m, const M* v, const G* grad) noexcept {
    constexpr std::size_t U = std::is_same_v<M, std::uint8_t> ? q8_block : W;
    if (!Delta || p) prefetch_unit_ahead<!Delta, U * sizeof(float)>(p);
    prefetch_unit_ahead<true, U * sizeof(M)>(m);
    prefetch_unit_ahead<true, U * sizeof(M)>(v);
    prefetch_unit_ahead<false, U * sizeof(G)>(grad);
  }

  /// The parameters a vector's update reads: with Delta, null p (the optax form without
  /// decay, which reads none) is zeros.
  template <bool Delta>
  static vec load_p(const float* p) noexcept {
    if constexpr (Delta) return p ? ops::load(p) : ops::splat(0.0f);
    else return ops::load(p);
  }

  /// Runs unit(stream tag, at, lo, key) on whole units of U elements of each 2^32-index span
  /// and tail(at, len, lo, key) on a last partial unit. The copy-out's store kind is decided
  /// per span (the part after a 2^32 boundary may start unaligned) and passed as a type, so
  /// no vector tests it; streamed stores are fenced at the end. Never streamed unless
  /// MayStream (the optax form's update is read back at once: it stays cached).
  template <std::size_t U, bool MayStream, class O, class Unit, class Tail>
  static void over_units(const compressed_call& k, O* out, std::size_t n, Unit&& unit, Tail&& tail) noexcept {
    bool streamed = false;
    by_index_span(k, n, [&](std::size_t at, std::size_t len, std::uint32_t key, std::uint32_t lo) {
      const bool stream = MayStream && stream_copy_out<ops>(out_at(out, at), len);
      streamed = streamed || stream;
      std::size_t i = 0;
      auto whole = [&](auto stream_tag) {
        for (; i + U <= len; i += U) unit(stream_tag, at + i, lo + std::uint32_t(i), key);
      };
      if (stream) whole(std::true_type{});
      else whole(std::false_type{});
      if (i < len) tail(at + i, len - i, lo + std::uint32_t(i), key);
    });
    if (streamed) ops::stream_fence();
  }
};

// bf16 moments: m and v are bf16_t arrays at element `first`; `scales` is unused.
// Delta = true is the optax form (adam_kernel's): p is only read, and only when the step
// decays (it may be null otherwise); `out` (O = G) receives the update new_p - p.
template <class Arch, class G, class O, bool Delta = false>
struct adam_bf16_state_kernel : compressed_kernel_base<Arch> {
  using base = compressed_kernel_base<Arch>;
  using typename base::ops, typename base::uo, typename base::codec, typename base::rule, typename base::vec,
      typename base::uvec;
  using base::W;

  template <bool Stream>
  static void block(const typename rule::constants& c, float* p, bf16_t* m, bf16_t* v, const G* grad, O* out,
                    std::uint32_t lo, std::uint32_t key) noexcept {
    base::template prefetch_ahead<Delta>(p, m, v, grad);
    vec mm = ops::load(m), vv = ops::load(v);
    const vec pp = rule::template apply<true, Delta>(c, ops::load(grad), base::template load_p<Delta>(p), mm, vv);
    if constexpr (!Delta) ops::store(p, pp);
    store_copy_out<ops>(out, pp, Stream);
    codec::store_bf16_pair(m, v, mm, vv, codec::sequence(lo, key));
  }

  static block_counts run(const compressed_call& k, float* p, void* m_raw, void* v_raw, std::uint8_t*,
                          const void* grad_raw, void* out_raw, std::size_t n) noexcept {
    const typename rule::constants c(k);
    const G* grad = static_cast<const G*>(grad_raw);
    O* out = static_cast<O*>(out_raw);
    bf16_t* m = static_cast<bf16_t*>(m_raw);
    bf16_t* v = static_cast<bf16_t*>(v_raw);
    base::template over_units<W, !Delta>(
        k, out, n,
        [&](auto stream, std::size_t j, std::uint32_t lo, std::uint32_t key) {
          block<decltype(stream)::value>(c, !Delta || p ? p + j : p, m + j, v + j, grad + j, out_at(out, j), lo, key);
        },
        [&](std::size_t j, std::size_t r, std::uint32_t lo, std::uint32_t key) {
          // Tail: the same vector code on a zero-padded copy.
          alignas(64) float pb[W] = {};
          bf16_t mb[W] = {}, vb[W] = {};
          G gb[W] = {};
          O ob[W] = {};
          if (p) std::memcpy(pb, p + j, r * sizeof(float));
          std::memcpy(mb, m + j, r * sizeof(bf16_t));
          std::memcpy(vb, v + j, r * sizeof(bf16_t));
          std::memcpy(gb, grad + j, r * sizeof(G));
          block<false>(c, pb, mb, vb, gb, ob, lo, key);
          if constexpr (!Delta) std::memcpy(p + j, pb, r * sizeof(float));
          std::memcpy(m + j, mb, r * sizeof(bf16_t));
          std::memcpy(v + j, vb, r * sizeof(bf16_t));
          if constexpr (!std::is_same_v<O, no_out>) std::memcpy(out + j, ob, r * sizeof(O));
        });
    return {}; // per-element values: no block to poison or saturate
  }
};

// q8 moments: m and v are one code byte per element at element `first` (a multiple of
// q8_block); scales holds two bytes per block (m's base, v's base) from block first / q8_block.
// A call covers whole blocks, except that its last block may end early (a tensor's end).
// Delta as for adam_bf16_state_kernel.
template <class Arch, class G, class O, bool Delta = false>
struct adam_q8_state_kernel : compressed_kernel_base<Arch> {
  using base = compressed_kernel_base<Arch>;
  using typename base::ops, typename base::uo, typename base::codec, typename base::rule, typename base::vec,
      typename base::uvec;
  using base::W;
  static constexpr std::size_t V = q8_block / W;

  /// One block between update and encode: its new moments, their largest magnitudes and
  /// the smallest v of the elements with a nonzero gradient (moment_codec::saturated).
  struct updated {
    vec mm[V], vv[V];
    uvec m_max, v_max, v_low;
  };

  /// Decodes a block's moments and updates p (and the copy-out) and the moments.
  template <bool Stream>
  static void update(const typename rule::constants& c, float* p, const std::uint8_t* m, const std::uint8_t* v,
                     const std::uint8_t* scales, const G* grad, O* out, updated& u) noexcept {
    base::template prefetch_ahead<Delta>(p, m, v, grad);
    u.m_max = uo::splat(0);
    u.v_max = uo::splat(0);
    u.v_low = uo::splat(0xFFFFFFFFu);
    const std::uint32_t m_base = scales[0], v_base = scales[1];
    const typename codec::scale m_in(m_base), v_in(v_base);
    for (std::size_t j = 0; j < V; ++j) {
      u.mm[j] = codec::decode_m(m + j * W, m_base, m_in);
      u.vv[j] = codec::decode_v(v + j * W, v_base, v_in);
      const vec pin = base::template load_p<Delta>(!Delta || p ? p + j * W : p);
      const vec g = ops::load(grad + j * W);
      const vec pp = rule::template apply<false, Delta>(c, g, pin, u.mm[j], u.vv[j]);
      if constexpr (!Delta) ops::store(p + j * W, pp);
      store_copy_out<ops>(out_at(out, j * W), pp, Stream);
      const uvec v_mag = uo::bits(u.vv[j]) & uo::splat(0x7FFFFFFFu);
      u.m_max = uo::max(u.m_max, uo::bits(u.mm[j]) & uo::splat(0x7FFFFFFFu));
      u.v_max = uo::max(u.v_max, v_mag);
      u.v_low = uo::min_where_magnitude(u.v_low, v_mag - uo::splat(1), g);
    }
  }

  /// Encodes an updated block with new bases from its largest magnitudes; counts it in
  /// `seen` when it is poisoned or saturated.
  static void encode(const updated& u, std::uint8_t* m, std::uint8_t* v, std::uint8_t* scales, std::uint32_t lo,
                     std::uint32_t key, block_counts& seen) noexcept {
    const std::uint32_t m_top = uo::reduce_max(u.m_max), v_top = uo::reduce_max(u.v_max);
    const std::uint32_t new_m_base = codec::base_for(m_top, codec::m_max_code);
    const std::uint32_t new_v_base = codec::base_for(v_top, codec::v_max_code);
    const bool poisoned = new_m_base == codec::poisoned || new_v_base == codec::poisoned;
    seen.poisoned += poisoned;
    seen.saturated += !poisoned && codec::saturated(m_top, v_top, u.v_low, new_v_base);
    const typename codec::scale m_out(new_m_base), v_out(new_v_base);
    for (std::size_t j = 0; j < V; ++j) {
      const uvec r = codec::random(lo + std::uint32_t(j * W), key);
      codec::encode_m(m + j * W, u.mm[j], new_m_base, m_out, codec::random20_low(r));
      codec::encode_v(v + j * W, u.vv[j], new_v_base, v_out, codec::random20_high(r));
    }
    scales[0] = std::uint8_t(new_m_base);
    scales[1] = std::uint8_t(new_v_base);
  }

  template <bool Stream>
  static void block(const typename rule::constants& c, float* p, std::uint8_t* m, std::uint8_t* v,
                    std::uint8_t* scales, const G* grad, O* out, std::uint32_t lo, std::uint32_t key,
                    block_counts& seen) noexcept {
    updated u;
    update<Stream>(c, p, m, v, scales, grad, out, u);
    encode(u, m, v, scales, lo, key, seen);
  }

  /// Two blocks, both updated before either is encoded: a block's encode waits on its
  /// largest magnitudes (a reduction, then scalar code), and the other block's update
  /// fills that wait. The same bits as two block() calls.
  template <bool Stream>
  static void block_pair(const typename rule::constants& c, float* p, std::uint8_t* m, std::uint8_t* v,
                         std::uint8_t* scales, const G* grad, O* out, std::uint32_t lo, std::uint32_t key,
                         block_counts& seen) noexcept {
    constexpr std::size_t B = q8_block;
    updated a, b;
    update<Stream>(c, p, m, v, scales, grad, out, a);
    update<Stream>(c, !Delta || p ? p + B : p, m + B, v + B, scales + 2, grad + B, out_at(out, B), b);
    encode(a, m, v, scales, lo, key, seen);
    encode(b, m + B, v + B, scales + 2, lo + std::uint32_t(B), key, seen);
  }

  static block_counts run(const compressed_call& k, float* p, void* m_raw, void* v_raw, std::uint8_t* scales,
                          const void* grad_raw, void* out_raw, std::size_t n) noexcept {
    const typename rule::constants c(k);
    block_counts seen;
    const G* grad = static_cast<const G*>(grad_raw);
    O* out = static_cast<O*>(out_raw);
    std::uint8_t* m = static_cast<std::uint8_t*>(m_raw);
    std::uint8_t* v = static_cast<std::uint8_t*>(v_raw);
    // Spans of 2^32 indices start on block boundaries: blocks never straddle them.
    base::template over_units<2 * q8_block, !Delta>(
        k, out, n,
        [&](auto stream, std::size_t j, std::uint32_t lo, std::uint32_t key) {
          block_pair<decltype(stream)::value>(c, !Delta || p ? p + j : p, m + j, v + j, scales + 2 * (j / q8_block),
                                              grad + j, out_at(out, j), lo, key, seen);
        },
        [&](std::size_t j, std::size_t r, std::uint32_t lo, std::uint32_t key) {
          if (r >= q8_block) { // a whole block before the last, partial one
            block<false>(c, !Delta || p ? p + j : p, m + j, v + j, scales + 2 * (j / q8_block), grad + j,
                         out_at(out, j), lo, key, seen);
            j += q8_block;
            r -= q8_block;
            lo += std::uint32_t(q8_block);
            if (r == 0) return;
          }
          // A last block that ends early: on zero-padded copies (zeros never raise its base).
          alignas(64) float pb[q8_block] = {};
          std::uint8_t mb[q8_block] = {}, vb[q8_block] = {};
          G gb[q8_block] = {};
          O ob[q8_block] = {};
          if (p) std::memcpy(pb, p + j, r * sizeof(float));
          std::memcpy(mb, m + j, r);
          std::memcpy(vb, v + j, r);
          std::memcpy(gb, grad + j, r * sizeof(G));
          block<false>(c, pb, mb, vb, scales + 2 * (j / q8_block), gb, ob, lo, key, seen);
          if constexpr (!Delta) std::memcpy(p + j, pb, r * sizeof(float));
          std::memcpy(m + j, mb, r);
          std::memcpy(v + j, vb, r);
          if constexpr (!std::is_same_v<O, no_out>) std::memcpy(out + j, ob, r * sizeof(O));
        });
    return seen;
  }
};

/// Explicit conversions between f32 moments and a compressed format (lossy one way):
/// the kernels' codecs, blocks and tails alike.
template <class Arch, moment_format F>
struct moment_conversion {
  using ops = simd_ops<Arch>;
  using uo = uint_ops<Arch>;
  using codec = moment_codec<Arch>;
  using vec = typename ops::vec;
  using uvec = typename uo::uvec;
  static constexpr std::size_t W = ops::width;
  static constexpr std::size_t B = F == moment_format::q8 ? q8_block : W; // elements per unit
  using code = std::conditional_t<F == moment_format::bf16, bf16_t, std::uint8_t>;

  static void encode_unit(const float* m, const float* v, code* mc, code* vc, std::uint8_t* scales, std::uint32_t lo,
                          std::uint32_t key) noexcept {
    if constexpr (F == moment_format::bf16) {
      const uvec r = codec::random(lo, key);
      codec::store_bf16(mc, ops::canon(ops::load(m)), r & uo::splat(0xFFFF));
      codec::store_bf16(vc, ops::canon(ops::load(v)), r >> 16);
    } else {
      uvec m_max = uo::splat(0), v_max = uo::splat(0);
      for (std::size_t j = 0; j < B; j += W) {
        m_max = uo::max(m_max, uo::bits(ops::canon(ops::load(m + j))) & uo::splat(0x7FFFFFFFu));
        v_max = uo::max(v_max, uo::bits(ops::canon(ops::load(v + j))) & uo::splat(0x7FFFFFFFu));
      }
      const std::uint32_t mb = codec::base_for(uo::reduce_max(m_max), codec::m_max_code);
      const std::uint32_t vb = codec::base_for(uo::reduce_max(v_max), codec::v_max_code);
      const typename codec::scale m_scale(mb), v_scale(vb);
      for (std::size_t j = 0; j < B; j += W) {
        const uvec r = codec::random(lo + std::uint32_t(j), key);
        codec::encode_m(mc + j, ops::canon(ops::load(m + j)), mb, m_scale, codec::random20_low(r));
        codec::encode_v(vc + j, ops::canon(ops::load(v + j)), vb, v_scale, codec::random20_high(r));
      }
      scales[0] = std::uint8_t(mb);
      scales[1] = std::uint8_t(vb);
    }
  }

  static void decode_unit(const code* mc, const code* vc, const std::uint8_t* scales, float* m, float* v) noexcept {
    for (std::size_t j = 0; j < B; j += W) {
      if constexpr (F == moment_format::bf16) {
        ops::store(m + j, ops::load(mc + j));
        ops::store(v + j, ops::load(vc + j));
      } else {
        ops::store(m + j, codec::decode_m(mc + j, scales[0], typename codec::scale(scales[0])));
        ops::store(v + j, codec::decode_v(vc + j, scales[1], typename codec::scale(scales[1])));
      }
    }
  }

  static void encode(const float* m, const float* v, void* mc_raw, void* vc_raw, std::uint8_t* scales, std::size_t n,
                     std::uint64_t key, std::uint64_t first) noexcept {
    code* mc = static_cast<code*>(mc_raw);
    code* vc = static_cast<code*>(vc_raw);
    const compressed_call k{{}, decay_kind::none, false, key, first};
    by_index_span(k, n, [&](std::size_t at, std::size_t len, std::uint32_t span, std::uint32_t lo) {
      std::size_t i = 0;
      for (; i + B <= len; i += B)
        encode_unit(m + at + i, v + at + i, mc + at + i, vc + at + i, scale_at(scales, at + i), lo + std::uint32_t(i),
                    span);
      if (i == len) return;
      const std::size_t r = len - i, j = at + i;
      alignas(64) float mb[B] = {}, vb[B] = {};
      code mo[B] = {}, vo[B] = {};
      std::memcpy(mb, m + j, r * sizeof(float));
      std::memcpy(vb, v + j, r * sizeof(float));
      encode_unit(mb, vb, mo, vo, scale_at(scales, j), lo + std::uint32_t(i), span);
      std::memcpy(mc + j, mo, r * sizeof(code));
      std::memcpy(vc + j, vo, r * sizeof(code));
    });
  }

  static void decode(const void* mc_raw, const void* vc_raw, const std::uint8_t* scales, float* m, float* v,
                     std::size_t n) noexcept {
    const code* mc = static_cast<const code*>(mc_raw);
    const code* vc = static_cast<const code*>(vc_raw);
    std::size_t i = 0;
    for (; i + B <= n; i += B) decode_unit(mc + i, vc + i, scale_at(scales, i), m + i, v + i);
    if (i == n) return;
    const std::size_t r = n - i;
    alignas(64) float mb[B], vb[B];
    code mi[B] = {}, vi[B] = {};
    std::memcpy(mi, mc + i, r * sizeof(code));
    std::memcpy(vi, vc + i, r * sizeof(code));
    decode_unit(mi, vi, scale_at(scales, i), mb, vb);
    std::memcpy(m + i, mb, r * sizeof(float));
    std::memcpy(v + i, vb, r * sizeof(float));
  }

  template <class S>
  static S* scale_at(S* scales, std::size_t i) noexcept {
    if constexpr (F == moment_format::q8) return scales + 2 * (i / q8_block);
    else return scales;
  }
};

/// Roofline twins: the same loads and stores as the compressed kernels, no arithmetic.
template <class Arch, class G, class O, moment_format F>
struct compressed_roofline_kernel {
  using ops = simd_ops<Arch>;
  using uo = uint_ops<Arch>;
  using vec = typename ops::vec;
  using uvec = typename uo::uvec;
  static constexpr std::size_t W = ops::width;
  using code = std::conditional_t<F == moment_format::bf16, std::uint16_t, std::uint8_t>;

  static void run(float* p, void* m_raw, void* v_raw, std::uint8_t* scales, const void* grad_raw, void* out_raw,
                  std::size_t n) noexcept {
    const G* grad = static_cast<const G*>(grad_raw);
    O* out = static_cast<O*>(out_raw);
    code* m = static_cast<code*>(m_raw);
    code* v = static_cast<code*>(v_raw);
    const bool stream = stream_copy_out<ops>(out, n);
    std::size_t i = 0;
    for (; i + W <= n; i += W) {
      prefetch_line<true>(p + i); // the lines the compressed kernels prefetch
      prefetch_line<true>(m + i);
      prefetch_line<true>(v + i);
      prefetch_line<false>(grad + i);
      vec g = ops::load(grad + i), pp = ops::load(p + i);
      uvec mm = load(m + i), vv = load(v + i);
      opaque(g);
      opaque(pp);
      opaque(mm);
      opaque(vv);
      store(m + i, mm);
      store(v + i, vv);
      ops::store(p + i, pp);
      store_copy_out<ops>(out_at(out, i), pp, stream);
      if constexpr (F == moment_format::q8) {
        if (i % q8_block == 0) { // the block's two base bytes
          std::uint8_t* s = scales + 2 * (i / q8_block);
          std::uint8_t a = s[0], b = s[1];
          asm volatile("" : "+r"(a), "+r"(b));
          s[0] = a;
          s[1] = b;
        }
      }
    }
    if (stream) ops::stream_fence();
    for (; i < n; ++i) { // scalar tail: only its memory traffic matters here
      float x = p[i], g = simd_ops<scalar_arch>::load(grad + i);
      opaque(x);
      opaque(g);
      p[i] = x;
      std::uint32_t a = m[i], b = v[i];
      opaque(a);
      opaque(b);
      m[i] = code(a);
      v[i] = code(b);
      if constexpr (!std::is_same_v<O, no_out>) simd_ops<scalar_arch>::store(out + i, x);
    }
  }

  static uvec load(const code* c) noexcept {
    if constexpr (F == moment_format::bf16) return uo::load_u16(c);
    else return uo::load_u8(c);
  }
  static void store(code* c, uvec x) noexcept {
    if constexpr (F == moment_format::bf16) uo::store_u16(c, x);
    else uo::store_u8(c, x);
  }
};

} // namespace HOSTOPT_KERNEL_NS
} // namespace hostopt::detail
