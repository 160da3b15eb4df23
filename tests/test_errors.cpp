// Bad input: every public entry point refuses it with std::invalid_argument whose message
// names the argument, and leaves the state exactly as it was.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <limits>

#include "reference.hpp"

using namespace hostopt;

namespace {

constexpr double qnan = std::numeric_limits<double>::quiet_NaN();
constexpr double pinf = std::numeric_limits<double>::infinity();

struct bad_case {
  const char* what;
  const char* message_part; // must appear in the exception's message
  std::function<void()> call;
};

void expect_refused(const bad_case& c, const std::function<bool()>& unchanged) {
  INFO("case: " << c.what);
  bool threw = false;
  try {
    c.call();
  } catch (const std::invalid_argument& e) {
    threw = true;
    const std::string msg = e.what();
    INFO("message: " << msg);
    CHECK(msg.find(c.message_part) != std::string::npos);
  }
  CHECK(threw);
  CHECK(unchanged());
}

// Whether constructing an optimizer of `g` is refused with a message containing `part`.
bool refused(std::vector<param_group> g, const std::string& part) {
  try {
    optimizer opt(std::move(g));
  } catch (const std::invalid_argument& e) {
    INFO(e.what());
    return std::string(e.what()).find(part) != std::string::npos;
  }
  return false;
}

adam_config with(void (*edit)(adam_config&)) {
  adam_config c;
  edit(c);
  return c;
}

} // namespace

TEST_CASE("adam_step refuses bad input and writes nothing", "[errors]") {
  const std::size_t n = 37;
  std::mt19937 rng(1);
  ref::state s = ref::random_state(n, rng);
  const ref::state before = s;
  std::vector<float> g(n, 0.5f), out(n, 0.0f);
  std::vector<std::uint16_t> g16(n, 0x3C00);
  const adam_config ok;
  float* p = s.p.data();
  float* m = s.m.data();
  float* v = s.v.data();
  const const_view gv{g.data(), n, dtype::f32};
  const std::vector<bad_case> cases{
      {"null params", "params.data is null", [&] { adam_step(nullptr, m, v, n, gv, {}, ok, 1); }},
      {"null exp_avg", "exp_avg.data is null", [&] { adam_step(p, nullptr, v, n, gv, {}, ok, 1); }},
      {"null exp_avg_sq", "exp_avg_sq.data is null", [&] { adam_step(p, m, nullptr, n, gv, {}, ok, 1); }},
      {"null grad", "grad.data is null", [&] { adam_step(p, m, v, n, {nullptr, n, dtype::f32}, {}, ok, 1); }},
      {"null out with a size", "out.data is null",
       [&] { adam_step(p, m, v, n, gv, {nullptr, n, dtype::f32}, ok, 1); }},
      {"short grad", "grad.size = 36: expected 37", [&] { adam_step(p, m, v, n, {g.data(), n - 1, dtype::f32}, {}, ok, 1); }},
      {"long out", "out.size = 38: expected 37",
       [&] { adam_step(p, m, v, n, gv, {out.data(), n + 1, dtype::f32}, ok, 1); }},
      {"grad dtype not in the enum", "grad.type = 7",
       [&] { adam_step(p, m, v, n, {g.data(), n, dtype(7)}, {}, ok, 1); }},
      {"out dtype not in the enum", "out.type = 9",
       [&] { adam_step(p, m, v, n, gv, {out.data(), n, dtype(9)}, ok, 1); }},
      {"grad overlapping params", "overlap",
       [&] { adam_step(p, m, v, n, {p, n, dtype::f32}, {}, ok, 1); }},
      {"out aliasing exp_avg", "overlap",
       [&] { adam_step(p, m, v, n, gv, {m, n, dtype::f32}, ok, 1); }},
      {"out overlapping grad", "overlap",
       [&] { adam_step(p, m, v, n, gv, {g.data() + 3, n, dtype::bf16}, ok, 1); }},
      {"params overlapping exp_avg", "overlap", [&] { adam_step(p, p + 1, v, n - 1, {g.data(), n - 1, dtype::f32}, {}, ok, 1); }},
      {"step 0", "step = 0", [&] { adam_step(p, m, v, n, gv, {}, ok, 0); }},
      {"negative step", "step = -3", [&] { adam_step(p, m, v, n, gv, {}, ok, -3); }},
      {"NaN lr", "lr = nan", [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.lr = qnan; }), 1); }},
      {"negative lr", "lr = -0.001",
       [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.lr = -1e-3; }), 1); }},
      {"infinite lr", "lr = inf", [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.lr = pinf; }), 1); }},
      {"beta1 = 1", "beta1 = 1", [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.beta1 = 1; }), 1); }},
      {"negative beta1", "beta1 = -0.5",
       [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.beta1 = -0.5; }), 1); }},
      {"beta2 > 1", "beta2 = 1.5", [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.beta2 = 1.5; }), 1); }},
      {"NaN beta2", "beta2 = nan", [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.beta2 = qnan; }), 1); }},
      {"negative eps", "eps = -1", [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.eps = -1; }), 1); }},
      {"NaN eps", "eps = nan", [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.eps = qnan; }), 1); }},
      {"negative eps_root", "eps_root = -1",
       [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.eps_root = -1; }), 1); }},
      {"NaN weight_decay", "weight_decay = nan",
       [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.weight_decay = qnan; }), 1); }},
      {"negative weight_decay", "weight_decay = -0.1",
       [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.weight_decay = -0.1; }), 1); }},
      {"mode not in the enum", "mode = 5",
       [&] { adam_step(p, m, v, n, gv, {}, with([](adam_config& c) { c.mode = adam_mode(5); }), 1); }},
      {"NaN grad_scale", "grad_scale", [&] { adam_step(p, m, v, n, gv, {}, ok, 1, std::nanf("")); }},
      {"negative grad_scale", "grad_scale", [&] { adam_step(p, m, v, n, gv, {}, ok, 1, -1.0f); }},
      {"negative threads", "threads = -2", [&] { adam_step(p, m, v, n, gv, {}, ok, 1, 1.0f, {-2, ""}); }},
      {"unknown kernel", "unknown name 'avx9000'", [&] { adam_step(p, m, v, n, gv, {}, ok, 1, 1.0f, {1, "avx9000"}); }},
  };
  for (const auto& c : cases) expect_refused(c, [&] { return s == before && out == std::vector<float>(n, 0.0f); });
}

