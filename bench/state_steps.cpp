// state_steps: the buffers and timed calls of one arena's step per moment format.
#include "state_steps.hpp"

#include <memory>

#include "kernel_registry.hpp"
#include "parallel.hpp"

namespace bench {

namespace {

using hostopt::dtype;
using hostopt::moment_format;

// Runs fn(lo, hi) over [0, n) with the library's partition on `threads` workers.
template <class F>
void parallel_over(std::size_t n, int threads, F&& fn) {
  auto body = [&](int tid, int nt) {
    const auto [lo, hi] = hostopt::detail::partition(0, n, tid, nt);
    if (lo < hi) fn(lo, hi);
  };
  hostopt::detail::run_parallel(threads, body);
}

struct arena_buffers {
  float_buffer p, m, v, grad, out, cast_out;
  arena_buffers(std::size_t n, const dtype_mix& mix, bool two_pass, int threads)
      : p(n, threads), m(n, threads), v(n, threads), grad(typed_buffer(n, dtype(mix.grad), threads)),
        out(mix.out < 0 ? float_buffer() : typed_buffer(n, dtype(mix.out), threads)),
        cast_out(two_pass ? typed_buffer(n, dtype(mix.out), threads) : float_buffer()) {
    fill_random(p.data, n, 1.0f, false, threads);
    fill_random(m.data, n, 0.01f, false, threads);
    fill_random(v.data, n, 1e-4f, true, threads);
    if (mix.grad == int(dtype::f32)) fill_random(grad.data, n, 0.01f, false, threads);
    else fill_random_half(reinterpret_cast<std::uint16_t*>(grad.data), n, dtype(mix.grad), threads);
  }
};

// Compressed moments for the benchmark, encoded from the f32 arena's starting moments.
struct compressed_buffers {
  moment_format format;
  float_buffer m, v, scales; // float_buffer: first-touched by the threads that use it
  compressed_buffers(moment_format f, const arena_buffers& b, std::size_t n, int threads)
      : format(f), m(n / (f == moment_format::bf16 ? 2 : 4) + 16, threads), v(m.size, threads),
        scales(hostopt::moment_scale_bytes(f, n) / 4 + 16, threads) {
    hostopt::encode_moments(b.m.data, b.v.data, view(), n);
  }
  hostopt::compressed_moments view() const {
    return {format, m.data, v.data, format == moment_format::q8 ? reinterpret_cast<std::uint8_t*>(scales.data) : nullptr};
  }
};

} // namespace

double bytes_per_param(const dtype_mix& mix, moment_format state) {
  const double moments = double(hostopt::moment_bytes(state, std::size_t(1) << 20)) / double(1 << 20);
  return 8 + 2 * moments + double(hostopt::dtype_size(dtype(mix.grad))) +
         (mix.out < 0 ? 0 : double(hostopt::dtype_size(dtype(mix.out))));
}

struct state_steps::impl {
  std::size_t n;
  dtype_mix mix;
  std::vector<moment_format> states;
  int threads;
  const hostopt::detail::kernel_set& ks;
  hostopt::adam_config cfg;
  arena_buffers b;
  std::vector<std::unique_ptr<compressed_buffers>> packed; // per state: null for f32
  hostopt::execution_options exec;
  std::optional<dtype> out_type;
  std::size_t gsz, osz;

