#pragma once
// Compressed moments owned by a test, and the conversions through the public API
// (test_compressed_moments, test_moment_conversions).

#include <cstring>
#include <vector>

#include "hostopt/kernels.hpp"
#include "reference.hpp"

namespace compressed_test {

using namespace hostopt;

/// Compressed moments owned by a test.
struct packed {
  moment_format format;
  std::vector<unsigned char> m, v, scales;
  packed(moment_format f, std::size_t n)
      : format(f), m(n * (f == moment_format::bf16 ? 2 : 1)), v(m.size()), scales(moment_scale_bytes(f, n)) {}
  compressed_moments view() {
    return {format, m.data(), v.data(), scales.empty() ? nullptr : scales.data()};
  }
  bool operator==(const packed& o) const { return m == o.m && v == o.v && scales == o.scales; }
};

struct decoded {
  std::vector<float> m, v;
};

inline decoded decode(packed& s, std::size_t n) {
  decoded d{std::vector<float>(n), std::vector<float>(n)};
  decode_moments(s.view(), n, d.m.data(), d.v.data());
  return d;
}

inline packed encode(moment_format f, const ref::state& s, std::uint64_t seed = 7) {
  const std::size_t n = s.p.size();
  packed out(f, n);
  encode_moments(s.m.data(), s.v.data(), out.view(), n, {seed, 0});
  return out;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

inline const moment_format formats[] = {moment_format::bf16, moment_format::q8};

} // namespace compressed_test
