// Gradient statistics, clipping, non-finite skips and the loss scaler, through the public API.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>

#include "reference.hpp"

using namespace hostopt;

namespace {
using ref::supported_kernels;

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }
} // namespace

TEST_CASE("gradient statistics are exact-order sums, identical on every kernel and thread count", "[stats][per_arch]") {
  std::mt19937 rng(5);
  for (dtype t : {dtype::f32, dtype::bf16, dtype::f16})
    for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(15), std::size_t(17), std::size_t(4095),
                          std::size_t(4097), std::size_t(1000003)}) {
      const auto g = ref::random_grad(t, n, rng, 3.0f);
      long double want = 0;
      for (float x : g.values) want += (long double)x * x;
      const grad_stats base = gradient_stats(g.view(), {1, "scalar"});
      INFO("dtype " << dtype_name(t) << " n " << n);
      CHECK(base.finite);
      CHECK(std::fabs(base.sum_squares - double(want)) <= 1e-12 * double(want) + 1e-300);
      CHECK(base.norm == Approx(std::sqrt(double(want))).epsilon(1e-12));
      for (const auto& k : supported_kernels())
        for (int threads : {1, 2, 3, 4}) {
          const grad_stats s = gradient_stats(g.view(), {threads, k});
          CHECK(same_bits(s.sum_squares, base.sum_squares));
        }
    }
}

TEST_CASE("any non-finite element is detected, in every dtype and position", "[stats]") {
  const std::size_t n = 9000;
  for (dtype t : {dtype::f32, dtype::bf16, dtype::f16})
    for (std::size_t pos : {std::size_t(0), std::size_t(4095), std::size_t(4096), n - 1})
      for (int kind = 0; kind < 3; ++kind) { // +inf, -inf, NaN
        std::mt19937 rng(1);
        auto g = ref::random_grad(t, n, rng);
        const float bad = kind == 0 ? INFINITY : kind == 1 ? -INFINITY : NAN;
        if (t == dtype::f32) g.f32[pos] = bad;
        else g.half[pos] = t == dtype::bf16 ? ref::to_bf16(bad) : ref::to_f16(bad);
        INFO("dtype " << dtype_name(t) << " at " << pos << " kind " << kind);
        CHECK_FALSE(gradient_stats(g.view(), {2, ""}).finite);
      }
  // f16 overflow is not non-finite in the input: 65504 squared is fine in double.
  const std::uint16_t big = 0x7BFF;
  CHECK(gradient_stats(const_view{&big, 1, dtype::f16}).finite);
}

TEST_CASE("clipping follows optax.clip_by_global_norm and is folded into the step", "[stats][optimizer]") {
  CHECK(clip_coefficient(0.5, 1.0) == 1.0);
  CHECK(clip_coefficient(1.0, 1.0) == 1.0);
  CHECK(clip_coefficient(4.0, 1.0) == 0.25);
  CHECK_THROWS_WITH(clip_coefficient(1.0, 0.0), Catch::Contains("max_norm = 0"));
  std::mt19937 rng(9);
  adam_config c;
  const std::vector<param_group> groups{{c, {{"a", {300}}, {"b", {5000}}}}};
  for (const float loss_scale : {1.0f, 1024.0f}) {
    optimizer opt(groups);
    ref::state a(300), b(5000);
    for (int t = 1; t <= 3; ++t) {
      auto ga = ref::random_grad(dtype::bf16, 300, rng, loss_scale), gb = ref::random_grad(dtype::bf16, 5000, rng, loss_scale);
      long double sq = 0;
      for (float x : ga.values) sq += (long double)x * x;
      for (float x : gb.values) sq += (long double)x * x;
      const double norm = double(1.0f / loss_scale) * std::sqrt(double(sq));
      step_options o;
      o.grad_scale = 1.0f / loss_scale;
      o.max_grad_norm = 2.0;
      const auto r = opt.step(std::vector<const_view>{ga.view(), gb.view()}, {}, o);
      CHECK(r.applied);
      CHECK(r.grad_norm == Approx(norm).epsilon(1e-9));
      const float scale = float(double(o.grad_scale) * (norm < 2.0 ? 1.0 : 2.0 / norm));
      CHECK(r.applied_scale == Approx(scale).epsilon(1e-6));
      adam_step(a.p.data(), a.m.data(), a.v.data(), 300, ga.view(), {}, c, t, r.applied_scale);
      adam_step(b.p.data(), b.m.data(), b.v.data(), 5000, gb.view(), {}, c, t, r.applied_scale);
    }
    CHECK(std::memcmp(opt.params("a").data(), a.p.data(), 300 * 4) == 0);
    CHECK(std::memcmp(opt.params("b").data(), b.p.data(), 5000 * 4) == 0);
  }
}

