#pragma once
// The fused single-pass Adam/AdamW kernel, written once for every instruction set.
//
//   g  = grad_scale * grad                 (grad read in its own dtype)
//   g  = g + l2 * p                        (coupled decay: Adam mode)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * (g * g)
//   p  = p * (1 - lr * wd)                 (decoupled decay: AdamW mode)
//   d  = sqrt(v * (1 / bc2) + eps_root) + eps
//   p  = p - (step_size * m) / d           step_size = lr / bc1
//   p  = p - (lr * (cm * m + cg * g)) / d  nesterov (optax nadam): cm = b1 / (1 - b1^(t+1)),
//                                          cg = (1 - b1) / (1 - b1^t)
//   out = round_to_nearest_even<out dtype>(p)
//
// Every operation is a correctly rounded IEEE add, mul, div or sqrt, in the same order for
// every instruction set; there is deliberately no fused multiply-add, because the x86-64
// baseline (SSE2) has none, and a kernel that is memory-bound gains nothing from it. With
// -ffp-contract=off on these files the compiler cannot fuse either, so every kernel,
// thread count and chunking produces the same bits. The tail (n % width elements) runs
// through the same vector code on a padded copy.
//
// Only included by the per-instruction-set translation units (cpu_adam/arch_*.cpp).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernel_set.hpp"
#include "prefetch.hpp"
#include "simd_ops.hpp"

namespace hostopt::detail {
namespace HOSTOPT_KERNEL_NS {

/// Tag: no parameter copy-out.
struct no_out {};

/// Copy-outs at least this large go around the caches.
inline constexpr std::size_t stream_min_bytes = std::size_t(1) << 20;

/// Whether a parameter copy-out of n elements at `out` is written with non-temporal
/// stores. Nothing reads it back before the next forward, so for a large one the
/// cache-line reads that ordinary stores make first (write-allocate) are pure traffic:
/// +20-30% time for an f32 copy-out at 64M params, measured. Small copy-outs stay in cache
/// for whoever reads them next. Stores only, so every kernel still writes the same bits.
template <class Ops, class O>
bool stream_copy_out(const O* out, std::size_t n) noexcept {
  if constexpr (std::is_same_v<O, no_out>) {
    return false;
  } else {
    constexpr bool supported = std::is_same_v<O, float> ? Ops::streams_f32 : Ops::streams_16;
    return supported && n * sizeof(O) >= stream_min_bytes &&
           reinterpret_cast<std::uintptr_t>(out) % (Ops::width * sizeof(O)) == 0;
  }
}

/// Where element i of a copy-out is (no_out: nowhere).
template <class O>
inline O* out_at(O* out, std::size_t i) noexcept {
  if constexpr (std::is_same_v<O, no_out>) return out;
  else return out + i;
}

/// Stores x, canonical (its only NaN 0x7FC00000: the kernels canonicalise their results), to
/// a copy-out, non-temporally when `stream` (no_out: nothing). Where an instruction set
/// has a cheaper conversion for canonical input (store_canonical), it is used.
template <class Ops, class O>
inline void store_copy_out(O* out, typename Ops::vec x, bool stream) noexcept {
  if constexpr (requires { Ops::store_canonical(out, x); }) {
    if (stream) Ops::stream_canonical(out, x);
    else Ops::store_canonical(out, x);
  } else if constexpr (!std::is_same_v<O, no_out>) {
    if (stream) Ops::stream(out, x);
    else Ops::store(out, x);
  }
}

// Delta = true is the optax form: p is only read (and only for weight decay), and `out`
// (in the gradient's dtype) receives the update u = new_p - p = -(adam step) - lr*wd*p.
template <class Arch, class G, class O, decay_kind D, bool Nesterov, bool Delta = false>
struct adam_kernel {
  static constexpr bool reads_p = !Delta || D != decay_kind::none;
  using ops = simd_ops<Arch>;
  using vec = typename ops::vec;
  static constexpr std::size_t W = ops::width;

