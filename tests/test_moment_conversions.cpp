// The explicit conversions between f32 and compressed moments run with the active kernel:
// this suite runs once per kernel the CPU supports (HOSTOPT_FORCE_ARCH, test_main.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "compressed_test_support.hpp"
#include "hostopt/kernels.hpp"
#include "reference.hpp"

using namespace hostopt;
using namespace compressed_test;

TEST_CASE("conversions: decode is exact, encode is unbiased and seeded, blocks with NaN decode as NaN",
          "[compressed]") {
  const std::size_t n = 64 * 1024;
  std::mt19937 rng(3);
  ref::state s = ref::random_state(n, rng);
  for (moment_format f : formats) {
    INFO("format " << moment_format_name(f));
    packed a = encode(f, s, 1), b = encode(f, s, 1), c = encode(f, s, 2);
    CHECK((a == b));
    CHECK_FALSE((a == c));
    // Decoded values re-encode to themselves (they are on the grid). An 8-bit block whose
    // largest value is in its binade's top eighth takes the next base (room to round up):
    // its grid is then a different one.
    decoded d = decode(a, n);
    ref::state again{n};
    again.m = d.m;
    again.v = d.v;
    packed a2 = encode(f, again, 99);
    if (f == moment_format::bf16) {
      CHECK((a2 == a));
    } else {
      std::size_t same_base = 0, same_codes = 0;
      for (std::size_t b = 0; b < n / q8_block; ++b)
        for (int k : {0, 1}) {
          if (a2.scales[2 * b + k] != a.scales[2 * b + k]) continue;
          ++same_base;
          const auto& x = k ? a.v : a.m;
          const auto& y = k ? a2.v : a2.m;
          same_codes += std::equal(x.begin() + b * q8_block, x.begin() + (b + 1) * q8_block, y.begin() + b * q8_block);
        }
      CHECK(same_codes == same_base);
      CHECK(same_base > n / q8_block); // most of the 2 n / 32 moments' blocks
    }
    // Unbiased: the mean error over many elements is far below one rounding step.
    double err_m = 0, err_v = 0, mag_m = 0, mag_v = 0;
    for (std::size_t i = 0; i < n; ++i) {
      err_m += double(d.m[i]) - s.m[i];
      err_v += double(d.v[i]) - s.v[i];
      mag_m += std::fabs(s.m[i]);
      mag_v += s.v[i];
    }
    const double step = f == moment_format::bf16 ? 1.0 / 256 : 1.0 / 8; // relative rounding step
    CHECK(std::fabs(err_m) < 0.05 * step * mag_m);
    CHECK(std::fabs(err_v) < 0.05 * step * mag_v);
  }
  // A NaN moment: the 8-bit block holding it decodes as NaN, the next block does not.
  ref::state nan_state = s;
  nan_state.v[40] = std::nanf("");
  packed q = encode(moment_format::q8, nan_state);
  const decoded dq = decode(q, n);
  for (std::size_t i = 32; i < 64; ++i) CHECK(std::isnan(dq.v[i]));
  CHECK(std::isfinite(dq.v[31]));
  CHECK(std::isfinite(dq.v[64]));
  CHECK(std::isfinite(dq.m[40]));
  // bf16: only that element.
  packed h = encode(moment_format::bf16, nan_state);
  const decoded dh = decode(h, n);
  CHECK(std::isnan(dh.v[40]));
  CHECK(std::isfinite(dh.v[41]));
}

