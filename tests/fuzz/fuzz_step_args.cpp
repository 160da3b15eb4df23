// libFuzzer target: the argument validation of adam_step. Bytes choose sizes, which of a
// few buffers (or null) each argument uses and where in it, dtypes (also outside the
// enum), hyper-parameters (any double bits) and the step number. Every buffer handed over
// really holds what its size claims, so the only acceptable outcomes are a step or
// std::invalid_argument — with nothing written in the second case.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "hostopt/hostopt.hpp"

namespace {
struct reader {
  const std::uint8_t* p;
  std::size_t n;
  template <class T>
  T take() {
    T v{};
    const std::size_t k = n < sizeof(T) ? n : sizeof(T);
    std::memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
};
constexpr std::size_t region_floats = 2048;
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  reader r{data, size};
  static std::vector<float> pool(4 * region_floats);
  std::vector<float> snapshot;
  const std::size_t n = r.take<std::uint16_t>() % 700;
  // Six buffers: params, exp_avg, exp_avg_sq, grad, out (+ out enabled flag).
  void* ptr[5];
  std::size_t len[5];
  for (int i = 0; i < 5; ++i) {
    const std::uint8_t region = r.take<std::uint8_t>() % 5; // 4 = null
    const std::size_t offset = r.take<std::uint16_t>() % 600;
    const std::int8_t delta = r.take<std::int8_t>() % 3; // sizes off by one now and then
    len[i] = std::size_t(std::max<long>(0, long(n) + delta));
    ptr[i] = region == 4 ? nullptr : pool.data() + region * region_floats + offset;
  }
  hostopt::adam_config c;
  c.lr = r.take<double>();
  c.beta1 = r.take<double>();
  c.beta2 = r.take<double>();
  c.eps = r.take<double>();
  c.weight_decay = r.take<double>();
  c.mode = hostopt::adam_mode(r.take<std::uint8_t>() % 3);
  c.nesterov = r.take<std::uint8_t>() & 1;
  const auto gtype = hostopt::dtype(r.take<std::uint8_t>() % 4);
  const auto otype = hostopt::dtype(r.take<std::uint8_t>() % 4);
  const bool with_out = r.take<std::uint8_t>() & 1;
  const std::int64_t step = r.take<std::int8_t>();
  const float scale = r.take<float>();
  // Everything claimed fits in the pool (f32 sizes; 16-bit views need half of it).
  snapshot = pool;
  try {
    hostopt::adam_step(static_cast<float*>(ptr[0]), static_cast<float*>(ptr[1]), static_cast<float*>(ptr[2]), len[0],
                       {ptr[3], len[3], gtype}, with_out ? hostopt::mut_view{ptr[4], len[4], otype} : hostopt::mut_view{},
                       c, step, scale, {1, ""});
  } catch (const std::invalid_argument&) {
    if (std::memcmp(snapshot.data(), pool.data(), pool.size() * 4) != 0) __builtin_trap(); // half-applied
    return 0;
  }
  return 0;
}