  impl(std::size_t n_, const dtype_mix& mix_, const std::vector<moment_format>& states_, int t,
       const hostopt::detail::kernel_set& k, const hostopt::adam_config& c, bool two_pass)
      : n(n_), mix(mix_), states(states_), threads(t), ks(k), cfg(c), b(n, mix, two_pass, t), exec{t, k.name()},
        out_type(mix.out < 0 ? std::nullopt : std::optional<dtype>(dtype(mix.out))),
        gsz(hostopt::dtype_size(dtype(mix.grad))), osz(mix.out < 0 ? 0 : hostopt::dtype_size(dtype(mix.out))) {
    for (moment_format f : states)
      packed.push_back(f == moment_format::f32 ? nullptr : std::make_unique<compressed_buffers>(f, b, n, t));
  }
  hostopt::const_view grad() const { return {b.grad.data, n, dtype(mix.grad)}; }
  hostopt::mut_view out() const {
    return mix.out < 0 ? hostopt::mut_view{} : hostopt::mut_view{b.out.data, n, dtype(mix.out)};
  }
  const char* grad_bytes() const { return reinterpret_cast<const char*>(b.grad.data); }
  char* out_bytes() const { return osz ? reinterpret_cast<char*>(b.out.data) : nullptr; }
};

state_steps::state_steps(std::size_t n, const dtype_mix& mix, const std::vector<moment_format>& states, int threads,
                         const hostopt::detail::kernel_set& kernels, const hostopt::adam_config& config, bool two_pass)
    : impl_(std::make_unique<impl>(n, mix, states, threads, kernels, config, two_pass)) {}
state_steps::~state_steps() = default;

double state_steps::step(std::size_t k, std::int64_t t) {
  impl& s = *impl_;
  const double t0 = now_seconds();
  if (!s.packed[k]) hostopt::adam_step(s.b.p.data, s.b.m.data, s.b.v.data, s.n, s.grad(), s.out(), s.cfg, t, 1.0f, s.exec);
  else hostopt::adam_step(s.b.p.data, s.packed[k]->view(), s.n, s.grad(), s.out(), s.cfg, t, 1.0f, {}, s.exec);
  return now_seconds() - t0;
}

double state_steps::allocated_bytes(std::size_t n, const dtype_mix& mix, const std::vector<moment_format>& states) {
  double bytes = double(n) * (12 + double(hostopt::dtype_size(dtype(mix.grad))) +
                              (mix.out < 0 ? 0 : double(hostopt::dtype_size(dtype(mix.out)))));
  for (moment_format f : states)
    if (f != moment_format::f32) bytes += double(hostopt::moment_bytes(f, n));
  return bytes;
}

double state_steps::roofline(std::size_t k, const hostopt::detail::kernel_set* twin) {
  impl& s = *impl_;
  const hostopt::detail::kernel_set& ks = twin ? *twin : s.ks;
  const char* grad = s.grad_bytes();
  char* out = s.out_bytes();
  const std::size_t gsz = s.gsz, osz = s.osz;
  const double t0 = now_seconds();
  if (!s.packed[k]) {
    const auto roof = ks.roofline(dtype(s.mix.grad), s.out_type);
    parallel_over(s.n, s.threads, [&](std::size_t lo, std::size_t hi) {
      roof(s.b.p.data + lo, s.b.m.data + lo, s.b.v.data + lo, grad + lo * gsz, out ? out + lo * osz : nullptr, hi - lo);
    });
  } else {
    const compressed_buffers& cb = *s.packed[k];
    const auto roof = ks.roofline_compressed(cb.format, dtype(s.mix.grad), s.out_type);
    const std::size_t code = cb.format == moment_format::bf16 ? 2 : 1;
    char* m = reinterpret_cast<char*>(cb.m.data);
    char* v = reinterpret_cast<char*>(cb.v.data);
    auto* scales = reinterpret_cast<std::uint8_t*>(cb.scales.data);
    parallel_over(s.n, s.threads, [&](std::size_t lo, std::size_t hi) { // slices start on blocks
      roof(s.b.p.data + lo, m + lo * code, v + lo * code, scales + 2 * (lo / hostopt::q8_block), grad + lo * gsz,
           out ? out + lo * osz : nullptr, hi - lo);
    });
  }
  return now_seconds() - t0;
}

double state_steps::two_pass(std::int64_t t) {
  impl& s = *impl_;
  const double t0 = now_seconds();
  hostopt::adam_step(s.b.p.data, s.b.m.data, s.b.v.data, s.n, s.grad(), {}, s.cfg, t, 1.0f, s.exec);
  const auto cast = s.ks.cast(*s.out_type);
  char* cast_out = reinterpret_cast<char*>(s.b.cast_out.data);
  const std::size_t osz = s.osz;
  parallel_over(s.n, s.threads, [&](std::size_t lo, std::size_t hi) { cast(s.b.p.data + lo, cast_out + lo * osz, hi - lo); });
  return now_seconds() - t0;
}

} // namespace bench
