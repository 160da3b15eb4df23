#pragma once
// What the stored optimizer's suites share: models of every moment format, the gradients and
// initial parameters of a run, small stores, and bit-for-bit comparisons with the in-RAM
// optimizer.
#include <catch2/catch.hpp>

#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "hostopt/optimizer.hpp"
#include "hostopt/stored_optimizer.hpp"

namespace hostopt_test::store {

using namespace hostopt;

inline adam_config cfg(double lr, double wd) {
  adam_config c;
  c.lr = lr;
  c.weight_decay = wd;
  return c;
}

// Three groups, one per moment format, tensors of odd sizes (8-bit ones end mid-block).
inline std::vector<param_group> mixed_groups() {
  std::vector<param_group> g(3);
  g[0].config = cfg(1e-3, 0.01);
  g[0].tensors = {{"emb", {37, 29}}, {"norm", {17}}, {"empty", {0}}};
  g[1].config = cfg(2e-3, 0.0);
  g[1].moments = moment_format::bf16;
  g[1].rounding_seed = 11;
  g[1].tensors = {{"attn", {61, 40}}, {"bias", {5}}};
  g[2].config = cfg(5e-4, 0.1);
  g[2].moments = moment_format::q8;
  g[2].rounding_seed = 7;
  g[2].tensors = {{"mlp", {97, 33}}, {"head", {1}}, {"proj", {64}}};
  return g;
}

inline std::vector<param_group> f32_groups() {
  std::vector<param_group> g(1);
  g[0].config = cfg(1e-3, 0.01);
  g[0].tensors = {{"w", {4001}}, {"b", {33}}};
  return g;
}

// The flat gradient of step t: every step, element and tensor differs.
inline std::vector<float> grad_of(std::size_t n, std::int64_t t) {
  std::vector<float> g(n);
  std::uint64_t x = 0x9E3779B97F4A7C15ull * std::uint64_t(t + 3);
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    g[i] = float(std::int64_t(x % 2001) - 1000) * 1e-3f * (1.0f + float(i % 7));
  }
  return g;
}

inline std::vector<float> initial_params(std::span<const segment> layout, std::size_t n) {
  std::vector<float> p(n, 0.0f);
  for (const segment& s : layout)
    for (std::size_t i = 0; i < s.size; ++i) p[s.offset + i] = 0.01f * float(int((s.offset + i) % 201) - 100);
  return p;
}

// Every tensor's params and moments (codes, for compressed groups) bit for bit.
inline void require_same_state(optimizer& a, optimizer& b) {
  REQUIRE(a.step_count() == b.step_count());
  REQUIRE(a.skipped_steps() == b.skipped_steps());
  for (const segment& s : a.segments()) {
    if (s.size == 0) continue; // (nothing to compare: its views may be null, which memcmp may not take)
    INFO("tensor " << s.name);
    auto pa = a.params(s.name), pb = b.params(s.name);
    REQUIRE(std::memcmp(pa.data(), pb.data(), pa.size_bytes()) == 0);
    const moment_format f = a.group_moments(s.group);
    if (f == moment_format::f32) {
      REQUIRE(std::memcmp(a.exp_avg(s.name).data(), b.exp_avg(s.name).data(), s.size * 4) == 0);
      REQUIRE(std::memcmp(a.exp_avg_sq(s.name).data(), b.exp_avg_sq(s.name).data(), s.size * 4) == 0);
    } else {
      const compressed_moments ca = a.moment_codes(s.name), cb = b.moment_codes(s.name);
      const std::size_t code = moment_code_bytes(f);
      REQUIRE(std::memcmp(ca.exp_avg, cb.exp_avg, s.size * code) == 0);
      REQUIRE(std::memcmp(ca.exp_avg_sq, cb.exp_avg_sq, s.size * code) == 0);
      if (f == moment_format::q8) REQUIRE(std::memcmp(ca.scales, cb.scales, moment_scale_bytes(f, s.size)) == 0);
    }
  }
}

inline void require_same_as(const stored_optimizer& stored, optimizer& reference, const std::vector<param_group>& groups) {
  optimizer copy(groups);
  stored.copy_state_to(copy);
  require_same_state(copy, reference);
}

// A store of 512-element chunks in 3 buffers, without fdatasync: many chunks, few buffers.
inline state_store_options small_store(const std::string& dir, const std::string& io = "auto") {
  state_store_options o;
  o.dirs = {dir};
  o.chunk_elements = 512;
  o.buffers = 3;
  o.sync_every_step = false;
  o.io = io;
  return o;
}

} // namespace hostopt_test::store
