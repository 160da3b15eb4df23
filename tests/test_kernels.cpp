// Every kernel this CPU supports, forced one by one through the public API, against the
// double-precision reference; exact 16-bit conversions; identical bits across kernels,
// thread counts and splits of the range.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <vector>

#include "fp_mode.hpp"
#include "reference.hpp"

using namespace hostopt;

namespace {

using ref::supported_kernels;

std::vector<adam_config> test_configs() {
  std::vector<adam_config> cs;
  adam_config c;
  c.lr = 1e-2;
  c.weight_decay = 0.01;
  cs.push_back(c); // adamw
  c.mode = adam_mode::adam;
  cs.push_back(c); // adam, coupled L2
  c.weight_decay = 0;
  cs.push_back(c); // plain adam
  c.nesterov = true;
  cs.push_back(c); // nadam
  c.mode = adam_mode::adamw;
  c.weight_decay = 0.1;
  c.eps_root = 1e-8;
  cs.push_back(c); // nadamw with eps_root
  c.nesterov = false;
  c.bias_correction = false;
  c.beta1 = 0.5;
  c.beta2 = 0.75;
  c.eps = 1e-3;
  cs.push_back(c); // no bias correction, unusual betas
  return cs;
}

const dtype all_dtypes[] = {dtype::f32, dtype::bf16, dtype::f16};

/// A copy-out buffer of any dtype (or none).
struct out_buffer {
  bool enabled = false;
  dtype type = dtype::f32;
  std::vector<float> f32;
  std::vector<std::uint16_t> half;
  out_buffer(int kind, std::size_t n) {
    if (kind < 0) return;
    enabled = true;
    type = dtype(kind);
    if (type == dtype::f32) f32.assign(n, -7.0f);
    else half.assign(n, 0xDEAD);
  }
  mut_view view(std::size_t offset = 0, std::size_t n = std::size_t(-1)) {
    if (!enabled) return {};
    const std::size_t size = type == dtype::f32 ? f32.size() : half.size();
    if (n == std::size_t(-1)) n = size - offset;
    if (type == dtype::f32) return {f32.data() + offset, n, type};
    return {half.data() + offset, n, type};
  }
  bool operator==(const out_buffer& o) const { return f32 == o.f32 && half == o.half; }
  // Whether element i holds p correctly rounded to the buffer's dtype.
  bool holds(std::size_t i, float p) const {
    if (!enabled) return true;
    if (type == dtype::f32) return ref::bits(f32[i]) == ref::bits(p);
    if (std::isnan(p)) return type == dtype::bf16 ? std::isnan(ref::from_bf16(half[i])) : std::isnan(ref::from_f16(half[i]));
    return half[i] == (type == dtype::bf16 ? ref::to_bf16(p) : ref::to_f16(p));
  }
};

std::string describe(const std::string& kernel, const adam_config& c, dtype g, int out, std::size_t n,
                     std::int64_t t) {
  std::ostringstream os;
  os << "kernel=" << kernel << " mode=" << (c.mode == adam_mode::adam ? "adam" : "adamw")
     << " wd=" << c.weight_decay << " nesterov=" << c.nesterov << " bias_correction=" << c.bias_correction
     << " grad=" << dtype_name(g) << " out=" << (out < 0 ? "none" : dtype_name(dtype(out))) << " n=" << n
     << " t=" << t;
  return os.str();
}

// Runs one step and checks every element against the reference; returns the number of
// mismatching elements (and reports the first).
std::size_t check_against_reference(const std::string& kernel, const adam_config& c, dtype gt, int out_kind,
                                    std::size_t n, std::int64_t t, float grad_scale, int threads,
                                    std::mt19937& rng) {
  ref::state s = ref::random_state(n, rng);
  const ref::state before = s;
  const ref::grad_buffer g = ref::random_grad(gt, n, rng);
  out_buffer out(out_kind, n);
  adam_step(s.p.data(), s.m.data(), s.v.data(), n, g.view(), out.view(), c, t, grad_scale, {threads, kernel});
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto mr = ref::adam_moments(c, grad_scale, before.p[i], before.m[i], before.v[i], g.values[i]);
    const auto pr = ref::adam_param(c, t, grad_scale, before.p[i], s.m[i], s.v[i], g.values[i]);
    const bool ok = ref::close(s.m[i], mr.m, mr.m_terms, 4) && ref::close(s.v[i], mr.v, mr.v_terms, 4) &&
                    ref::close(s.p[i], pr.p, pr.p_terms, 8) && out.holds(i, s.p[i]);
    if (!ok && bad++ == 0) {
      UNSCOPED_INFO(describe(kernel, c, gt, out_kind, n, t)
                    << " first mismatch at " << i << ": p=" << s.p[i] << " ref " << pr.p << ", m=" << s.m[i]
                    << " ref " << mr.m << ", v=" << s.v[i] << " ref " << mr.v);
    }
  }
  return bad;
}

} // namespace