TEST_CASE("a non-finite gradient skips the step and leaves the state bit-for-bit", "[stats][optimizer]") {
  std::mt19937 rng(4);
  optimizer opt({{adam_config{}, {{"w", {1000}}}}});
  const auto g0 = ref::random_grad(dtype::f16, opt.arena_size(), rng);
  opt.step(g0.view(), {}, step_options{});
  const std::vector<float> p(opt.params().begin(), opt.params().end()), m(opt.exp_avg().begin(), opt.exp_avg().end());
  auto g = ref::random_grad(dtype::f16, opt.arena_size(), rng);
  g.half[123] = 0x7C00; // +inf
  std::vector<std::uint16_t> out(opt.arena_size(), 0xBEEF);
  const auto r = opt.step(g.view(), {out.data(), out.size(), dtype::f16}, step_options{});
  CHECK_FALSE(r.applied);
  CHECK(r.step == 1);
  CHECK(r.skipped_steps == 1);
  CHECK(opt.skipped_steps() == 1);
  CHECK(std::isinf(r.grad_norm));
  CHECK(std::memcmp(p.data(), opt.params().data(), p.size() * 4) == 0);
  CHECK(std::memcmp(m.data(), opt.exp_avg().data(), m.size() * 4) == 0);
  CHECK(out == std::vector<std::uint16_t>(opt.arena_size(), 0xBEEF));
  // A caller-supplied norm replaces the statistics pass; NaN skips just the same.
  step_options known;
  known.known_grad_norm = std::numeric_limits<double>::quiet_NaN();
  CHECK_FALSE(opt.step(g0.view(), {}, known).applied);
  CHECK(opt.skipped_steps() == 2);
  known.known_grad_norm = 3.0;
  known.max_grad_norm = 1.5;
  const auto ok = opt.step(g0.view(), {}, known);
  CHECK(ok.applied);
  CHECK(ok.step == 2);
  CHECK(ok.applied_scale == 0.5f);
  // Asked not to check, the step goes on (and the non-finite value propagates).
  step_options trusting;
  trusting.skip_nonfinite = false;
  CHECK(opt.step(g.view(), {}, trusting).applied);
  CHECK(std::isnan(opt.params()[123]));
}

TEST_CASE("the dynamic loss scaler follows torch's GradScaler", "[stats]") {
  dynamic_loss_scaler s(1024.0, 2.0, 0.5, 3);
  CHECK(s.scale() == 1024.0f);
  CHECK(s.inverse_scale() == 1.0f / 1024.0f);
  s.update(true);
  CHECK(s.scale() == 512.0f);
  s.update(false);
  s.update(false);
  CHECK(s.scale() == 512.0f);
  CHECK(s.growth_tracker() == 2);
  s.update(false);
  CHECK(s.scale() == 1024.0f);
  CHECK(s.growth_tracker() == 0);
  s.update(false);
  s.update(true);
  CHECK(s.growth_tracker() == 0);
  CHECK(s.scale() == 512.0f);
  dynamic_loss_scaler near_max(3.0e38, 2.0, 0.5, 1);
  near_max.update(false); // growth would overflow float: the scale stays finite
  CHECK(near_max.scale() == 3.0e38f);
  CHECK_THROWS_WITH(dynamic_loss_scaler(0.0), Catch::Contains("init_scale"));
  CHECK_THROWS_WITH(dynamic_loss_scaler(1.0, 1.0), Catch::Contains("growth_factor"));
  CHECK_THROWS_WITH(dynamic_loss_scaler(1.0, 2.0, 1.0), Catch::Contains("backoff_factor"));
  CHECK_THROWS_WITH(dynamic_loss_scaler(1.0, 2.0, 0.5, 0), Catch::Contains("growth_interval"));
}

