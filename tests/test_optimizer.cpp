// The optimizer state through its public API: layout, groups, schedules, per-tensor vs
// flat views, many tensors vs one, copy-out that never touches padding.
#include <catch2/catch.hpp>
#include <cfenv>

#include <cstring>
#include <filesystem>
#include <unistd.h>
#include <map>
#include <numeric>

#include "reference.hpp"
#include "temp_dir.hpp"

using namespace hostopt;

namespace {

std::vector<float> random_floats(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (auto& e : x) e = nd(rng);
  return x;
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

} // namespace

TEST_CASE("tensors are laid out group after group at 64-byte aligned offsets", "[optimizer]") {
  adam_config a, b;
  b.lr = 0.5;
  optimizer opt({{a, {{"w1", {3, 5}}, {"b1", {5}}, {"empty", {0, 4}}}}, {b, {{"scalar", {}}, {"w2", {17}}}}});
  const auto segs = opt.segments();
  REQUIRE(segs.size() == 5);
  std::size_t expected_offset = 0, total = 0;
  for (const auto& s : segs) {
    CHECK(s.offset == expected_offset);
    CHECK(s.offset % 16 == 0);
    expected_offset = (s.offset + s.size + 15) / 16 * 16;
    total += s.size;
  }
  CHECK(opt.tensor("w1").size == 15);
  CHECK(opt.tensor("empty").size == 0);
  CHECK(opt.tensor("scalar").size == 1);
  CHECK(opt.tensor("w2").group == 1);
  CHECK(opt.num_params() == total);
  CHECK(opt.arena_size() == expected_offset);
  CHECK(opt.state_bytes() == 12 * opt.arena_size());
  CHECK(reinterpret_cast<std::uintptr_t>(opt.params().data()) % 64 == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(opt.exp_avg().data()) % 64 == 0);
  for (float x : opt.params()) CHECK(x == 0.0f);
  CHECK(opt.step_count() == 0);
  CHECK(opt.group_config(1).lr == 0.5);
}

TEST_CASE("an empty optimizer steps without touching anything", "[optimizer]") {
  optimizer opt({});
  CHECK(opt.arena_size() == 0);
  const auto r = opt.step(const_view{nullptr, 0, dtype::f32});
  CHECK(r.applied);
  CHECK(opt.step_count() == 1);
}

TEST_CASE("groups with their own hyper-parameters match one-buffer steps", "[optimizer][adam]") {
  std::mt19937 rng(5);
  adam_config g0, g1, g2;
  g0.lr = 1e-2;
  g0.weight_decay = 0.1;
  g1.mode = adam_mode::adam;
  g1.weight_decay = 0.01;
  g1.beta1 = 0.8;
  g2.nesterov = true;
  g2.eps_root = 1e-6;
  const std::vector<param_group> groups{{g0, {{"a", {33}}, {"b", {7, 3}}}}, {g1, {{"c", {1000}}}}, {g2, {{"d", {17}}}}};
  optimizer opt(groups, {2, ""});
  // Reference: each tensor stepped alone with its group's config.
  std::map<std::string, ref::state> alone;
  std::map<std::string, ref::grad_buffer> grads;
  for (const auto& seg : opt.segments()) {
    ref::state s(seg.size);
    s.p = random_floats(seg.size, rng);
    opt.set_params(seg.name, {s.p.data(), s.p.size(), dtype::f32});
    alone.emplace(seg.name, s);
  }
  for (int step = 1; step <= 4; ++step) {
    std::vector<const_view> views;
    for (const auto& seg : opt.segments()) {
      grads.insert_or_assign(seg.name, ref::random_grad(dtype::bf16, seg.size, rng));
      views.push_back(grads.at(seg.name).view());
      auto& s = alone.at(seg.name);
      adam_step(s.p.data(), s.m.data(), s.v.data(), seg.size, grads.at(seg.name).view(), {},
                groups[seg.group].config, step, 1.0f, {1, "scalar"});
    }
    const auto r = opt.step(views);
    CHECK(r.applied);
    CHECK(r.step == step);
  }
  for (const auto& seg : opt.segments()) {
    INFO(seg.name);
    CHECK(same_bits(opt.params(seg.name), alone.at(seg.name).p));
    CHECK(same_bits(opt.exp_avg(seg.name), alone.at(seg.name).m));
    CHECK(same_bits(opt.exp_avg_sq(seg.name), alone.at(seg.name).v));
  }
}

TEST_CASE("lr changed between steps acts as a schedule", "[optimizer]") {
  std::mt19937 rng(8);
  adam_config c;
  optimizer opt({{c, {{"w", {257}}}}});
  ref::state s(257);
  const double lrs[] = {1e-3, 5e-4, 0.0, 2e-2};
  for (int t = 1; t <= 4; ++t) {
    const auto g = ref::random_grad(dtype::f32, 257, rng);
    opt.set_lr(0, lrs[t - 1]);
    c.lr = lrs[t - 1];
    opt.step(std::vector<const_view>{g.view()});
    adam_step(s.p.data(), s.m.data(), s.v.data(), 257, g.view(), {}, c, t);
  }
  CHECK(same_bits(opt.params("w"), s.p));
  CHECK(same_bits(opt.exp_avg_sq("w"), s.v));
}

TEST_CASE("many small tensors give the same bits as one flat tensor", "[optimizer][determinism]") {
  std::mt19937 rng(9);
  std::vector<tensor_spec> many;
  std::size_t total = 0;
  std::uniform_int_distribution<int> len(0, 70);
  for (int i = 0; i < 300; ++i) {
    const int n = len(rng);
    many.push_back({"t" + std::to_string(i), {n}});
    total += std::size_t(n);
  }
  adam_config c;
  c.weight_decay = 0.02;
  optimizer split({{c, many}}, {2, ""});
  optimizer flat({{c, {{"all", {std::int64_t(total)}}}}}, {1, ""});
  const auto p0 = random_floats(total, rng);
  flat.set_params("all", {p0.data(), total, dtype::f32});
  std::size_t at = 0;
  for (const auto& seg : split.segments()) {
    split.set_params(seg.name, {p0.data() + at, seg.size, dtype::f32});
    at += seg.size;
  }
  for (int t = 0; t < 3; ++t) {
    const auto g = ref::random_grad(dtype::f16, total, rng);
    std::vector<std::uint16_t> out_flat(total), out_split(total);
    std::vector<const_view> gv;
    std::vector<mut_view> ov;
    at = 0;
    for (const auto& seg : split.segments()) {
      gv.push_back(g.view(at, seg.size));
      ov.push_back({out_split.data() + at, seg.size, dtype::bf16});
      at += seg.size;
    }
    split.step(gv, ov);
    flat.step(std::vector<const_view>{g.view()}, std::vector<mut_view>{{out_flat.data(), total, dtype::bf16}});
    CHECK(out_flat == out_split);
  }
  at = 0;
  for (const auto& seg : split.segments()) {
    CHECK(same_bits(split.params(seg.name), std::span<const float>(flat.params().data() + at, seg.size)));
    CHECK(same_bits(split.exp_avg(seg.name), std::span<const float>(flat.exp_avg().data() + at, seg.size)));
    at += seg.size;
  }
}

TEST_CASE("flat views in arena layout equal per-tensor views, padding is never written", "[optimizer]") {
  std::mt19937 rng(10);
  adam_config c;
  const std::vector<param_group> groups{{c, {{"x", {5}}, {"y", {3, 3}}, {"z", {20}}}}};
  optimizer a(groups), b(groups);
  const std::size_t n = a.arena_size();
  const auto g = ref::random_grad(dtype::f32, n, rng);
  std::vector<float> out_flat(n, -1.0f);
  a.step(g.view(), mut_view{out_flat.data(), n, dtype::f32});
  std::vector<const_view> gv;
  std::vector<mut_view> ov;
  std::vector<float> out_split(n, -1.0f);
  for (const auto& s : b.segments()) {
    gv.push_back(g.view(s.offset, s.size));
    ov.push_back({out_split.data() + s.offset, s.size, dtype::f32});
  }
  b.step(gv, ov);
  CHECK(same_bits(a.params(), b.params()));
  CHECK(same_bits(out_flat, out_split));
  std::vector<bool> in_tensor(n, false);
  for (const auto& s : a.segments())
    for (std::size_t i = 0; i < s.size; ++i) in_tensor[s.offset + i] = true;
  for (std::size_t i = 0; i < n; ++i) {
    if (in_tensor[i]) CHECK(out_flat[i] == a.params()[i]);
    else CHECK(out_flat[i] == -1.0f); // padding untouched
  }
}

TEST_CASE("set_params converts from every dtype, step count can be set for resuming", "[optimizer]") {
  optimizer opt({{adam_config{}, {{"w", {3}}}}});
  const std::uint16_t bf[] = {0x3F80, 0xC000, 0x0000}; // 1, -2, 0
  opt.set_params("w", {bf, 3, dtype::bf16});
  CHECK(opt.params("w")[1] == -2.0f);
  const std::uint16_t h[] = {0x3C00, 0x3800, 0x7C00}; // 1, 0.5, inf
  opt.set_params("w", {h, 3, dtype::f16});
  CHECK(opt.params("w")[1] == 0.5f);
  CHECK(std::isinf(opt.params("w")[2]));
  opt.set_step_count(41);
  const float g[3] = {1, 1, 1};
  CHECK(opt.step(std::vector<const_view>{{g, 3, dtype::f32}}).step == 42);
}

TEST_CASE("thread count and kernel can change between steps without changing results", "[optimizer][determinism]") {
  std::mt19937 rng(12);
  const std::vector<param_group> groups{{adam_config{}, {{"w", {4099}}}}};
  optimizer a(groups, {1, "scalar"}), b(groups, {3, ""});
  for (int t = 0; t < 3; ++t) {
    const auto g = ref::random_grad(dtype::f32, a.arena_size(), rng);
    a.step(g.view());
    b.step(g.view());
    b.set_execution({t + 1, t == 1 ? "scalar" : ""});
  }
  CHECK(same_bits(a.params(), b.params()));
  CHECK(same_bits(a.exp_avg_sq(), b.exp_avg_sq()));
}

TEST_CASE("a tensor without a gradient is left untouched", "[optimizer]") {
  std::mt19937 rng(13);
  adam_config c;
  optimizer opt({{c, {{"a", {40}}, {"frozen", {9}}}}});
  ref::state a(40);
  for (std::size_t i = 0; i < 9; ++i) opt.params("frozen")[i] = float(i);
  std::vector<float> out_frozen(9, -1.0f), out_a(40);
  for (int t = 1; t <= 2; ++t) {
    const auto g = ref::random_grad(dtype::f32, 40, rng);
    opt.step(std::vector<const_view>{g.view(), const_view{}},
             std::vector<mut_view>{{out_a.data(), 40, dtype::f32}, {out_frozen.data(), 9, dtype::f32}});
    adam_step(a.p.data(), a.m.data(), a.v.data(), 40, g.view(), {}, c, t);
  }
  CHECK(same_bits(opt.params("a"), a.p));
  for (std::size_t i = 0; i < 9; ++i) {
    CHECK(opt.params("frozen")[i] == float(i));
    CHECK(opt.exp_avg("frozen")[i] == 0.0f);
    CHECK(out_frozen[i] == -1.0f);
  }
}

TEST_CASE("each tensor keeps its own step count: a late first gradient is bias-corrected from t = 1", "[optimizer]") {
  std::mt19937 rng(17);
  adam_config c;
  c.lr = 0.1;
  c.weight_decay = 0.01;
  optimizer opt({{c, {{"a", {40}}, {"late", {9}}}}});
  ref::state a(40), late(9);
  for (std::size_t i = 0; i < 9; ++i) opt.params("late")[i] = late.p[i] = 0.9f;
  // Five steps without a gradient for "late", then both: "late" is at its own step 1.
  for (int t = 1; t <= 7; ++t) {
    const auto ga = ref::random_grad(dtype::f32, 40, rng);
    const auto gl = ref::random_grad(dtype::f32, 9, rng);
    opt.step(std::vector<const_view>{ga.view(), t <= 5 ? const_view{} : gl.view()});
    adam_step(a.p.data(), a.m.data(), a.v.data(), 40, ga.view(), {}, c, t);
    if (t > 5) adam_step(late.p.data(), late.m.data(), late.v.data(), 9, gl.view(), {}, c, t - 5);
  }
  CHECK(opt.step_count() == 7);
  CHECK(opt.tensor_steps() == std::vector<std::int64_t>{7, 2});
  CHECK(same_bits(opt.params("a"), a.p));
  CHECK(same_bits(opt.params("late"), late.p));
  CHECK(same_bits(opt.exp_avg_sq("late"), late.v));
  // A flat step advances every tensor from its own count; set_step_count aligns them.
  std::vector<float> flat(opt.arena_size(), 0.25f);
  opt.step(const_view{flat.data(), flat.size(), dtype::f32});
  adam_step(a.p.data(), a.m.data(), a.v.data(), 40, const_view{flat.data(), 40, dtype::f32}, {}, c, 8);
  adam_step(late.p.data(), late.m.data(), late.v.data(), 9, const_view{flat.data(), 9, dtype::f32}, {}, c, 3);
  CHECK(opt.tensor_steps() == std::vector<std::int64_t>{8, 3});
  CHECK(same_bits(opt.params("a"), a.p));
  CHECK(same_bits(opt.params("late"), late.p));
  opt.set_step_count(4);
  CHECK(opt.tensor_steps() == std::vector<std::int64_t>{4, 4});
}

TEST_CASE("a tensor whose count was aligned steps with its group's scalars again", "[optimizer]") {
  std::mt19937 rng(23);
  adam_config c;
  c.lr = 0.1;
  optimizer opt({{c, {{"a", {40}}, {"late", {9}}}}});
  ref::state a(40), late(9);
  // "late" misses steps 1 and 2, steps at its own t = 1, then set_step_count aligns both.
  for (int t = 1; t <= 4; ++t) {
    if (t == 4) opt.set_step_count(3);
    const auto ga = ref::random_grad(dtype::f32, 40, rng);
    const auto gl = ref::random_grad(dtype::f32, 9, rng);
    opt.step(std::vector<const_view>{ga.view(), t <= 2 ? const_view{} : gl.view()});
    adam_step(a.p.data(), a.m.data(), a.v.data(), 40, ga.view(), {}, c, t);
    if (t > 2) adam_step(late.p.data(), late.m.data(), late.v.data(), 9, gl.view(), {}, c, t == 3 ? 1 : 4);
  }
  CHECK(opt.tensor_steps() == std::vector<std::int64_t>{4, 4});
  CHECK(same_bits(opt.params("a"), a.p));
  CHECK(same_bits(opt.params("late"), late.p));
  CHECK(same_bits(opt.exp_avg_sq("late"), late.v));
}

TEST_CASE("a lagging tensor stepped from a thread that rounds otherwise gets the default mode's bits", "[optimizer]") {
  // Every step plan runs in IEEE mode whatever the caller's mode: the scalars of a tensor
  // with its own step count too (they were made outside that scope, in the caller's mode).
  adam_config c;
  c.lr = 0.01;
  std::vector<float> ga(64, 0.3f), gb(64, -0.7f);
  auto run = [&](int mode) {
    optimizer opt({{c, {{"a", {64}}, {"b", {64}}}}});
    const int before = std::fegetround();
    std::fesetround(mode);
    opt.step(std::vector<const_view>{{ga.data(), 64, dtype::f32}, {}}); // b has no gradient: it lags
    opt.step(std::vector<const_view>{{ga.data(), 64, dtype::f32}, {gb.data(), 64, dtype::f32}});
    std::fesetround(before);
    return std::vector<float>(opt.params("b").begin(), opt.params("b").end());
  };
  const auto want = run(FE_TONEAREST);
  for (const int mode : {FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO}) {
    INFO("rounding mode " << mode);
    CHECK(same_bits(run(mode), want));
  }
}

TEST_CASE("per-tensor step counts load as torch gives them and survive a checkpoint", "[optimizer][checkpoint]") {
  std::mt19937 rng(19);
  adam_config c;
  const std::vector<param_group> groups{{c, {{"w", {33}}, {"b", {5}}}}};
  optimizer opt(groups);
  const std::vector<std::int64_t> torch_steps{5, 2};
  opt.set_tensor_steps(torch_steps);
  CHECK(opt.step_count() == 5);
  CHECK(opt.tensor_steps() == torch_steps);
  ref::state w(33), b(5);
  const auto gw = ref::random_grad(dtype::f32, 33, rng), gb = ref::random_grad(dtype::f32, 5, rng);
  opt.step(std::vector<const_view>{gw.view(), gb.view()});
  adam_step(w.p.data(), w.m.data(), w.v.data(), 33, gw.view(), {}, c, 6);
  adam_step(b.p.data(), b.m.data(), b.v.data(), 5, gb.view(), {}, c, 3);
  CHECK(same_bits(opt.params("w"), w.p));
  CHECK(same_bits(opt.params("b"), b.p));

  const hostopt_test::temp_dir scratch("tensor_steps");
  const std::string path = (scratch.path / "ckpt.safetensors").string();
  save_checkpoint(opt, path);
  optimizer loaded(groups);
  load_checkpoint(loaded, path);
  CHECK(loaded.tensor_steps() == std::vector<std::int64_t>{6, 3});
  opt.step(std::vector<const_view>{gw.view(), gb.view()});
  loaded.step(std::vector<const_view>{gw.view(), gb.view()});
  CHECK(std::memcmp(loaded.params().data(), opt.params().data(), opt.arena_size() * 4) == 0);
  // A shard's tensors share one count: such a file is refused before anything changes.
  optimizer shard(groups, arena_range{0, 48});
  CHECK_THROWS_WITH(load_checkpoint(shard, path), Catch::Contains("step counts of their own"));
  CHECK_THROWS_WITH(shard.set_tensor_steps(torch_steps), Catch::Contains("share one step count"));
  CHECK_THROWS_WITH(opt.set_tensor_steps(std::vector<std::int64_t>{1}), Catch::Contains("expected one per tensor"));
  CHECK_THROWS_WITH(opt.set_tensor_steps(std::vector<std::int64_t>{1, -1}), Catch::Contains("'b' step count = -1"));
}

TEST_CASE("maximize ascends: the bits of a step on the negated gradient, weight decay unchanged", "[optimizer]") {
  std::mt19937 rng(23);
  for (const adam_mode mode : {adam_mode::adam, adam_mode::adamw}) {
    adam_config up, down;
    up.mode = down.mode = mode;
    up.weight_decay = down.weight_decay = 0.1;
    up.maximize = true;
    optimizer a({{up, {{"w", {37}}}}}), b({{down, {{"w", {37}}}}});
    for (std::size_t i = 0; i < 37; ++i) a.params()[i] = b.params()[i] = 0.5f + 0.01f * float(i);
    for (int t = 0; t < 3; ++t) {
      auto g = ref::random_grad(dtype::f32, 37, rng);
      a.step(std::vector<const_view>{const_view{g.f32.data(), 37, dtype::f32}});
      for (auto& x : g.f32) x = -x;
      b.step(std::vector<const_view>{const_view{g.f32.data(), 37, dtype::f32}});
    }
    CHECK(same_bits(a.params("w"), std::vector<float>(b.params().begin(), b.params().begin() + 37)));
    CHECK(a.group_config(0).maximize);
  }
}

TEST_CASE("a chunked step covers the arena in order, once, with the caller's buffers", "[optimizer][errors]") {
  optimizer opt({{adam_config{}, {{"w", {64}}}}});
  std::vector<float> g(64, 0.5f), out(64);
  float* state = opt.exp_avg().data(); // taken before: views are refused while a chunked step is open
  opt.begin_step({});
  CHECK_THROWS_WITH(opt.update_range(16, 32, g.data()), Catch::Contains("expected the next chunk, starting at 0"));
  opt.update_range(0, 32, g.data());
  CHECK_THROWS_WITH(opt.update_range(0, 32, g.data()), Catch::Contains("starting at 32")); // twice
  CHECK_THROWS_WITH(opt.finish_step(), Catch::Contains("cover [0, 32) of the 64"));        // half
  // A chunk's gradient may not be the optimizer's own state.
  CHECK_THROWS_WITH(opt.update_range(32, 64, state + 32), Catch::Contains("optimizer state and grads overlap"));
  opt.abort_step();
  CHECK_FALSE(opt.usable()); // half of it was updated
  opt.reset_failure();
  chunk_step_options with_out;
  with_out.copy_out = true;
  opt.begin_step(with_out);
  CHECK_THROWS_WITH(opt.update_range(0, 64, g.data(), state), Catch::Contains("optimizer state and outs overlap"));
  opt.update_range(0, 64, g.data(), out.data());
  CHECK(opt.finish_step().step == 1);
}