TEST_CASE("the scalar kernel is always compiled in and supported", "[per_arch]") {
  const auto ks = kernels();
  REQUIRE_FALSE(ks.empty());
  CHECK(ks.back().name == "scalar");
  CHECK(ks.back().supported);
  const auto names = supported_kernels();
  CHECK(std::find(names.begin(), names.end(), active_kernel()) != names.end());
}

TEST_CASE("every kernel matches the double-precision reference at edge sizes", "[adam][per_arch]") {
  const std::size_t sizes[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100};
  const std::int64_t steps[] = {1, 2, 10, 1000};
  std::mt19937 rng(42);
  for (const auto& kernel : supported_kernels()) {
    std::size_t bad = 0, runs = 0;
    for (const auto& c : test_configs())
      for (dtype gt : all_dtypes)
        for (int out = -1; out < 3; ++out)
          for (std::size_t n : sizes)
            for (std::int64_t t : steps) {
              bad += check_against_reference(kernel, c, gt, out, n, t, t == 2 ? 0.5f : 1.0f, 1, rng);
              ++runs;
            }
    INFO("kernel " << kernel << ": " << runs << " steps checked");
    CHECK(bad == 0);
  }
}

TEST_CASE("every kernel matches the reference on a large odd size", "[adam][per_arch]") {
  std::mt19937 rng(7);
  adam_config c;
  c.lr = 3e-3;
  c.weight_decay = 0.05;
  for (const auto& kernel : supported_kernels())
    for (dtype gt : all_dtypes) {
      const int out = gt == dtype::f32 ? -1 : int(gt);
      CHECK(check_against_reference(kernel, c, gt, out, 1000003, 3, 1.0f, 2, rng) == 0);
    }
}

TEST_CASE("copy-out rounds to nearest even on every kernel, specials included", "[convert][per_arch]") {
  // lr = 0 leaves p unchanged, so out = round(p) isolates the conversion.
  std::vector<float> p;
  const std::uint32_t specials[] = {0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x33000000,
                                    0x33000001, 0x337FFFFF, 0x33800000, 0x387FC000, 0x387FE000, 0x38800000,
                                    0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FFFFF, 0x47800000, 0x7F7FFFFF,
                                    0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                                    0xFFC12345, 0x3F808000, 0x3F818000, 0x3F800001, 0x3F807FFF};
  for (std::uint32_t u : specials) p.push_back(ref::from_bits(u));
  std::mt19937 rng(3);
  std::uniform_int_distribution<std::uint32_t> any;
  std::uniform_int_distribution<std::uint32_t> half_range(0x32000000u, 0x48000000u);
  for (int i = 0; i < 100000; ++i) p.push_back(ref::from_bits(any(rng)));
  for (int i = 0; i < 100000; ++i) p.push_back(ref::from_bits(half_range(rng) | (any(rng) & 0x80000000u)));
  const std::size_t n = p.size();
  adam_config c;
  c.lr = 0;
  std::vector<out_buffer> first;
  for (int out = 1; out < 3; ++out) {
    std::optional<out_buffer> reference_bits;
    for (const auto& kernel : supported_kernels()) {
      ref::state s(n);
      s.p = p;
      std::vector<float> grad(n, 0.0f);
      out_buffer o(out, n);
      adam_step(s.p.data(), s.m.data(), s.v.data(), n, {grad.data(), n, dtype::f32}, o.view(), c, 1, 1.0f,
                {1, kernel});
      std::size_t bad = 0;
      for (std::size_t i = 0; i < n; ++i) bad += !o.holds(i, p[i]);
      INFO("kernel " << kernel << " out " << dtype_name(dtype(out)));
      CHECK(bad == 0);
      if (!reference_bits) reference_bits = o;
      else CHECK(o == *reference_bits); // NaN payloads too
    }
  }
}

