#pragma once
// Independent helpers for the tests: a double-precision reference of the update rule,
// 16-bit float encoding written without hostopt's code, random inputs, ulp distance.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "hostopt/hostopt.hpp"

namespace ref {

/// Names of the kernels this CPU supports (every test runs on all of them).
inline std::vector<std::string> supported_kernels() {
  std::vector<std::string> names;
  for (const auto& k : hostopt::kernels())
    if (k.supported) names.push_back(k.name);
  return names;
}

/// Step options that trust the gradients (no non-finite check): what a pipeline step
/// needs when no norm is known before its first chunk.
inline hostopt::step_options trusting() {
  hostopt::step_options o;
  o.skip_nonfinite = false;
  return o;
}

inline std::uint32_t bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// f16 through the compiler's half type (IEEE conversion, round to nearest even): _Float16
// on x86-64, __fp16 (IEEE format) on aarch64, where g++ 12's C++ has no _Float16.
#if defined(__aarch64__)
using compiler_half = __fp16;
#else
using compiler_half = _Float16;
#endif
inline std::uint16_t to_f16(float x) {
  compiler_half h = static_cast<compiler_half>(x);
  std::uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
inline float from_f16(std::uint16_t u) {
  compiler_half h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}

// bf16 by choosing the nearer of the two neighbouring bf16 values (ties to even mantissa),
// compared in double: a different algorithm from the library's integer rounding.
inline std::uint16_t to_bf16(float x) {
  if (std::isnan(x)) return std::uint16_t((bits(x) >> 16) | 0x40);
  const std::uint32_t u = bits(x);
  const std::uint32_t lo = u & 0xFFFF0000u;
  if (lo == u) return std::uint16_t(u >> 16);
  const std::uint32_t hi = lo + 0x10000u;
  const double dlo = std::fabs(double(x) - double(from_bits(lo)));
  const double dhi = std::isinf(from_bits(hi)) ? std::fabs(double(x) - std::ldexp(1.0, 128) * (x < 0 ? -1 : 1))
                                                : std::fabs(double(x) - double(from_bits(hi)));
  if (dlo < dhi) return std::uint16_t(lo >> 16);
  if (dhi < dlo) return std::uint16_t(hi >> 16);
  return std::uint16_t(((lo >> 16) & 1) ? hi >> 16 : lo >> 16);
}
inline float from_bf16(std::uint16_t u) { return from_bits(std::uint32_t(u) << 16); }

/// A gradient buffer of any dtype with its exact f32 values.
struct grad_buffer {
  hostopt::dtype type;
  std::vector<float> f32;          // used when type == f32
  std::vector<std::uint16_t> half; // used otherwise
  std::vector<float> values;       // the exact value of every element

  hostopt::const_view view(std::size_t offset = 0, std::size_t n = std::size_t(-1)) const {
    if (n == std::size_t(-1)) n = values.size() - offset;
    if (type == hostopt::dtype::f32) return {f32.data() + offset, n, type};
    return {half.data() + offset, n, type};
  }
};

inline grad_buffer random_grad(hostopt::dtype t, std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  grad_buffer g{t, {}, {}, {}};
  g.values.resize(n);
  if (t == hostopt::dtype::f32) g.f32.resize(n);
  else g.half.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = nd(rng);
    if (t == hostopt::dtype::f32) {
      g.f32[i] = x;
      g.values[i] = x;
    } else if (t == hostopt::dtype::bf16) {
      g.half[i] = std::uint16_t(bits(x) >> 16); // exactly representable values
      g.values[i] = from_bf16(g.half[i]);
    } else {
      g.half[i] = to_f16(x);
      g.values[i] = from_f16(g.half[i]);
    }
  }
  return g;
}

/// Adam state owned by a test.
struct state {
  std::vector<float> p, m, v;
  explicit state(std::size_t n = 0) : p(n), m(n), v(n) {}
  bool operator==(const state& o) const { // bitwise (NaNs compare by their bits); empty states too
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
    };
    return same(p, o.p) && same(m, o.m) && same(v, o.v);
  }
};

inline state random_state(std::size_t n, std::mt19937& rng) {
  state s(n);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    s.p[i] = nd(rng);
    s.m[i] = 0.1f * nd(rng);
    s.v[i] = 0.01f * std::fabs(nd(rng));
  }
  return s;
}

/// The update rule of docs/design.md in double, for one element, with the magnitudes of the
/// summed terms (float rounding error is bounded relative to those, not to the result).
struct moments_result {
  double m, v, m_terms, v_terms;
};

inline double decoded_grad(const hostopt::adam_config& c, double grad_scale, double p, double grad) {
  double g = grad_scale * grad;
  if (c.mode == hostopt::adam_mode::adam) g += c.weight_decay * p;
  return g;
}

inline moments_result adam_moments(const hostopt::adam_config& c, double grad_scale, double p, double m,
                                   double v, double grad) {
  const double g = decoded_grad(c, grad_scale, p, grad);
  return {c.beta1 * m + (1 - c.beta1) * g, c.beta2 * v + (1 - c.beta2) * g * g,
          std::fabs(c.beta1 * m) + std::fabs((1 - c.beta1) * g),
          std::fabs(c.beta2 * v) + std::fabs((1 - c.beta2) * g * g)};
}

struct param_result {
  double p, p_terms;
};

/// New parameter from the old one and the already-updated moments (m_new, v_new).
inline param_result adam_param(const hostopt::adam_config& c, std::int64_t t, double grad_scale, double p,
                               double m_new, double v_new, double grad) {
  const double g = decoded_grad(c, grad_scale, p, grad);
  const double bc1 = c.bias_correction ? 1 - std::pow(c.beta1, double(t)) : 1;
  const double bc2 = c.bias_correction ? 1 - std::pow(c.beta2, double(t)) : 1;
  const double bc1_next = c.bias_correction ? 1 - std::pow(c.beta1, double(t + 1)) : 1;
  double pp = p;
  if (c.mode == hostopt::adam_mode::adamw) pp *= 1 - c.lr * c.weight_decay;
  const double denom = std::sqrt(v_new / bc2 + c.eps_root) + c.eps;
  double upd, upd_terms;
  if (c.nesterov) {
    const double a = c.beta1 * m_new / bc1_next, b = (1 - c.beta1) * g / bc1;
    upd = c.lr * (a + b) / denom;
    upd_terms = c.lr * (std::fabs(a) + std::fabs(b)) / denom;
  } else {
    upd = c.lr * (m_new / bc1) / denom;
    upd_terms = std::fabs(upd);
  }
  return {pp - upd, std::fabs(pp) + upd_terms};
}

/// |a - b| <= ulps * float epsilon * scale (+ the smallest normal, for values near zero).
inline bool close(double a, double b, double scale, double ulps) {
  return std::fabs(a - b) <= ulps * 1.1920929e-7 * scale + 1e-37;
}

} // namespace ref