  struct constants {
    vec grad_scale, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2, eps,
        eps_root, decay, lr, nesterov_m, nesterov_g, lr_wd;
  };

  template <bool Stream = false>
  static void body(const constants& c, float* p, float* m, float* v, const G* grad, O* out) noexcept {
    if constexpr (reads_p) prefetch_line<!Delta>(p);
    prefetch_line<true>(m);
    prefetch_line<true>(v);
    prefetch_line<false>(grad);
    vec g = ops::load(grad) * c.grad_scale;
    vec pp = ops::splat(0.0f);
    if constexpr (reads_p) pp = ops::load(p);
    if constexpr (D == decay_kind::coupled) g = g + c.l2 * pp;
    const vec mm = c.beta1 * ops::load(m) + c.one_minus_beta1 * g;
    const vec vv = c.beta2 * ops::load(v) + c.one_minus_beta2 * (g * g);
    ops::store(m, ops::canon(mm)); // NaNs stored canonical: the same bits on every CPU
    ops::store(v, ops::canon(vv));
    const vec denom = ops::sqrt(vv * c.inv_bc2 + c.eps_root) + c.eps;
    if constexpr (Delta) {
      vec step;
      if constexpr (Nesterov) step = ops::div(c.lr * (c.nesterov_m * mm + c.nesterov_g * g), denom);
      else step = ops::div(c.step_size * mm, denom);
      vec u = ops::splat(0.0f) - step;
      if constexpr (D == decay_kind::decoupled) u = u - c.lr_wd * pp;
      store_copy_out<ops>(out, ops::canon(u), Stream);
      return;
    }
    if constexpr (D == decay_kind::decoupled) pp = pp * c.decay;
    if constexpr (Nesterov) {
      pp = pp - ops::div(c.lr * (c.nesterov_m * mm + c.nesterov_g * g), denom);
    } else {
      pp = pp - ops::div(c.step_size * mm, denom);
    }
    pp = ops::canon(pp);
    ops::store(p, pp);
    store_copy_out<ops>(out, pp, Stream);
  }

  static void run(const step_scalars& s, float* p, float* m, float* v, const void* grad_raw,
                  void* out_raw, std::size_t n) noexcept {
    const constants c{ops::splat(s.grad_scale), ops::splat(s.l2),         ops::splat(s.beta1),
                      ops::splat(s.one_minus_beta1), ops::splat(s.beta2), ops::splat(s.one_minus_beta2),
                      ops::splat(s.step_size),  ops::splat(s.inv_bc2),    ops::splat(s.eps),
                      ops::splat(s.eps_root),   ops::splat(s.decay),      ops::splat(s.lr),
                      ops::splat(s.nesterov_m), ops::splat(s.nesterov_g), ops::splat(s.lr_wd)};
    const G* grad = static_cast<const G*>(grad_raw);
    O* out = static_cast<O*>(out_raw);
    std::size_t i = 0;
    // The optax form's update is read back at once (apply_updates): it stays cached.
    if (!Delta && stream_copy_out<ops>(out, n)) {
      for (; i + W <= n; i += W) body<true>(c, reads_p ? p + i : p, m + i, v + i, grad + i, out_at(out, i));
      ops::stream_fence(); // ordered before whatever signals the copy-out done
    } else {
      for (; i + W <= n; i += W) body(c, reads_p ? p + i : p, m + i, v + i, grad + i, out_at(out, i));
    }
    if (i == n) return;
    // Tail: same vector code on a zero-padded copy (zeros are harmless inputs).
    const std::size_t r = n - i;
    alignas(64) float pb[W] = {}, mb[W] = {}, vb[W] = {};
    G gb[W] = {};
    O ob[W] = {};
    if constexpr (reads_p) std::memcpy(pb, p + i, r * sizeof(float));
    std::memcpy(mb, m + i, r * sizeof(float));
    std::memcpy(vb, v + i, r * sizeof(float));
    std::memcpy(gb, grad + i, r * sizeof(G));
    body(c, pb, mb, vb, gb, ob);
    if constexpr (!Delta) std::memcpy(p + i, pb, r * sizeof(float));
    std::memcpy(m + i, mb, r * sizeof(float));
    std::memcpy(v + i, vb, r * sizeof(float));
    if constexpr (!std::is_same_v<O, no_out>) std::memcpy(out + i, ob, r * sizeof(O));
  }

};

/// Keeps a value opaque to the optimizer at no cost, so loads that feed it and stores of
/// it cannot be elided or merged.
template <class V>
inline void opaque(V& x) noexcept {
#if defined(__GNUC__)
  if constexpr (std::is_same_v<V, float>) asm volatile("" : "+x"(x));
  else if constexpr (std::is_integral_v<V>) asm volatile("" : "+r"(x));
  else asm volatile("" : "+x"(x.data));
#endif
}

/// The roofline kernel: the same loads and stores as adam_kernel (p, m, v, grad read;
/// p, m, v and the copy-out written, each element once, in the same order), no
/// arithmetic. Each stream writes back what it read, so the cache-line traffic is
/// exactly the step's.
template <class Arch, class G, class O>
struct roofline_kernel {
  using ops = simd_ops<Arch>;
  using vec = typename ops::vec;
  static constexpr std::size_t W = ops::width;