TEST_CASE("16-bit gradients decode exactly on every kernel (all 65536 patterns)", "[convert][per_arch]") {
  // beta1 = 0 makes m = 0 * m + 1 * g = g: the decoded gradient itself.
  const std::size_t n = 65536;
  adam_config c;
  c.beta1 = 0;
  for (dtype gt : {dtype::bf16, dtype::f16}) {
    std::vector<std::uint16_t> h(n);
    for (std::size_t i = 0; i < n; ++i) h[i] = std::uint16_t(i);
    std::optional<std::vector<float>> first;
    for (const auto& kernel : supported_kernels()) {
      ref::state s(n);
      adam_step(s.p.data(), s.m.data(), s.v.data(), n, {h.data(), n, gt}, {}, c, 1, 1.0f, {1, kernel});
      std::size_t bad = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float want = gt == dtype::bf16 ? ref::from_bf16(h[i]) : ref::from_f16(h[i]);
        if (std::isnan(want)) bad += !std::isnan(s.m[i]);
        else bad += s.m[i] != want; // +0 and -0 compare equal: 0 + (-0) is +0
      }
      INFO("kernel " << kernel << " grad " << dtype_name(gt));
      CHECK(bad == 0);
      if (!first) first = s.m;
      else CHECK(std::memcmp(first->data(), s.m.data(), n * 4) == 0);
    }
  }
}

TEST_CASE("identical bits across kernels, thread counts and splits of the range", "[determinism][per_arch]") {
  const std::size_t n = 100003;
  std::mt19937 rng(11);
  const auto names = supported_kernels();
  for (const auto& c : test_configs())
    for (dtype gt : all_dtypes)
      for (int out = -1; out < 3; ++out) {
        const ref::state start = ref::random_state(n, rng);
        const ref::grad_buffer g = ref::random_grad(gt, n, rng);
        auto run = [&](const std::string& kernel, int threads, const std::vector<std::size_t>& cuts) {
          std::pair<ref::state, out_buffer> r{start, out_buffer(out, n)};
          auto& [s, o] = r;
          for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
            const std::size_t lo = cuts[k], len = cuts[k + 1] - cuts[k];
            adam_step(s.p.data() + lo, s.m.data() + lo, s.v.data() + lo, len, g.view(lo, len), o.view(lo, len),
                      c, 5, 0.75f, {threads, kernel});
          }
          return r;
        };
        const auto base = run("scalar", 1, {0, n});
        for (const auto& kernel : names)
          for (int threads = 1; threads <= 4; ++threads) {
            const auto r = run(kernel, threads, {0, n});
            INFO(describe(kernel, c, gt, out, n, 5) << " threads=" << threads);
            CHECK(r.first == base.first);
            CHECK(r.second == base.second);
          }
        std::vector<std::size_t> cuts{0, n};
        std::uniform_int_distribution<std::size_t> cut(1, n - 1);
        for (int k = 0; k < 20; ++k) cuts.push_back(cut(rng));
        std::sort(cuts.begin(), cuts.end());
        cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
        const auto split = run(active_kernel(), 2, cuts);
        INFO(describe(active_kernel(), c, gt, out, n, 5) << " random split into " << cuts.size() - 1);
        CHECK(split.first == base.first);
        CHECK(split.second == base.second);
      }
}