TEST_CASE("8-bit exponent bytes past the encoder's range decode as NaN, not as negative moments",
          "[compressed]") {
  // The encoder writes at most 239 (m) and 223 (v), or 255 for a non-finite block; larger
  // bytes (corrupt input) spilled into the sign bit before: v byte 254 with code 255 decoded
  // as -9e-35.
  const std::size_t n = 32;
  packed mo(moment_format::q8, n);
  for (auto& c : mo.m) c = 0x7F;
  for (auto& c : mo.v) c = 0xFF;
  for (std::uint8_t m_base : {239, 240, 254}) {
    mo.scales = {m_base, 223};
    const decoded d = decode(mo, n);
    INFO("m base " << int(m_base));
    CHECK((m_base == 239 ? std::isfinite(d.m[0]) && d.m[0] > 0 : std::isnan(d.m[0])));
    CHECK((std::isfinite(d.v[0]) && d.v[0] > 0));
  }
  for (std::uint8_t v_base : {224, 254}) {
    mo.scales = {0, v_base};
    const decoded d = decode(mo, n);
    INFO("v base " << int(v_base));
    for (float x : d.v) CHECK(std::isnan(x));
  }
}

namespace {

// The 8-bit format's definition, in double precision and integer arithmetic, independent of
// the kernels' bit tricks (README, "Compressed moments"): a block's base, a code's value,
// and the stochastic rounding of encode_moments (seed, step 0, element index).
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// The random bits of element i in a span keyed k: x = k + i * 0x6A099E37 (mod 2^32), its
// high half xored into its low.
std::uint32_t rounding_bits(std::uint32_t key, std::uint32_t i) {
  const std::uint32_t x = key + i * 0x6A099E37u;
  return x ^ (x >> 16);
}
// The base of a block whose largest magnitude has bits `max_bits` (top: 15 for m, 31 for v):
// 255 (poisoned) for a NaN, or an infinite m; else the largest exponent after rounding up,
// at most 254, less top.
std::uint32_t q8_base(std::uint32_t max_bits, std::uint32_t top) {
  if (max_bits > 0x7F800000u || (top == 15 && max_bits == 0x7F800000u)) return 255;
  const std::uint32_t e = std::min<std::uint32_t>((max_bits + 0xFFFFF) >> 23, 254);
  return e > top ? e - top : 0;
}
// Magnitude a's code before clamping: its position on the block's grid in 2^-20 code
// units (exact above 2^(base+1-127); below, a * 2^(149-base) rounded to nearest even),
// plus 20 random bits, floored.
std::uint32_t q8_code(float a, std::uint32_t base, std::uint32_t r20) {
  if (std::isinf(a)) return 1u << 16; // clamps to the top code
  double q;
  if (double(a) < std::ldexp(1.0, int(base) - 126)) {
    q = std::nearbyint(std::ldexp(double(a), 149 - int(base)));
  } else { // a = f 2^e, f in [0.5, 1): exponent e - 1 + 127 is (e + 126 - base) binades above the base
    int e;
    const double f = std::frexp(double(a), &e);
    q = std::ldexp((e + 126 - int(base)) * 8.0 + (2 * f - 1) * 8.0, 20);
  }
  return std::uint32_t((std::uint64_t(q) + r20) >> 20);
}

} // namespace

/// The exponents k of kind-5 blocks' largest magnitude 2^k (m's base is k + 112, v's k + 96).
static int pinned_exponent(std::size_t i) {
  static const int k[] = {-111, -110, -109, -108, -107, -106, -105, -104, -103, -102, -101, -100,
                          -99,  -98,  -97,  -96,  13,   14,   15,   16,   29,   30,   31,   32};
  return k[i % std::size(k)];
}