  template <bool Stream = false>
  static void body(float* p, float* m, float* v, const G* grad, O* out) noexcept {
    prefetch_line<true>(p); // the lines adam_kernel prefetches
    prefetch_line<true>(m);
    prefetch_line<true>(v);
    prefetch_line<false>(grad);
    vec g = ops::load(grad);
    vec pp = ops::load(p);
    vec mm = ops::load(m);
    vec vv = ops::load(v);
    opaque(g);
    opaque(pp);
    opaque(mm);
    opaque(vv);
    ops::store(m, mm);
    ops::store(v, vv);
    ops::store(p, pp);
    store_copy_out<ops>(out, pp, Stream); // the kernel's conversion and store
  }

  static void run(float* p, float* m, float* v, const void* grad_raw, void* out_raw, std::size_t n) noexcept {
    const G* grad = static_cast<const G*>(grad_raw);
    O* out = static_cast<O*>(out_raw);
    std::size_t i = 0;
    const bool stream = stream_copy_out<ops>(out, n); // the same stores as adam_kernel
    for (; i + W <= n; i += W) {
      if constexpr (std::is_same_v<O, no_out>) body(p + i, m + i, v + i, grad + i, out);
      else if (stream) body<true>(p + i, m + i, v + i, grad + i, out + i);
      else body(p + i, m + i, v + i, grad + i, out + i);
    }
    if (stream) ops::stream_fence();
    for (; i < n; ++i) { // scalar tail: only its memory traffic matters here
      float x = p[i], y = m[i], z = v[i], g = simd_ops<scalar_arch>::load(grad + i);
      opaque(x);
      opaque(y);
      opaque(z);
      opaque(g);
      p[i] = x;
      m[i] = y;
      v[i] = z;
      if constexpr (!std::is_same_v<O, no_out>) simd_ops<scalar_arch>::store(out + i, x);
    }
  }
};

/// f32 -> 16-bit conversion pass, with the same rounding as the kernel's copy-out.
template <class Arch, class O>
struct cast_kernel {
  using ops = simd_ops<Arch>;
  static constexpr std::size_t W = ops::width;
  static void run(const float* in, void* out_raw, std::size_t n) noexcept {
    O* out = static_cast<O*>(out_raw);
    std::size_t i = 0;
    for (; i + W <= n; i += W) ops::store(out + i, ops::load(in + i));
    if (i == n) return;
    alignas(64) float ib[W] = {};
    O ob[W] = {};
    std::memcpy(ib, in + i, (n - i) * sizeof(float));
    ops::store(ob, ops::load(ib));
    std::memcpy(out + i, ob, (n - i) * sizeof(O));
  }
};

/// Gradient accumulation: dst = decode(grad) (+ acc).
template <class Arch, class G>
struct add_grad_kernel {
  using ops = simd_ops<Arch>;
  static constexpr std::size_t W = ops::width;
  static void run(float* dst, const float* acc, const void* grad_raw, std::size_t n) noexcept {
    const G* grad = static_cast<const G*>(grad_raw);
    std::size_t i = 0;
    if (acc) {
      for (; i + W <= n; i += W) ops::store(dst + i, ops::canon(ops::load(grad + i) + ops::load(acc + i)));
    } else {
      for (; i + W <= n; i += W) ops::store(dst + i, ops::load(grad + i));
    }
    for (; i < n; ++i) { // exact either way: a decode and one IEEE add
      const float g = simd_ops<scalar_arch>::load(grad + i);
      dst[i] = acc ? simd_ops<scalar_arch>::canon(g + acc[i]) : g;
    }
  }
};

/// Sum of squares for the gradient statistics. Each element is widened to double and
/// squared exactly (24-bit mantissas: the product fits in 53 bits); lane j of 16 sums
/// elements j, j+16, ... in order, and the lanes are combined by a fixed tree, so the
/// result does not depend on the vector width. A non-finite element makes it non-finite.
template <class Arch, class G>
struct sumsq_kernel {
  using ops = simd_ops<Arch>;
  static constexpr std::size_t W = ops::width; // 1, 4, 8 or 16: divides 16
  static double run(const void* grad_raw, std::size_t n) noexcept {
    const G* grad = static_cast<const G*>(grad_raw);
    double acc[16] = {};
    alignas(64) float tmp[16];
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      for (std::size_t k = 0; k < 16; k += W) ops::store(tmp + k, ops::load(grad + i + k));
      for (std::size_t j = 0; j < 16; ++j) acc[j] += double(tmp[j]) * double(tmp[j]);
    }
    for (std::size_t j = 0; i + j < n; ++j) {
      const double x = simd_ops<scalar_arch>::load(grad + i + j);
      acc[j] += x * x;
    }
    for (std::size_t width = 8; width >= 1; width /= 2)
      for (std::size_t j = 0; j < width; ++j) acc[j] = acc[j] + acc[j + width];
    return acc[0];
  }
};

} // namespace HOSTOPT_KERNEL_NS
} // namespace hostopt::detail