TEST_CASE("large copy-outs (non-temporal stores) give the same bits, aligned or not", "[determinism][per_arch]") {
  // Copy-outs of 1 MiB and more are written around the caches when the buffer is aligned
  // to a vector; check that path, the unaligned one and the optax form's update (never
  // streamed: apply_updates reads it back at once) against the scalar kernel, with a tail.
  const std::size_t n = (std::size_t(1) << 20) + 37; // 4 MiB of f32, 2 MiB of 16-bit values, a tail
  std::mt19937 rng(41);
  const adam_config c = test_configs()[0];
  for (dtype gt : all_dtypes)
    for (dtype ot : all_dtypes) {
      const ref::state start = ref::random_state(n, rng);
      const ref::grad_buffer g = ref::random_grad(gt, n, rng);
      const std::size_t esz = dtype_size(ot);
      // 64-byte aligned, and one element past that.
      std::vector<unsigned char> storage((n + 64) * esz + 64);
      const auto base = reinterpret_cast<std::uintptr_t>(storage.data());
      unsigned char* aligned = storage.data() + (64 - base % 64) % 64;
      auto step = [&](const std::string& kernel, unsigned char* out, int threads) {
        ref::state s = start;
        std::memset(out, 0xAB, n * esz);
        adam_step(s.p.data(), s.m.data(), s.v.data(), n, g.view(), {out, n, ot}, c, 3, 1.0f, {threads, kernel});
        return std::make_pair(s, std::vector<unsigned char>(out, out + n * esz));
      };
      const auto want = step("scalar", aligned, 1);
      for (const auto& kernel : supported_kernels()) {
        if (kernel == "scalar") continue; // the reference itself: it has no streamed path
        // Unaligned copy-outs are never streamed, so one thread covers them; each of two
        // threads' slices starts 64-byte aligned and is streamed too.
        for (auto [shift, threads] : {std::pair<std::size_t, int>{0, 1}, {0, 2}, {esz, 1}}) {
          INFO("kernel " << kernel << " grad " << dtype_name(gt) << " out " << dtype_name(ot) << " shift " << shift
                         << " threads " << threads);
          const auto got = step(kernel, aligned + shift, threads);
          CHECK((got.first == want.first)); // no printing of megabytes on failure
          CHECK((got.second == want.second));
        }
      }
      if (ot != gt) continue;
      // The optax form: the update in the gradient's dtype, separate and over the gradient.
      std::vector<unsigned char> grad_storage(n * esz + 64);
      unsigned char* grad_copy =
          grad_storage.data() + (64 - reinterpret_cast<std::uintptr_t>(grad_storage.data()) % 64) % 64;
      auto update = [&](const std::string& kernel, bool in_place) {
        ref::state s = start;
        std::memcpy(grad_copy, g.view().data, n * esz); // aligned: the update over it is streamed too
        unsigned char* u = in_place ? grad_copy : aligned;
        adam_update(s.p.data(), s.m.data(), s.v.data(), n, {grad_copy, n, gt}, {u, n, gt}, c, 3, 1.0f, {1, kernel});
        return std::make_pair(s, std::vector<unsigned char>(u, u + n * esz));
      };
      const auto want_u = update("scalar", false);
      for (const auto& kernel : supported_kernels())
        for (bool in_place : {false, true}) {
          if (kernel == "scalar" && !in_place) continue; // the reference
          INFO("adam_update kernel " << kernel << " grad " << dtype_name(gt) << " in place " << in_place);
          const auto got = update(kernel, in_place);
          CHECK((got.first == want_u.first));
          CHECK((got.second == want_u.second));
        }
    }
}

using ref::fp_mode;

