// The explicit conversions between f32 and compressed moments run with the active kernel:
// this suite runs once per kernel the CPU supports (HOSTOPT_FORCE_ARCH, test_main.cpp).
#include <catch2/catch.hpp>

#include <cmath>
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