#include "compressed_kernel.hpp"

namespace hostopt::detail {
namespace HOSTOPT_KERNEL_NS {

// --- the table an instruction set exports ------------------------------------------------

template <class Arch, class G, class O>
constexpr void fill_adam_variants(adam_fn (&t)[num_decay_kinds][2]) {
  t[0][0] = &adam_kernel<Arch, G, O, decay_kind::none, false>::run;
  t[0][1] = &adam_kernel<Arch, G, O, decay_kind::none, true>::run;
  t[1][0] = &adam_kernel<Arch, G, O, decay_kind::coupled, false>::run;
  t[1][1] = &adam_kernel<Arch, G, O, decay_kind::coupled, true>::run;
  t[2][0] = &adam_kernel<Arch, G, O, decay_kind::decoupled, false>::run;
  t[2][1] = &adam_kernel<Arch, G, O, decay_kind::decoupled, true>::run;
}

template <class Arch, class G>
constexpr void fill_delta_variants(adam_fn (&t)[num_decay_kinds][2]) {
  t[0][0] = &adam_kernel<Arch, G, G, decay_kind::none, false, true>::run;
  t[0][1] = &adam_kernel<Arch, G, G, decay_kind::none, true, true>::run;
  t[1][0] = &adam_kernel<Arch, G, G, decay_kind::coupled, false, true>::run;
  t[1][1] = &adam_kernel<Arch, G, G, decay_kind::coupled, true, true>::run;
  t[2][0] = &adam_kernel<Arch, G, G, decay_kind::decoupled, false, true>::run;
  t[2][1] = &adam_kernel<Arch, G, G, decay_kind::decoupled, true, true>::run;
}

template <class Arch, class G>
constexpr void fill_grad_type(kernel_table& s, int gi) {
  fill_delta_variants<Arch, G>(s.delta[gi]);
  fill_adam_variants<Arch, G, no_out>(s.adam[gi][0]);
  fill_adam_variants<Arch, G, float>(s.adam[gi][1]);
  fill_adam_variants<Arch, G, bf16_t>(s.adam[gi][2]);
  fill_adam_variants<Arch, G, f16_t>(s.adam[gi][3]);
  s.roofline[gi][0] = &roofline_kernel<Arch, G, no_out>::run;
  s.roofline[gi][1] = &roofline_kernel<Arch, G, float>::run;
  s.roofline[gi][2] = &roofline_kernel<Arch, G, bf16_t>::run;
  s.roofline[gi][3] = &roofline_kernel<Arch, G, f16_t>::run;
}

template <class Arch, class G, class O>
constexpr void fill_compressed(kernel_table& s, int gi, int oi) {
  s.adam_compressed[0][gi][oi] = &adam_bf16_state_kernel<Arch, G, O>::run;
  s.adam_compressed[1][gi][oi] = &adam_q8_state_kernel<Arch, G, O>::run;
  s.roofline_compressed[0][gi][oi] = &compressed_roofline_kernel<Arch, G, O, moment_format::bf16>::run;
  s.roofline_compressed[1][gi][oi] = &compressed_roofline_kernel<Arch, G, O, moment_format::q8>::run;
}

template <class Arch, class G>
constexpr void fill_compressed_grad_type(kernel_table& s, int gi) {
  fill_compressed<Arch, G, no_out>(s, gi, 0);
  fill_compressed<Arch, G, float>(s, gi, 1);
  fill_compressed<Arch, G, bf16_t>(s, gi, 2);
  fill_compressed<Arch, G, f16_t>(s, gi, 3);
  s.delta_compressed[0][gi] = &adam_bf16_state_kernel<Arch, G, G, true>::run;
  s.delta_compressed[1][gi] = &adam_q8_state_kernel<Arch, G, G, true>::run;
}

template <class Arch>
constexpr kernel_set make_kernel_set(const char* name, const char* description, const char* required) {
  kernel_table s{};
  fill_grad_type<Arch, float>(s, 0);
  fill_grad_type<Arch, bf16_t>(s, 1);
  fill_grad_type<Arch, f16_t>(s, 2);
  s.cast[2] = &cast_kernel<Arch, bf16_t>::run;
  s.cast[3] = &cast_kernel<Arch, f16_t>::run;
  s.add_grad[0] = &add_grad_kernel<Arch, float>::run;
  s.add_grad[1] = &add_grad_kernel<Arch, bf16_t>::run;
  s.add_grad[2] = &add_grad_kernel<Arch, f16_t>::run;
  s.sumsq[0] = &sumsq_kernel<Arch, float>::run;
  s.sumsq[1] = &sumsq_kernel<Arch, bf16_t>::run;
  s.sumsq[2] = &sumsq_kernel<Arch, f16_t>::run;
  fill_compressed_grad_type<Arch, float>(s, 0);
  fill_compressed_grad_type<Arch, bf16_t>(s, 1);
  fill_compressed_grad_type<Arch, f16_t>(s, 2);
  s.encode_moments[0] = &moment_conversion<Arch, moment_format::bf16>::encode;
  s.encode_moments[1] = &moment_conversion<Arch, moment_format::q8>::encode;
  s.decode_moments[0] = &moment_conversion<Arch, moment_format::bf16>::decode;
  s.decode_moments[1] = &moment_conversion<Arch, moment_format::q8>::decode;
  return kernel_set(name, description, required, s);
}

} // namespace HOSTOPT_KERNEL_NS
} // namespace hostopt::detail