TEST_CASE("a caller that flushes subnormals (as XLA leaves its threads) gets the same bits", "[determinism][per_arch]") {
  // A gradient scale of 1e-39 (subnormal) makes subnormal gradients and moments: with the
  // caller's thread flushing them, its share of the range came out 0 while the worker
  // threads' did not. Every parallel region and step plan now runs in IEEE mode, and the
  // caller's mode is restored afterwards.
  const std::size_t n = 4099;
  std::mt19937 rng(43);
  ref::state start = ref::random_state(n, rng);
  std::fill(start.m.begin(), start.m.end(), 0.0f); // fresh moments: m becomes (1 - b1) * 1e-39 * g
  std::fill(start.v.begin(), start.v.end(), 0.0f);
  const ref::grad_buffer g = ref::random_grad(dtype::f32, n, rng);
  adam_config c = test_configs()[0];
  auto run = [&](const std::string& kernel, int threads) {
    ref::state s = start;
    std::vector<std::uint16_t> out(n);
    adam_step(s.p.data(), s.m.data(), s.v.data(), n, g.view(), {out.data(), n, dtype::bf16}, c, 2, 1e-39f,
              {threads, kernel});
    return std::make_pair(s, out);
  };
  const auto want = run("scalar", 1);
  bool any_subnormal = false;
  for (float m : want.first.m) any_subnormal = any_subnormal || (m != 0.0f && std::fabs(m) < 1.17549435e-38f);
  REQUIRE(any_subnormal); // the case exercises subnormals at all
  for (const auto& kernel : supported_kernels())
    for (int threads : {1, 2, 3}) {
      unsigned flushing = 0, after = 0;
      const auto got = [&] {
        const ref::flushing_scope scope;
        flushing = fp_mode();
        auto r = run(kernel, threads);
        after = fp_mode();
        return r;
      }();
      INFO("kernel " << kernel << " threads " << threads);
      CHECK((got.first == want.first));
      CHECK((got.second == want.second));
      CHECK(after == flushing); // the caller's mode is left as it was
    }
}

TEST_CASE("adam_update (optax form) gives adam_step's moments and the update new_p - p", "[adam][per_arch]") {
  std::mt19937 rng(17);
  const std::size_t sizes[] = {0, 1, 7, 8, 9, 16, 17, 33, 1001};
  for (const auto& kernel : supported_kernels())
    for (const auto& c : test_configs())
      for (dtype gt : all_dtypes)
        for (std::size_t n : sizes) {
          const ref::state s0 = ref::random_state(n, rng);
          const ref::grad_buffer g = ref::random_grad(gt, n, rng);
          ref::state a = s0, b = s0;
          adam_step(a.p.data(), a.m.data(), a.v.data(), n, g.view(), {}, c, 4, 1.0f, {1, kernel});
          out_buffer u(int(gt), n);
          const bool needs_p = c.weight_decay != 0;
          adam_update(needs_p ? b.p.data() : nullptr, b.m.data(), b.v.data(), n, g.view(), u.view(), c, 4, 1.0f,
                      {2, kernel});
          INFO(describe(kernel, c, gt, int(gt), n, 4));
          CHECK(a.m == b.m); // f32 vectors compared element-wise: NaN-free inputs, so equal bits
          CHECK(a.v == b.v);
          CHECK(b.p == s0.p); // params only read
          // The f32 update (the same gradient values as f32) against the double reference...
          ref::state c32 = s0;
          out_buffer u32(int(dtype::f32), n);
          adam_update(needs_p ? c32.p.data() : nullptr, c32.m.data(), c32.v.data(), n, {g.values.data(), n, dtype::f32},
                      u32.view(), c, 4, 1.0f, {1, kernel});
          CHECK(c32.m == b.m); // decoding a 16-bit gradient is exact: the same moments
          CHECK(c32.v == b.v);
          std::size_t bad = 0;
          for (std::size_t i = 0; i < n; ++i) {
            const auto pr = ref::adam_param(c, 4, 1.0, s0.p[i], b.m[i], b.v[i], g.values[i]);
            const double want = pr.p - s0.p[i];
            // Error is relative to the two terms summed: lr*wd*p and the Adam step.
            const double decay = c.mode == adam_mode::adamw ? c.lr * c.weight_decay : 0.0;
            const double scale = decay * std::fabs(s0.p[i]) + pr.p_terms - std::fabs(s0.p[i] * (1 - decay));
            bad += !ref::close(u32.f32[i], want, std::fabs(want) + scale, 8);
            // ...and the 16-bit update is exactly that f32 value rounded to nearest even,
            // subnormals included.
            if (gt != dtype::f32) bad += !u.holds(i, u32.f32[i]);
            else bad += ref::bits(u.f32[i]) != ref::bits(u32.f32[i]);
          }
          CHECK(bad == 0);
        }
}