TEST_CASE("gradients that overflow float once scaled are judged non-finite, as the kernel computes them",
          "[stats][optimizer][per_arch]") {
  for (const auto& kernel : supported_kernels()) {
    INFO("kernel " << kernel);
    optimizer opt({{adam_config{}, {{"w", {100}}}}}, {1, kernel});
    std::vector<float> g(opt.arena_size(), 0.0f);
    g[7] = 1e30f; // finite, and its norm is finite in double; 1e10 * 1e30 is inf in float
    step_options o;
    o.grad_scale = 1e10f;
    const auto before = std::vector<float>(opt.params().begin(), opt.params().end());
    const auto r = opt.step(const_view{g.data(), g.size(), dtype::f32}, {}, o);
    CHECK_FALSE(r.applied);
    CHECK(r.skipped_steps == 1);
    CHECK(std::vector<float>(opt.params().begin(), opt.params().end()) == before);
    // The same with the norm supplied by the caller.
    o.known_grad_norm = 1e30;
    CHECK_FALSE(opt.step(const_view{g.data(), g.size(), dtype::f32}, {}, o).applied);
    // A gradient whose square overflows (1e20^2 > FLT_MAX) would leave v = inf for good.
    o = {};
    g[7] = 1e20f;
    CHECK_FALSE(opt.step(const_view{g.data(), g.size(), dtype::f32}, {}, o).applied);
    CHECK(opt.skipped_steps() == 3);
    CHECK(std::vector<float>(opt.params().begin(), opt.params().end()) == before);
    // Clipping brings what the kernel sees back into range: the step applies, finite,
    // with or without the check (without it the clip must still happen).
    g[7] = 1e30f;
    o.grad_scale = 1e10f;
    o.max_grad_norm = 1.0;
    for (const bool check : {true, false}) {
      o.skip_nonfinite = check;
      const auto clipped = opt.step(const_view{g.data(), g.size(), dtype::f32}, {}, o);
      CHECK(clipped.applied);
      CHECK(clipped.applied_scale == Approx(1e-30).epsilon(1e-6));
      for (float x : opt.params()) CHECK(std::isfinite(x));
      for (float x : opt.exp_avg_sq()) CHECK(std::isfinite(x));
    }
    // The rule in isolation, at the bound sqrt(FLT_MAX) ~ 1.8447e19.
    step_options plain;
    CHECK(decide_step(plain, 1.8e19).apply);
    CHECK_FALSE(decide_step(plain, 1.9e19).apply);
    CHECK_FALSE(decide_step(plain, std::numeric_limits<double>::infinity()).apply);
    plain.skip_nonfinite = false;
    CHECK(decide_step(plain, 1.9e19).apply); // asked not to check
  }
}

TEST_CASE("a non-finite norm never means 'no clipping': a clipped step skips, checked or not", "[stats][optimizer]") {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  std::mt19937 rng(21);
  optimizer opt({{adam_config{}, {{"w", {1000}}}}});
  auto g = ref::random_grad(dtype::f32, opt.arena_size(), rng, 1000.0f); // finite, norm ~ 1.8e4
  opt.step(g.view(), {}, step_options{});
  const std::vector<float> p(opt.params().begin(), opt.params().end()), m(opt.exp_avg().begin(), opt.exp_avg().end()),
      v(opt.exp_avg_sq().begin(), opt.exp_avg_sq().end());
  auto unchanged = [&] {
    return std::memcmp(p.data(), opt.params().data(), p.size() * 4) == 0 &&
           std::memcmp(m.data(), opt.exp_avg().data(), m.size() * 4) == 0 &&
           std::memcmp(v.data(), opt.exp_avg_sq().data(), v.size() * 4) == 0;
  };
  // A norm that overflowed where it was computed (a GPU reduction), with finite gradients:
  // the clip has no factor, so the step is skipped and counted, never applied unclipped.
  std::int64_t skipped = 0;
  for (const double known : {inf, nan}) {
    INFO("known_grad_norm " << known);
    step_options o;
    o.skip_nonfinite = false;
    o.max_grad_norm = 1.0;
    o.known_grad_norm = known;
    const auto r = opt.step(g.view(), {}, o);
    CHECK_FALSE(r.applied);
    CHECK(r.step == 1);
    CHECK(r.skipped_steps == ++skipped);
    CHECK(opt.skipped_steps() == skipped);
    CHECK(unchanged());
    CHECK_FALSE(decide_step(o, known).apply);
  }
  // The same for a norm computed from gradients that hold a NaN or inf.
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    auto h = g;
    h.f32[17] = bad;
    step_options o;
    o.skip_nonfinite = false;
    o.max_grad_norm = 1.0;
    const auto r = opt.step(h.view(), {}, o);
    CHECK_FALSE(r.applied);
    CHECK(r.skipped_steps == ++skipped);
    CHECK(unchanged());
  }
  // Without clipping, unchecked, the step still goes on (asked not to check); with a
  // finite known norm it is clipped as always.
  step_options clip;
  clip.skip_nonfinite = false;
  clip.max_grad_norm = 1.0;
  clip.known_grad_norm = 8000.0;
  const auto ok = opt.step(g.view(), {}, clip);
  CHECK(ok.applied);
  CHECK(ok.applied_scale == float(1.0 / 8000.0));
  step_options trusting;
  trusting.skip_nonfinite = false;
  trusting.known_grad_norm = inf;
  CHECK(opt.step(g.view(), {}, trusting).applied);
  CHECK(opt.skipped_steps() == skipped);
}