TEST_CASE("the optimizer refuses bad input and leaves its state untouched", "[errors][optimizer]") {
  std::mt19937 rng(2);
  optimizer opt({{adam_config{}, {{"w", {10}}, {"b", {3}}}}});
  const auto p0 = ref::random_state(10, rng).p;
  opt.set_params("w", {p0.data(), 10, dtype::f32});
  opt.step(std::vector<const_view>{{p0.data(), 10, dtype::f32}, {p0.data(), 3, dtype::f32}});
  auto snapshot = [&] {
    return std::make_tuple(std::vector<float>(opt.params().begin(), opt.params().end()),
                           std::vector<float>(opt.exp_avg().begin(), opt.exp_avg().end()),
                           std::vector<float>(opt.exp_avg_sq().begin(), opt.exp_avg_sq().end()), opt.step_count(),
                           opt.group_config(0).lr);
  };
  const auto before = snapshot();
  const std::size_t n = opt.arena_size();
  std::vector<float> flat(n, 0.1f), out(n, 0.0f);
  std::vector<std::uint16_t> half(n, 0x3C00);
  const std::vector<const_view> two{{flat.data(), 10, dtype::f32}, {flat.data() + 16, 3, dtype::f32}};
  const std::vector<bad_case> cases{
      {"flat grad of the packed size", "flat_grad.size = 13: expected 32",
       [&] { opt.step(const_view{flat.data(), 13, dtype::f32}); }},
      {"null flat grad", "flat_grad.data is null", [&] { opt.step(const_view{nullptr, n, dtype::f32}); }},
      {"flat out too short", "flat_out.size = 31",
       [&] { opt.step(const_view{flat.data(), n, dtype::f32}, mut_view{out.data(), n - 1, dtype::f32}); }},
      {"flat out aliasing flat grad", "overlap",
       [&] { opt.step(const_view{flat.data(), n, dtype::f32}, mut_view{flat.data(), n, dtype::f32}); }},
      {"grad aliasing the optimizer's own params", "overlap",
       [&] { opt.step(const_view{opt.params().data(), n, dtype::f32}); }},
      {"too few per-tensor grads", "grads: 1 views: expected one per tensor (2)",
       [&] { opt.step(std::vector<const_view>{{flat.data(), 10, dtype::f32}}); }},
      {"per-tensor grad of the wrong size", "grads[1] ('b').size = 4: expected 3",
       [&] { opt.step(std::vector<const_view>{{flat.data(), 10, dtype::f32}, {flat.data() + 16, 4, dtype::f32}}); }},
      {"mixed gradient dtypes", "grads[1] ('b').type = f16: expected f32",
       [&] { opt.step(std::vector<const_view>{{flat.data(), 10, dtype::f32}, {half.data(), 3, dtype::f16}}); }},
      {"null per-tensor grad", "grads[0] ('w').data is null",
       [&] { opt.step(std::vector<const_view>{{nullptr, 10, dtype::f32}, {flat.data() + 16, 3, dtype::f32}}); }},
      {"wrong number of outs", "outs: 1 views",
       [&] { opt.step(two, std::vector<mut_view>{{out.data(), 10, dtype::f32}}); }},
      {"two outs overlapping", "outs[0] ('w') and outs[1] ('b') overlap",
       [&] { opt.step(two, std::vector<mut_view>{{out.data(), 10, dtype::f32}, {out.data() + 8, 3, dtype::f32}}); }},
      {"out overlapping a grad", "overlap",
       [&] { opt.step(two, std::vector<mut_view>{{flat.data() + 16, 10, dtype::bf16}, {half.data(), 3, dtype::bf16}}); }},
      {"NaN grad_scale", "grad_scale", [&] { opt.step(const_view{flat.data(), n, dtype::f32}, {}, std::nanf("")); }},
      {"unknown tensor name", "tensor name 'nope': unknown", [&] { opt.params("nope"); }},
      {"set_params of an unknown tensor", "tensor name 'x'", [&] { opt.set_params("x", {flat.data(), 10, dtype::f32}); }},
      {"set_params of the wrong size", "values.size = 9: expected 10",
       [&] { opt.set_params("w", {flat.data(), 9, dtype::f32}); }},
      {"set_lr NaN", "lr = nan", [&] { opt.set_lr(0, qnan); }},
      {"set_group_config with beta1 = 1", "beta1 = 1",
       [&] { opt.set_group_config(0, with([](adam_config& c) { c.beta1 = 1; })); }},
      {"group index out of range", "group = 3", [&] { opt.set_lr(3, 0.1); }},
      {"negative step count", "step count = -1", [&] { opt.set_step_count(-1); }},
      {"negative threads", "threads = -1", [&] { opt.set_execution({-1, ""}); }},
      {"unknown kernel", "unknown name 'mmx'", [&] { opt.set_execution({1, "mmx"}); }},
  };
  for (const auto& c : cases) expect_refused(c, [&] { return snapshot() == before && out == std::vector<float>(n, 0.0f); });
}