TEST_CASE("adam_update over many leaves (one region) gives each leaf's own update, bit for bit", "[adam][per_arch]") {
  std::mt19937 rng(23);
  const std::size_t sizes[] = {0, 1, 17, 1000, 3, 64, 4097, 5};
  std::vector<adam_config> configs = test_configs();
  for (const auto& kernel : supported_kernels())
    for (dtype gt : all_dtypes) {
      std::vector<ref::state> whole, alone;
      std::vector<ref::grad_buffer> grads;
      std::vector<out_buffer> u_whole, u_alone;
      for (std::size_t n : sizes) {
        whole.push_back(ref::random_state(n, rng));
        alone.push_back(whole.back());
        grads.push_back(ref::random_grad(gt, n, rng));
        u_whole.emplace_back(int(gt), n);
        u_alone.emplace_back(int(gt), n);
      }
      std::vector<update_leaf> leaves;
      for (std::size_t i = 0; i < whole.size(); ++i)
        leaves.push_back({whole[i].p.data(), whole[i].m.data(), whole[i].v.data(), grads[i].view(), u_whole[i].view(),
                          i % configs.size()});
      adam_update(leaves, configs, 6, 0.5f, {3, kernel});
      for (std::size_t i = 0; i < alone.size(); ++i) {
        const std::size_t n = sizes[i];
        adam_update(alone[i].p.data(), alone[i].m.data(), alone[i].v.data(), n, grads[i].view(), u_alone[i].view(),
                    configs[i % configs.size()], 6, 0.5f, {1, kernel});
        INFO("kernel " << kernel << " grad " << dtype_name(gt) << " leaf " << i);
        CHECK(whole[i] == alone[i]);
        CHECK(u_whole[i] == u_alone[i]);
      }
      // A bad leaf is named and nothing is written.
      const auto before = whole;
      leaves[3].update.size = 2;
      CHECK_THROWS_WITH(adam_update(leaves, configs, 7, 1.0f, {1, kernel}), Catch::Contains("leaves[3].update.size = 2"));
      leaves[3].update.size = sizes[3];
      leaves[5].config = 99;
      CHECK_THROWS_WITH(adam_update(leaves, configs, 7, 1.0f, {1, kernel}), Catch::Contains("leaves[5].config = 99"));
      CHECK(whole == before);
    }
}