TEST_CASE("8-bit codes are the format's definition: every code at every base, ties and subnormal codes",
          "[compressed]") {
  // Decode: every exponent byte with every code byte, against the value the format defines.
  const std::size_t n = 256 * 256;
  packed all(moment_format::q8, n);
  for (std::size_t i = 0; i < n; ++i) all.m[i] = all.v[i] = std::uint8_t(i % 256);
  for (std::size_t b = 0; b < n / q8_block; ++b) all.scales[2 * b] = all.scales[2 * b + 1] = std::uint8_t(b / 8);
  const decoded d = decode(all, n);
  auto value = [](std::uint32_t c, std::uint32_t base) { // magnitude code c at base
    return c >= 8 ? std::ldexp(1.0 + (c % 8) / 8.0, int(base + c / 8) - 127) : c / 8.0 * std::ldexp(1.0, int(base) - 126);
  };
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t base = std::uint32_t(i / 256), c = std::uint32_t(i % 256);
    const double m = base > 239 ? NAN : (c & 0x80 ? -1 : 1) * value(c & 0x7F, base);
    const double v = base > 223 ? NAN : value(c, base);
    wrong += !(std::isnan(m) ? std::isnan(d.m[i]) : double(d.m[i]) == m && std::signbit(d.m[i]) == std::signbit(m));
    wrong += !(std::isnan(v) ? std::isnan(d.v[i]) : double(d.v[i]) == v);
  }
  CHECK(wrong == 0);

  // Encode: blocks whose largest magnitude is 2^k over the float range; the other values
  // are crafted from their own random bits (the generator's) to sit on the rounding's
  // edges: a subnormal code's position a half grid step below where the random bits carry
  // it into the next code (its nearest-even rounding decides the code), or a normal code's
  // bits exactly there or one below; and subnormal floats. Blocks span the bases: 0 (a tiny
  // maximum), the largest (239 and 223, a maximum near FLT_MAX, where m's top code clamps),
  // an infinite v (saturates) and NaN moments (the block poisoned). Each code against the
  // definition.
  const std::size_t blocks = 4000, N = blocks * q8_block;
  const std::uint64_t seed = 23;
  const std::uint64_t step_key = splitmix64(seed ^ splitmix64(0));
  const std::uint32_t span = std::uint32_t(splitmix64(step_key));
  auto random_bits = [&](std::size_t i) { return rounding_bits(span, std::uint32_t(i)); };
  std::vector<float> em(N), ev(N);
  std::mt19937_64 rng(17);
  for (std::size_t b = 0; b < blocks; ++b) {
    const int kind = int(b % 10);
    // Kind 5 pins the largest magnitude 2^k at bases the random ones miss or reach by chance:
    // m's 1..16 (k = -111..-96) and both moments' 125..128, where the codecs without a
    // power-of-two scale instruction switch from a multiplication to exponent arithmetic.
    const int k = kind == 6   ? -112 - int(rng() % 10)
                  : kind == 7 ? 127
                  : kind == 5 ? pinned_exponent(b / 10)
                              : int(rng() % 216) - 95;
    const float big = kind == 7 ? std::numeric_limits<float>::max() : std::ldexp(1.0f, k);
    em[b * q8_block] = (rng() & 1 ? -1.0f : 1.0f) * big;
    ev[b * q8_block] = kind == 8 ? std::numeric_limits<float>::infinity() : big;
    const int base_m = std::max(1, int(q8_base(ref::bits(big), 15)));
    const int base_v = std::max(1, int(q8_base(ref::bits(ev[b * q8_block]), 31)));
    for (std::size_t j = 1; j < q8_block; ++j) {
      const std::size_t i = b * q8_block + j;
      const std::uint64_t r = rng();
      const std::uint32_t bits = random_bits(i);
      auto crafted = [&](int base, std::uint32_t r20, std::uint32_t top_code) -> float {
        const std::uint32_t c = 1 + std::uint32_t(r >> 8) % top_code; // the code reached
        switch (r % 4) {
        case 0: // subnormal code c: position c 2^20 - r20 - 1/2 on the grid 2^(base-149)
          return float(std::ldexp(double(std::min(c, 7u)) * 1048576.0 - r20 - 0.5, base - 149));
        case 1: // normal code c: bits exactly where r20 carries into it, or one below
          return ref::from_bits((std::uint32_t(base) << 23) + std::max(c, 8u) * 1048576u - r20 - ((r >> 20) & 1));
        case 2: return ref::from_bits(std::uint32_t(r >> 16) & 0x7FFFFFu); // a subnormal float
        default: return float(std::ldexp(double((r >> 8) % (1u << 23)) + 0.5, base - 149)); // a tie
        }
      };
      em[i] = ((r >> 50) & 1 ? -1.0f : 1.0f) * crafted(base_m, ((bits & 0xFFFF) << 4) | 8, 119);
      ev[i] = crafted(base_v, ((bits >> 16) << 4) | 8, 247);
      if (kind == 9 && j == 17) { // a NaN m or v, or an infinite m: that moment's block is poisoned
        const int which = int(r % 3);
        (which == 1 ? ev[i] : em[i]) = which == 2 ? std::numeric_limits<float>::infinity()
                                                  : std::numeric_limits<float>::quiet_NaN();
      }
    }
  }
  packed out(moment_format::q8, N);
  encode_moments(em.data(), ev.data(), out.view(), N, {seed, 0});
  wrong = 0;
  bool seen_base[256] = {};
  std::size_t top_m = 0, top_v = 0;
  for (std::size_t b = 0; b < blocks; ++b) {
    std::uint32_t m_max = 0, v_max = 0;
    for (std::size_t j = 0; j < q8_block; ++j) {
      m_max = std::max(m_max, ref::bits(em[b * q8_block + j]) & 0x7FFFFFFFu);
      v_max = std::max(v_max, ref::bits(ev[b * q8_block + j]));
    }
    const std::uint32_t m_base = q8_base(m_max, 15), v_base = q8_base(v_max, 31);
    wrong += out.scales[2 * b] != m_base || out.scales[2 * b + 1] != v_base;
    seen_base[m_base] = seen_base[v_base] = true;
    for (std::size_t j = 0; j < q8_block; ++j) {
      const std::size_t i = b * q8_block + j;
      const std::uint32_t r = random_bits(i);
      const float am = std::fabs(em[i]);
      std::uint32_t m_code = std::min<std::uint32_t>(q8_code(am, m_base, ((r & 0xFFFF) << 4) | 8), 127) |
                                   (std::signbit(em[i]) ? 0x80 : 0);
      std::uint32_t v_code = std::min<std::uint32_t>(q8_code(ev[i], v_base, ((r >> 16) << 4) | 8), 255);
      if (ev[i] > 0) v_code = std::max<std::uint32_t>(v_code, 1);
      if (m_base == 255) m_code = 0;
      if (v_base == 255) v_code = 0;
      top_m += (m_code & 0x7F) == 127;
      top_v += v_code == 255;
      wrong += out.m[i] != m_code;
      wrong += out.v[i] != v_code;
    }
  }
  CHECK(wrong == 0);
  CHECK((seen_base[0] && seen_base[239] && seen_base[223] && seen_base[255])); // the edges were reached
  for (int base : {1, 8, 16, 125, 126, 127, 128}) {
    INFO("base " << base);
    CHECK(seen_base[base]);
  }
  CHECK((top_m > 0 && top_v > 0));
}