TEST_CASE("the constructor names bad tensors and groups", "[errors][optimizer]") {
  CHECK(refused({{adam_config{}, {{"a", {2}}, {"a", {3}}}}}, "tensor name 'a': registered twice"));
  CHECK(refused({{adam_config{}, {{"", {2}}}}}, "empty name"));
  CHECK(refused({{adam_config{}, {{"neg", {2, -1}}}}}, "tensor 'neg': shape[1] = -1"));
  CHECK(refused({{adam_config{}, {}}, {with([](adam_config& c) { c.beta2 = -1; }), {}}}, "groups[1].config.beta2 = -1"));
  CHECK_THROWS_AS(optimizer({}, {-4, ""}), std::invalid_argument);
  CHECK(refused({}, "") == false); // an empty optimizer is fine
}

TEST_CASE("dtype helpers name bad values", "[errors]") {
  CHECK(parse_dtype("bfloat16") == dtype::bf16);
  CHECK(dtype_size(dtype::f16) == 2);
  CHECK_THROWS_WITH(parse_dtype("f64"), Catch::Contains("unknown name 'f64'"));
  CHECK_THROWS_WITH(dtype_size(dtype(3)), Catch::Contains("value 3 is not a dtype"));
}

TEST_CASE("sizes that overflow or exceed addressable memory are refused before allocating", "[errors][optimizer]") {
  const std::int64_t big = (std::int64_t(1) << 58) - 1;
  // The sum of five such tensors wrapped around size_t and crashed the constructor.
  std::vector<tensor_spec> five;
  for (int i = 0; i < 5; ++i) five.push_back({"t" + std::to_string(i), {big}});
  CHECK(refused({{adam_config{}, five}}, "would exceed"));
  // Sixteen of them reported state_bytes 192.
  std::vector<tensor_spec> sixteen;
  for (int i = 0; i < 16; ++i) sixteen.push_back({"t" + std::to_string(i), {big}});
  CHECK(refused({{adam_config{}, sixteen}}, "tensor 't0'"));
  CHECK(refused({{adam_config{}, {{"wide", {1 << 30, 1 << 30, 1 << 30}}}}}, "tensor 'wide'"));
  // Each tensor fits on its own, the arena does not.
  const std::int64_t third = std::int64_t(max_state_bytes / 12 / 3);
  CHECK(refused({{adam_config{}, {{"a", {third}}, {"b", {third}}, {"c", {third}}, {"d", {third}}}}},
                "the sum of the tensor sizes"));
  CHECK_THROWS_WITH(arena_layout({{adam_config{}, five}}), Catch::Contains("would exceed"));
  // A zero extent makes any other extent harmless.
  optimizer empty({{adam_config{}, {{"z", {0, big, big}}}}});
  CHECK(empty.num_params() == 0);
}