TEST_CASE("adam_update may write each leaf's update over its own gradient (bit for bit)", "[adam][per_arch]") {
  std::mt19937 rng(29);
  const std::size_t sizes[] = {0, 1, 17, 1000, 4097, 5};
  std::vector<adam_config> configs = test_configs();
  for (const auto& kernel : supported_kernels())
    for (dtype gt : all_dtypes) {
      std::vector<ref::state> apart, inplace;
      std::vector<ref::grad_buffer> grads, overwritten;
      std::vector<out_buffer> u;
      std::vector<update_leaf> a, b;
      for (std::size_t n : sizes) {
        apart.push_back(ref::random_state(n, rng));
        inplace.push_back(apart.back());
        grads.push_back(ref::random_grad(gt, n, rng));
        overwritten.push_back(grads.back());
        u.emplace_back(int(gt), n);
      }
      for (std::size_t i = 0; i < apart.size(); ++i) {
        a.push_back({apart[i].p.data(), apart[i].m.data(), apart[i].v.data(), grads[i].view(), u[i].view(),
                     i % configs.size()});
        const const_view g = overwritten[i].view();
        b.push_back({inplace[i].p.data(), inplace[i].m.data(), inplace[i].v.data(), g,
                     {const_cast<void*>(g.data), g.size, g.type}, i % configs.size()});
      }
      adam_update(a, configs, 5, 0.75f, {3, kernel});
      adam_update(b, configs, 5, 0.75f, {2, kernel});
      for (std::size_t i = 0; i < apart.size(); ++i) {
        INFO("kernel " << kernel << " grad " << dtype_name(gt) << " leaf " << i);
        CHECK(apart[i] == inplace[i]);
        const std::size_t bytes = sizes[i] * dtype_size(gt);
        CHECK((bytes == 0 || std::memcmp(overwritten[i].view().data, u[i].view().data, bytes) == 0));
      }
      // Overlapping without being the same buffer is still refused.
      if (sizes[3] > 1) {
        const const_view g = overwritten[3].view();
        b[3].update = {static_cast<char*>(const_cast<void*>(g.data)) + dtype_size(gt), g.size - 1, g.type};
        b[3].grad.size = g.size - 1;
        CHECK_THROWS_WITH(adam_update(b, configs, 6, 1.0f, {1, kernel}), Catch::Contains("overlap"));
      }
    }
}

TEST_CASE("the optax form takes a negative learning rate as optax does (adam_step refuses it)", "[adam][per_arch]") {
  std::mt19937 rng(31);
  const std::size_t n = 1000;
  for (const auto& kernel : supported_kernels()) {
    ref::state up = ref::random_state(n, rng), down = up;
    const ref::grad_buffer g = ref::random_grad(dtype::f32, n, rng);
    out_buffer u_up(int(dtype::f32), n), u_down(int(dtype::f32), n);
    adam_config c;
    c.lr = 3e-3;
    adam_update(nullptr, up.m.data(), up.v.data(), n, g.view(), u_up.view(), c, 4, 1.0f, {2, kernel});
    c.lr = -3e-3;
    adam_update(nullptr, down.m.data(), down.v.data(), n, g.view(), u_down.view(), c, 4, 1.0f, {2, kernel});
    INFO("kernel " << kernel);
    CHECK(up == down); // the same moments
    for (std::size_t i = 0; i < n; ++i) REQUIRE(u_down.f32[i] == -u_up.f32[i]); // the opposite update, exactly
    c.weight_decay = -0.1; // optax takes a negative decay too
    CHECK_NOTHROW(adam_update(up.p.data(), up.m.data(), up.v.data(), n, g.view(), u_up.view(), c, 5, 1.0f, {1, kernel}));
    CHECK_THROWS_WITH(adam_step(up.p.data(), up.m.data(), up.v.data(), n, g.view(), {}, c, 6, 1.0f, {1, kernel}),
                      Catch::Contains("lr"));
  }
}

TEST_CASE("the optax form takes eps or eps_root = +inf as optax does: the update is the decay term alone",
          "[adam][per_arch]") {
  std::mt19937 rng(37);
  const std::size_t n = 1000;
  for (const auto& kernel : supported_kernels()) {
    for (const bool root : {false, true}) {
      ref::state s = ref::random_state(n, rng), finite = s;
      const ref::grad_buffer g = ref::random_grad(dtype::f32, n, rng);
      out_buffer u(int(dtype::f32), n), u_finite(int(dtype::f32), n);
      adam_config c;
      c.lr = 3e-3;
      c.weight_decay = 0.1;
      adam_update(finite.p.data(), finite.m.data(), finite.v.data(), n, g.view(), u_finite.view(), c, 4, 1.0f,
                  {2, kernel});
      (root ? c.eps_root : c.eps) = std::numeric_limits<double>::infinity();
      adam_update(s.p.data(), s.m.data(), s.v.data(), n, g.view(), u.view(), c, 4, 1.0f, {2, kernel});
      INFO("kernel " << kernel << (root ? ", eps_root" : ", eps"));
      CHECK(s == finite); // the moments step as with a finite eps (optax's arithmetic too)
      const float lr_wd = float(c.lr * c.weight_decay);
      for (std::size_t i = 0; i < n; ++i) REQUIRE(ref::bits(u.f32[i]) == ref::bits(0.0f - lr_wd * s.p[i]));
      CHECK_THROWS_WITH(adam_step(s.p.data(), s.m.data(), s.v.data(), n, g.view(), {}, c, 5, 1.0f, {1, kernel}),
                        Catch::Contains(root ? "eps_root" : "eps"));
    }
  }
}