TEST_CASE("a wide tensor's column rounds like independent elements, not in lockstep", "[compressed]") {
  // Elements a power of two apart (a column of a 4096-, 65536- or 2^20-wide matrix), each
  // exactly halfway between two bf16 values, so each rounds up with probability 1/2: about
  // half of 64 must round up, for m and for v. An additive sequence's low 16 bits alone are
  // the same for elements 2^16 apart (all 64 or none would round up).
  const std::uint32_t halfway = 0x3F808000u; // 1 + 2^-8: between bf16 1.0 and 1.0078125
  float x;
  std::memcpy(&x, &halfway, sizeof x);
  for (std::uint64_t stride : {std::uint64_t(4096), std::uint64_t(1) << 16, std::uint64_t(1) << 20})
    for (std::uint64_t seed : {1, 2, 3, 4}) {
      int m_up = 0, v_up = 0;
      for (std::uint64_t r = 0; r < 64; ++r) {
        packed one(moment_format::bf16, 1);
        encode_moments(&x, &x, one.view(), 1, {seed, 12345 + r * stride});
        const decoded d = decode(one, 1);
        m_up += d.m[0] > x;
        v_up += d.v[0] > x;
      }
      INFO("stride " << stride << " seed " << seed << ": m rounded up " << m_up << " of 64, v " << v_up);
      CHECK((m_up >= 16 && m_up <= 48));
      CHECK((v_up >= 16 && v_up <= 48));
    }
}