TEST_CASE("thread counts above the documented bound are refused", "[errors]") {
  CHECK(max_threads() >= 4);
  CHECK(max_threads() <= 1024);
  std::vector<float> p(8), m(8), v(8), g(8, 1.0f);
  for (int threads : {max_threads() + 1, 60000, 100000}) {
    INFO("threads " << threads);
    CHECK_THROWS_WITH(adam_step(p.data(), m.data(), v.data(), 8, {g.data(), 8, dtype::f32}, {}, {}, 1, 1.0f, {threads, ""}),
                      Catch::Contains("threads = " + std::to_string(threads)) && Catch::Contains("1024"));
    CHECK_THROWS_AS(optimizer({{adam_config{}, {{"w", {8}}}}}, {threads, ""}), std::invalid_argument);
    CHECK_THROWS_AS(gradient_stats(const_view{g.data(), 8, dtype::f32}, {threads, ""}), std::invalid_argument);
  }
  CHECK(p == std::vector<float>(8, 0.0f));
  // The bound itself runs.
  adam_step(p.data(), m.data(), v.data(), 8, {g.data(), 8, dtype::f32}, {}, {}, 1, 1.0f, {max_threads(), ""});
  CHECK(p[0] != 0.0f);
}

TEST_CASE("step counts stop at max_step_count instead of wrapping", "[errors][optimizer]") {
  optimizer opt({{adam_config{}, {{"w", {4}}}}});
  std::vector<float> g(opt.arena_size(), 0.5f);
  CHECK_THROWS_WITH(opt.set_step_count(std::numeric_limits<std::int64_t>::max()), Catch::Contains("max_step_count"));
  CHECK_THROWS_WITH(opt.set_skipped_steps(max_step_count + 1), Catch::Contains("skipped steps"));
  opt.set_step_count(max_step_count - 1);
  const auto r = opt.step(const_view{g.data(), g.size(), dtype::f32});
  CHECK(r.step == max_step_count);
  const std::vector<float> at_limit(opt.params().begin(), opt.params().end());
  CHECK_THROWS_WITH(opt.step(const_view{g.data(), g.size(), dtype::f32}), Catch::Contains("at its limit"));
  CHECK_THROWS_WITH(opt.begin_step({}), Catch::Contains("at its limit"));
  CHECK(opt.step_count() == max_step_count);
  CHECK(std::vector<float>(opt.params().begin(), opt.params().end()) == at_limit);
  std::vector<float> p(4), m(4), v(4);
  CHECK_THROWS_WITH(adam_step(p.data(), m.data(), v.data(), 4, {g.data(), 4, dtype::f32}, {}, {}, max_step_count + 1),
                    Catch::Contains("step = "));
}