TEST_CASE("leaves that share memory are refused: one region runs them all at once", "[adam][errors]") {
  std::vector<float> p(64, 1.0f), m(64), v(64), g(64, 0.5f), u(64), u2(64);
  const std::vector<adam_config> cs{adam_config{}};
  // Two leaves sharing their moments (or one's update being another's gradient) would give
  // results that depend on the thread count.
  std::vector<update_leaf> shared{{p.data(), m.data(), v.data(), {g.data(), 32, dtype::f32}, {u.data(), 32, dtype::f32}, 0},
                                  {p.data() + 32, m.data() + 16, v.data() + 32, {g.data() + 32, 32, dtype::f32},
                                   {u.data() + 32, 32, dtype::f32}, 0}};
  CHECK_THROWS_WITH(adam_update(shared, cs, 1), Catch::Contains("exp_avg[0] ('leaf 0') and exp_avg[1] ('leaf 1') overlap"));
  std::vector<update_leaf> chained{{p.data(), m.data(), v.data(), {g.data(), 32, dtype::f32}, {u.data(), 32, dtype::f32}, 0},
                                   {p.data() + 32, m.data() + 32, v.data() + 32, {u.data(), 32, dtype::f32},
                                    {u2.data(), 32, dtype::f32}, 0}};
  CHECK_THROWS_WITH(adam_update(chained, cs, 1), Catch::Contains("overlap"));
  CHECK(m == std::vector<float>(64, 0.0f));
}

TEST_CASE("NaN results have one bit pattern on every kernel (and CPU architecture)", "[adam][per_arch][determinism]") {
  // x86 creates the NaN 0xFFC00000, AArch64 0x7FC00000, and operands propagate by different
  // rules: every kernel stores the canonical 0x7FC00000 (bf16 0x7FC0, f16 0x7E00).
  for (const auto& kernel : supported_kernels())
    for (int out = 0; out < 3; ++out) {
      const std::size_t n = 37;
      std::vector<float> p(n, 1.0f), m(n), v(n), g(n, 0.5f), acc(n, 1.0f);
      g[3] = std::numeric_limits<float>::infinity(); // inf * inf - ... : a created NaN
      g[20] = -std::numeric_limits<float>::quiet_NaN();
      out_buffer o(out, n);
      adam_step(p.data(), m.data(), v.data(), n, {g.data(), n, dtype::f32}, o.view(), {}, 1, 1.0f, {1, kernel});
      INFO("kernel " << kernel << " out " << out);
      CHECK(ref::bits(v[3]) == 0x7F800000u); // inf gradient: v = inf, p = inf/inf = a created NaN
      CHECK(ref::bits(v[20]) == 0x7FC00000u); // a NaN gradient (negative sign): propagated, canonical
      CHECK(ref::bits(m[20]) == 0x7FC00000u);
      for (std::size_t i : {std::size_t(3), std::size_t(20)}) {
        CHECK(ref::bits(p[i]) == 0x7FC00000u);
        if (out == 0) CHECK(ref::bits(o.f32[i]) == 0x7FC00000u);
        if (out == 1) CHECK(o.half[i] == 0x7FC0);
        if (out == 2) CHECK(o.half[i] == 0x7E00);
      }
      acc[5] = -std::numeric_limits<float>::infinity();
      g[5] = std::numeric_limits<float>::infinity();
      accumulate_gradient(acc.data(), {g.data(), n, dtype::f32}, false, {1, kernel});
      CHECK(ref::bits(acc[5]) == 0x7FC00000u); // inf + -inf
    }
}
