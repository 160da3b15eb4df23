// The optimizer with compressed moments per group (8-bit, bf16 and f32 groups side by
// side): every step form, the pipeline and shards give the bits of the one-buffer steps;
// views, conversions, checkpoints (exact resume, formats recorded and refused when they
// differ) and resharding. Runs once per supported kernel (the active one).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <unistd.h>

#include "hostopt/checkpoint.hpp"
#include "temp_dir.hpp"
#include "hostopt/offload_pipeline.hpp"
#include "hostopt/sharding.hpp"
#include "compressed_test_support.hpp"

using namespace hostopt;
namespace fs = std::filesystem;

namespace {

using hostopt_test::temp_dir;

// An f32 group (embeddings, norms), an 8-bit group (matrices; one tensor of 33 elements
// ends inside a block, one is empty) and a bf16 group with Adam's L2 decay.
std::vector<param_group> model() {
  adam_config a, b;
  a.lr = 1e-2;
  a.weight_decay = 0.1;
  b.mode = adam_mode::adam;
  b.weight_decay = 0.01;
  b.lr = 3e-3;
  param_group f32{a, {{"embed", {37, 11}}, {"norm", {17}}}};
  param_group q8{a, {{"w1", {64, 9}}, {"w2", {33}}, {"empty", {0}}, {"w3", {5, 20}}}, moment_format::q8, 11};
  param_group bf{b, {{"w4", {300}}, {"bias", {3}}}, moment_format::bf16, 5};
  return {f32, q8, bf};
}

std::vector<std::uint16_t> random_bf16(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<std::uint16_t> out(n);
  for (auto& x : out) {
    const float f = g(rng) * 0.1f;
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    x = std::uint16_t(u >> 16);
  }
  return out;
}

void set_random_params(optimizer& opt, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const auto& s : opt.segments()) {
    std::vector<float> v(s.size);
    for (auto& x : v) x = u(rng);
    opt.set_params(s.name, {v.data(), v.size(), dtype::f32});
  }
}

// One tensor stepped alone through the one-buffer API: what the optimizer must give.
struct reference_tensor {
  segment seg;
  moment_format format;
  adam_config config;
  std::uint64_t seed;
  std::vector<float> p, m, v; // m, v: f32 groups
  compressed_test::packed codes;

  reference_tensor(const segment& s, const param_group& g, const float* params)
      : seg(s), format(g.moments), config(g.config), seed(g.rounding_seed), p(params, params + s.size),
        m(s.size), v(s.size), codes(format == moment_format::f32 ? moment_format::bf16 : format, s.size) {}

  void step(const std::uint16_t* grad, std::int64_t t, float scale) {
    const const_view gv{grad, seg.size, dtype::bf16};
    if (format == moment_format::f32)
      adam_step(p.data(), m.data(), v.data(), seg.size, gv, {}, config, t, scale);
    else
      adam_step(p.data(), codes.view(), seg.size, gv, {}, config, t, scale, {seed, seg.offset, 0});
  }
  compressed_test::decoded moments() {
    if (format == moment_format::f32) return {m, v};
    return compressed_test::decode(codes, seg.size);
  }
};

// The optimizer's state equals the references' bits, tensor by tensor.
void check_equals(const optimizer& opt, std::vector<reference_tensor>& refs) {
  for (auto& r : refs) {
    INFO("tensor " << r.seg.name << " (" << moment_format_name(r.format) << ")");
    std::vector<float> p(opt.params().begin() + r.seg.offset, opt.params().begin() + r.seg.offset + r.seg.size);
    CHECK(compressed_test::same_bits(p, r.p));
    std::vector<float> m(r.seg.size), v(r.seg.size);
    opt.read_moments(r.seg.name, m, v);
    const auto want = r.moments();
    CHECK(compressed_test::same_bits(m, want.m));
    CHECK(compressed_test::same_bits(v, want.v));
  }
}

// Same params and moments (decoded) in every tensor.
bool same_state(const optimizer& a, const optimizer& b) {
  if (a.arena_size() != b.arena_size()) return false;
  if (std::memcmp(a.params().data(), b.params().data(), a.arena_size() * 4) != 0) return false;
  for (const auto& s : a.segments()) {
    std::vector<float> ma(s.size), va(s.size), mb(s.size), vb(s.size);
    a.read_moments(s.name, ma, va);
    b.read_moments(s.name, mb, vb);
    if (!compressed_test::same_bits(ma, mb) || !compressed_test::same_bits(va, vb)) return false;
  }
  return true;
}

// A flat bf16 gradient of the layout: random on tensor elements, NaN in the padding
// (which must never be read).
std::vector<std::uint16_t> flat_grad(const optimizer& opt, std::mt19937& rng) {
  std::vector<std::uint16_t> g(opt.arena_size(), 0x7fc0);
  for (const auto& s : opt.segments()) {
    const auto t = random_bf16(s.size, rng);
    std::copy(t.begin(), t.end(), g.begin() + s.offset);
  }
  return g;
}

} // namespace

TEST_CASE("8-bit tensors start on a block, and state bytes count each group's format", "[compressed][optimizer]") {
  const optimizer opt(model(), {1, ""});
  for (const auto& s : opt.segments())
    if (s.group == 1) CHECK(s.offset % q8_block == 0);
  CHECK(opt.group_moments(0) == moment_format::f32);
  CHECK(opt.group_moments(1) == moment_format::q8);
  CHECK(opt.group_moments(2) == moment_format::bf16);
  CHECK(opt.group_rounding_seed(1) == 11);
  CHECK(opt.chunk_unit() == 32);
  CHECK(optimizer({{adam_config{}, {{"x", {40}}}}}).chunk_unit() == 16);

  // One large group of each format: bytes per parameter with the f32 master.
  for (const auto& [format, per_param] : {std::pair{moment_format::f32, 12.0}, std::pair{moment_format::bf16, 8.0},
                                          std::pair{moment_format::q8, 6.0625}}) {
    const optimizer one({{adam_config{}, {{"w", {256, 64}}}, format}}, {1, ""});
    CHECK(double(one.state_bytes()) / double(one.num_params()) == per_param);
  }
}

TEST_CASE("every step form gives each tensor the bits of the one-buffer step in its format", "[compressed][optimizer]") {
  const auto groups = model();
  for (const int threads : {1, 2}) {
    INFO(threads << " threads");
    std::mt19937 rng(3);
    optimizer flat(groups, {threads, ""}), per_tensor(groups, {threads, ""}), chunked(groups, {threads, ""});
    set_random_params(flat, rng);
    std::memcpy(per_tensor.params().data(), flat.params().data(), flat.arena_size() * 4);
    std::memcpy(chunked.params().data(), flat.params().data(), flat.arena_size() * 4);
    std::vector<reference_tensor> refs;
    for (const auto& s : flat.segments()) refs.emplace_back(s, groups[s.group], flat.params().data() + s.offset);

    for (std::int64_t t = 1; t <= 12; ++t) {
      INFO("step " << t);
      const auto g = flat_grad(flat, rng);
      const float scale = t % 3 ? 1.0f : 0.5f;
      std::vector<std::uint16_t> out(flat.arena_size());
      flat.step({g.data(), g.size(), dtype::bf16}, {out.data(), out.size(), dtype::bf16}, scale);
      std::vector<const_view> views;
      for (const auto& s : flat.segments()) views.push_back({g.data() + s.offset, s.size, dtype::bf16});
      per_tensor.step(views, {}, scale);
      chunk_step_options co;
      co.grad_type = dtype::bf16;
      co.checks.grad_scale = scale;
      REQUIRE(chunked.begin_step(co).applied);
      for (std::size_t b = 0; b < chunked.arena_size(); b += 64)
        chunked.update_range(b, std::min(b + 64, chunked.arena_size()), g.data() + b);
      chunked.finish_step();
      for (auto& r : refs) r.step(g.data() + r.seg.offset, t, scale);
      // The copy-out is the new master rounded to bf16.
      for (const auto& r : refs)
        for (std::size_t i = 0; i < r.seg.size; ++i) {
          float f;
          const std::uint32_t u = std::uint32_t(out[r.seg.offset + i]) << 16;
          std::memcpy(&f, &u, 4);
          REQUIRE(std::abs(f - r.p[i]) <= std::abs(r.p[i]) * 0x1p-8f);
        }
    }
    check_equals(flat, refs);
    CHECK(same_state(flat, per_tensor));
    CHECK(same_state(flat, chunked));
  }
}

TEST_CASE("a tensor without a gradient keeps its compressed moments and its own step count", "[compressed][optimizer]") {
  const auto groups = model();
  std::mt19937 rng(8);
  optimizer opt(groups, {1, ""});
  set_random_params(opt, rng);
  std::vector<reference_tensor> refs;
  for (const auto& s : opt.segments()) refs.emplace_back(s, groups[s.group], opt.params().data() + s.offset);
  std::vector<std::int64_t> own(refs.size(), 0);
  for (int step = 0; step < 6; ++step) {
    const auto g = flat_grad(opt, rng);
    std::vector<const_view> views;
    for (std::size_t i = 0; i < refs.size(); ++i) {
      const bool skip = (refs[i].seg.name == "w2" && step < 3) || (refs[i].seg.name == "w4" && step % 2);
      views.push_back(skip ? const_view{} : const_view{g.data() + refs[i].seg.offset, refs[i].seg.size, dtype::bf16});
      if (!skip) refs[i].step(g.data() + refs[i].seg.offset, ++own[i], 1.0f);
    }
    opt.step(views);
  }
  check_equals(opt, refs);
}

TEST_CASE("moments of compressed groups are read and written as f32 through explicit conversions", "[compressed][optimizer]") {
  optimizer opt(model(), {1, ""});
  CHECK_THROWS_WITH(opt.exp_avg(), Catch::Contains("group 1 stores its moments as 8bit") &&
                                       Catch::Contains("read_moments"));
  CHECK_THROWS_AS(opt.exp_avg_sq(), std::logic_error);
  CHECK(opt.params().size() == opt.arena_size());
  CHECK_THROWS_WITH(opt.exp_avg("w1"), Catch::Contains("exp_avg('w1')") && Catch::Contains("8bit"));
  CHECK_THROWS_WITH(opt.exp_avg_sq("w4"), Catch::Contains("bf16"));

  // An f32 group's tensor has views, which read_moments agrees with.
  auto view = opt.exp_avg("norm");
  REQUIRE(view.size() == 17);
  for (std::size_t i = 0; i < view.size(); ++i) view[i] = float(i) - 8.0f;
  std::vector<float> m(17), v(17);
  opt.read_moments("norm", m, v);
  CHECK(m[3] == -5.0f);

  // bf16-representable values survive the conversion exactly; others are rounded to a
  // neighbour (stochastically); 8-bit values decode to what encode_moments gives.
  std::vector<float> m4(300), v4(300);
  for (std::size_t i = 0; i < 300; ++i) {
    m4[i] = float(int(i) - 150) * 0.25f; // at most 8 significant bits: bf16 values
    v4[i] = float(i % 128) * 0.5f;
  }
  opt.write_moments("w4", m4, v4);
  std::vector<float> back_m(300), back_v(300);
  opt.read_moments("w4", back_m, back_v);
  CHECK(compressed_test::same_bits(back_m, m4));
  CHECK(compressed_test::same_bits(back_v, v4));

  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> m2(33), v2(33);
  for (std::size_t i = 0; i < 33; ++i) {
    m2[i] = nd(rng) * 1e-3f;
    v2[i] = m2[i] * m2[i];
  }
  opt.write_moments("w2", m2, v2);
  compressed_test::packed want(moment_format::q8, 33);
  encode_moments(m2.data(), v2.data(), want.view(), 33, {11, opt.tensor("w2").offset, 0});
  const auto want_f32 = compressed_test::decode(want, 33);
  std::vector<float> got_m(33), got_v(33);
  opt.read_moments("w2", got_m, got_v);
  CHECK(compressed_test::same_bits(got_m, want_f32.m));
  CHECK(compressed_test::same_bits(got_v, want_f32.v));

  // Bad input: named, nothing written.
  v2[7] = -1.0f;
  CHECK_THROWS_WITH(opt.write_moments("w2", m2, v2), Catch::Contains("negative"));
  opt.read_moments("w2", got_m, got_v);
  CHECK(compressed_test::same_bits(got_m, want_f32.m));
  CHECK_THROWS_WITH(opt.write_moments("w2", std::span<const float>(m2).first(32), v2),
                    Catch::Contains("write_moments('w2')") && Catch::Contains("expected 33"));
  CHECK_THROWS_WITH(opt.read_moments("nope", got_m, got_v), Catch::Contains("'nope'"));
}

TEST_CASE("bad compressed layouts and chunks are refused with their reason", "[compressed][optimizer][errors]") {
  param_group bad{adam_config{}, {{"x", {10}}}};
  bad.moments = static_cast<moment_format>(7);
  CHECK_THROWS_WITH(optimizer({bad}), Catch::Contains("groups[0].moments") && Catch::Contains("value 7"));
  CHECK_THROWS_WITH(optimizer(model(), arena_range{0, 48}), Catch::Contains("multiples of 32") &&
                                                                Catch::Contains("8-bit"));
  CHECK_NOTHROW(optimizer({{adam_config{}, {{"x", {100}}}}}, arena_range{0, 48})); // no 8-bit group: 16 is fine

  optimizer opt(model(), {1, ""});
  std::vector<std::uint16_t> g(opt.arena_size(), 0);
  chunk_step_options co;
  co.grad_type = dtype::bf16;
  opt.begin_step(co);
  CHECK_THROWS_WITH(opt.update_range(0, 48, g.data()), Catch::Contains("multiple of 32"));
  opt.update_range(0, 64, g.data());
  opt.abort_step();
  CHECK_FALSE(opt.usable());
}

TEST_CASE("the pipeline chunks on blocks and gives the synchronous step's bits", "[compressed][optimizer][pipeline]") {
  const auto groups = model();
  std::mt19937 rng(4);
  optimizer piped(groups, {2, ""}), sync(groups, {1, ""});
  set_random_params(piped, rng);
  std::memcpy(sync.params().data(), piped.params().data(), piped.arena_size() * 4);
  auto engine = make_host_copy_engine();
  const device_order ready = device_order::after(engine->create_stream());
  pipeline_options po;
  po.chunk_elems = 100; // rounded up to 128: whole blocks
  po.grad_type = dtype::bf16;
  po.param_type = dtype::bf16;
  offload_pipeline pipe(piped, *engine, po);
  CHECK(pipe.chunk_elems() == 128);
  const std::size_t n = piped.arena_size();
  void* dgrad = engine->allocate_device(n * 2);
  void* dparams = engine->allocate_device(n * 2);
  std::vector<std::uint16_t> out(n);
  for (int step = 0; step < 4; ++step) {
    const auto g = flat_grad(piped, rng);
    std::memcpy(dgrad, g.data(), n * 2);
    CHECK(pipe.step({dgrad, n, dtype::bf16}, {dparams, n, dtype::bf16}, ready).applied);
    sync.step({g.data(), n, dtype::bf16}, {out.data(), n, dtype::bf16});
    REQUIRE(same_state(piped, sync));
    for (const auto& s : sync.segments())
      CHECK(std::memcmp(static_cast<char*>(dparams) + 2 * s.offset, out.data() + s.offset, 2 * s.size) == 0);
  }
  engine->free_device(dgrad);
  engine->free_device(dparams);
}

TEST_CASE("a checkpoint records each group's format and seed and resumes bit for bit", "[compressed][optimizer][checkpoint]") {
  const temp_dir dir("compressed_ckpt");
  const std::string path = (dir.path / "state.safetensors").string();
  std::mt19937 rng(6);
  optimizer run(model(), {2, ""});
  set_random_params(run, rng);
  for (int i = 0; i < 3; ++i) {
    const auto g = flat_grad(run, rng);
    run.step({g.data(), g.size(), dtype::bf16});
  }
  save_checkpoint(run, path);

  auto other_seeds = model();
  for (auto& g : other_seeds) g.rounding_seed += 100; // the file's seeds are restored
  optimizer resumed(other_seeds, {1, ""});
  load_checkpoint(resumed, path);
  CHECK(resumed.group_rounding_seed(1) == 11);
  CHECK(resumed.step_count() == 3);
  REQUIRE(same_state(run, resumed));
  for (int i = 0; i < 3; ++i) {
    const auto g = flat_grad(run, rng);
    run.step({g.data(), g.size(), dtype::bf16});
    resumed.step({g.data(), g.size(), dtype::bf16});
  }
  CHECK(same_state(run, resumed));

  // A different format is refused, naming the group and the way to convert; nothing changes.
  for (const moment_format f : {moment_format::f32, moment_format::bf16}) {
    auto groups = model();
    groups[1].moments = f;
    optimizer wrong(groups, {1, ""});
    const std::vector<float> before(wrong.params().begin(), wrong.params().end());
    CHECK_THROWS_WITH(load_checkpoint(wrong, path), Catch::Contains("group 1 stores its moments as 8bit") &&
                                                        Catch::Contains(std::string(moment_format_name(f))) &&
                                                        Catch::Contains("never converts"));
    CHECK(std::equal(before.begin(), before.end(), wrong.params().begin()));
    CHECK(wrong.step_count() == 0);
  }
  // And the other way: an all-f32 file into an optimizer with compressed groups.
  const std::string f32_path = (dir.path / "f32.safetensors").string();
  auto plain = model();
  for (auto& g : plain) g.moments = moment_format::f32;
  save_checkpoint(optimizer(plain, {1, ""}), f32_path);
  CHECK_THROWS_WITH(load_checkpoint(resumed, f32_path), Catch::Contains("stores its moments as f32"));
  CHECK(resumed.step_count() == 6);

  // The explicit conversion: read f32 moments from one optimizer, write them to another.
  optimizer as_f32(plain, {1, ""});
  for (const auto& s : resumed.segments()) {
    std::vector<float> m(s.size), v(s.size);
    resumed.read_moments(s.name, m, v);
    as_f32.write_moments(s.name, m, v);
  }
  std::vector<float> m(576), v(576);
  resumed.read_moments("w1", m, v);
  const auto view = as_f32.exp_avg_sq("w1");
  CHECK(compressed_test::same_bits(std::vector<float>(view.begin(), view.end()), v));
}

TEST_CASE("shards of a compressed model cut no block, step as the whole model and reshard", "[compressed][optimizer][sharding]") {
  const auto groups = model();
  const temp_dir dir("compressed_shards");
  std::mt19937 rng(9);
  optimizer whole(groups, {1, ""});
  set_random_params(whole, rng);
  const std::size_t n = whole.arena_size();
  auto make_world = [&](int world) {
    std::vector<sharded_optimizer> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.emplace_back(groups, world, r, execution_options{1, ""});
      CHECK(ranks.back().shard().begin % q8_block == 0);
      for (const auto& s : whole.segments())
        ranks.back().set_params(s.name, std::span<const float>(whole.params().data() + s.offset, s.size));
    }
    return ranks;
  };
  auto three = make_world(3);
  auto step_all = [&](std::vector<sharded_optimizer>& ranks, const std::vector<std::uint16_t>& g) {
    std::vector<std::uint16_t> params(n);
    for (auto& r : ranks) {
      const shard_range s = r.shard();
      r.step({g.data() + s.begin, s.size(), dtype::bf16}, {params.data() + s.begin, s.size(), dtype::bf16},
             step_options{1.0f, 0.0, false, -1.0});
    }
    return params;
  };
  // Steps the whole model and a world; the gathered copy-out is the whole model's.
  auto step_both = [&](std::vector<sharded_optimizer>& ranks, int steps) {
    std::vector<std::uint16_t> out(n);
    for (int i = 0; i < steps; ++i) {
      const auto g = flat_grad(whole, rng);
      whole.step({g.data(), n, dtype::bf16}, {out.data(), n, dtype::bf16});
      const auto gathered = step_all(ranks, g);
      for (const auto& s : whole.segments())
        CHECK(std::memcmp(gathered.data() + s.offset, out.data() + s.offset, 2 * s.size) == 0);
    }
  };
  step_both(three, 3);
  for (auto& r : three) r.save(dir.path.string(), "s3");
  three.front().commit_save(dir.path.string(), "s3");
  auto two = make_world(2);
  for (auto& r : two) r.load(dir.path.string());
  step_both(two, 2);
  // Gathered into one rank, the shards' moments are the whole model's.
  for (auto& r : two) r.save(dir.path.string(), "s2");
  two.front().commit_save(dir.path.string(), "s2");
  auto one = make_world(1);
  one.front().load(dir.path.string());
  CHECK(same_state(one.front().local(), whole));
}

TEST_CASE("a checkpoint whose 8-bit exponent bytes the encoder never writes is refused, nothing changed",
          "[compressed][optimizer][checkpoint][errors]") {
  const temp_dir dir("compressed_bad_bases");
  std::mt19937 rng(8);
  optimizer run(model(), {1, ""});
  set_random_params(run, rng);
  const auto g = flat_grad(run, rng);
  run.step({g.data(), g.size(), dtype::bf16});

  // A NaN block (255, both moments) is something the encoder writes: it saves and loads.
  const std::string poisoned = (dir.path / "poisoned.safetensors").string();
  std::uint8_t* w1 = run.moment_codes("w1").scales;
  const std::uint8_t keep[2] = {w1[2], w1[3]};
  w1[2] = w1[3] = 255;
  save_checkpoint(run, poisoned);
  optimizer takes_nan(model(), {1, ""});
  load_checkpoint(takes_nan, poisoned);
  std::vector<float> m(576), v(576);
  takes_nan.read_moments("w1", m, v);
  CHECK(std::isnan(m[32]));
  CHECK(std::isnan(v[63]));
  CHECK(!std::isnan(m[31]));

  // So are the largest bases (m 239, v 223): loaded as they are, decoding to finite values.
  const std::string largest = (dir.path / "largest.safetensors").string();
  w1[2] = 239;
  w1[3] = 223;
  save_checkpoint(run, largest);
  optimizer takes_largest(model(), {1, ""});
  load_checkpoint(takes_largest, largest);
  CHECK(takes_largest.moment_codes("w1").scales[2] == 239);
  CHECK(takes_largest.moment_codes("w1").scales[3] == 223);
  takes_largest.read_moments("w1", m, v);
  CHECK(std::all_of(m.begin(), m.end(), [](float x) { return std::isfinite(x); }));

  // Bytes above the largest base (m 239, v 223) but not 255: a file with a valid checksum
  // (save_checkpoint writes it) is still refused, naming tensor, block, moment and byte.
  struct bad_byte {
    const char* tensor;
    std::size_t at;
    std::uint8_t value;
    const char* message;
  };
  for (const bad_byte b : {bad_byte{"w1", 2, 240, "tensor 'w1' moment_scales block 1: exp_avg exponent byte 240"},
                           bad_byte{"w3", 1, 224, "tensor 'w3' moment_scales block 0: exp_avg_sq exponent byte 224"},
                           bad_byte{"w2", 3, 254, "tensor 'w2' moment_scales block 1: exp_avg_sq exponent byte 254"}}) {
    w1[2] = keep[0];
    w1[3] = keep[1];
    std::uint8_t* s = run.moment_codes(b.tensor).scales;
    const std::uint8_t was = s[b.at];
    s[b.at] = b.value;
    const std::string path = (dir.path / (std::string(b.tensor) + ".safetensors")).string();
    save_checkpoint(run, path);
    s[b.at] = was;

    optimizer target(model(), {1, ""});
    set_random_params(target, rng);
    const std::vector<float> before(target.params().begin(), target.params().end());
    CHECK_THROWS_WITH(load_checkpoint(target, path), Catch::Contains(b.message) && Catch::Contains("never writes"));
    CHECK(std::equal(before.begin(), before.end(), target.params().begin()));
    CHECK(target.step_count() == 0);
    std::vector<float> tm(target.tensor(b.tensor).size), tv(tm.size());
    target.read_moments(b.tensor, tm, tv);
    CHECK(std::all_of(tm.begin(), tm.end(), [](float x) { return x == 0.0f; }));
  }
}

namespace {

// What one step reports for its 8-bit blocks.
struct counts {
  std::uint64_t poisoned, saturated;
  bool operator==(const counts& o) const { return poisoned == o.poisoned && saturated == o.saturated; }
};
counts counts_of(const step_result& r) { return {r.poisoned_blocks, r.saturated_blocks}; }
std::ostream& operator<<(std::ostream& os, const counts& c) {
  return os << "{poisoned " << c.poisoned << ", saturated " << c.saturated << "}";
}

// An 8-bit tensor of 4 blocks and one of 40 elements (its second block ends early), an
// f32 and a bf16 tensor: only 8-bit blocks are ever counted.
std::vector<param_group> counted_model() {
  const adam_config c;
  return {{c, {{"w", {4, 32}}, {"tail", {40}}}, moment_format::q8, 3},
          {c, {{"f", {64}}}},
          {c, {{"b", {64}}}, moment_format::bf16, 4}};
}

} // namespace

TEST_CASE("8-bit steps count poisoned and saturated blocks, alike on every kernel, thread count and step form",
          "[compressed][optimizer][block_counts]") {
  const auto groups = counted_model();
  const optimizer layout(groups);
  const auto at = [&](const char* name, std::size_t i) { return layout.tensor(name).offset + i; };
  // Steps 1-2: ordinary gradients. 3: 8e18 in w's block 1 and in tail's second block, and
  // in the f32 and bf16 tensors (a norm of 1.6e19, below sqrt(FLT_MAX): the check passes it).
  // 4: ordinary again: the neighbours' v sit on their blocks' smallest code, still below
  // it after decaying: still saturated. 5 (unchecked): a NaN in w's block 2, in f and b.
  // 6: ordinary: block 2 stays NaN. 7 (unchecked): 1e20 in w's block 3: g*g overflows, v
  // is infinite and clamps at the top code (and block 3's neighbours sit at the floor).
  const std::vector<counts> want = {{0, 0}, {0, 0}, {0, 2}, {0, 2}, {1, 2}, {1, 2}, {1, 3}};
  for (const auto& kernel : ref::supported_kernels())
    for (const int threads : {1, 2}) {
      INFO(kernel << ", " << threads << " threads");
      optimizer flat(groups, {threads, kernel}), per_tensor(groups, {threads, kernel}),
          chunked(groups, {threads, kernel});
      const std::size_t n = flat.arena_size();
      for (std::size_t s = 0; s < want.size(); ++s) {
        INFO("step " << s + 1);
        std::vector<float> g(n, 0.0f);
        for (const auto& seg : flat.segments())
          for (std::size_t i = 0; i < seg.size; ++i) g[seg.offset + i] = 0.01f * float(1 + (i % 7));
        if (s == 2)
          for (const std::size_t i : {at("w", 40), at("tail", 35), at("f", 3), at("b", 3)}) g[i] = 8e18f;
        if (s == 4)
          for (const std::size_t i : {at("w", 70), at("f", 5), at("b", 5)}) g[i] = std::nanf("");
        if (s == 6) g[at("w", 100)] = 1e20f;
        step_options o; // checked (the default), except where a step must get through
        o.skip_nonfinite = s != 4 && s != 6;
        const step_result r = flat.step({g.data(), n, dtype::f32}, {}, o);
        REQUIRE(r.applied);
        CHECK(counts_of(r) == want[s]);
        std::vector<const_view> views;
        for (const auto& seg : flat.segments()) views.push_back({g.data() + seg.offset, seg.size, dtype::f32});
        CHECK(counts_of(per_tensor.step(views, {}, o)) == want[s]);
        chunk_step_options co;
        co.checks = ref::trusting();
        REQUIRE(chunked.begin_step(co).applied);
        for (std::size_t b = 0; b < n; b += 64) chunked.update_range(b, std::min(b + 64, n), g.data() + b);
        CHECK(counts_of(chunked.finish_step()) == want[s]);
      }
      // What the counts say is what the state holds: w's block 2 is NaN, its others finite.
      std::vector<float> m(128), v(128);
      flat.read_moments("w", m, v);
      CHECK(std::isnan(m[64]));
      CHECK(std::isnan(v[95]));
      CHECK(std::isfinite(m[63]));
      CHECK(std::isfinite(v[96]));
      CHECK(v[100] > 1e38f); // the infinite v, clamped at the top code
    }
}

TEST_CASE("a saturated block is one where an element with a gradient had its v raised to the block's floor",
          "[compressed][optimizer][block_counts]") {
  adam_config c;
  c.lr = 1e-3;
  for (const auto& kernel : ref::supported_kernels()) {
    INFO(kernel);
    // One block: v = 1 at element 0, 1e-20 at element 1 (2^-66 of it: far below the floor,
    // the smallest code is ~2^-33 of the largest v).
    std::vector<float> m0(32, 0.0f), v0(32, 1e-6f);
    v0[0] = 1.0f;
    v0[1] = 1e-20f;
    for (const bool element_1_has_gradient : {false, true}) {
      INFO("element 1 has a gradient: " << element_1_has_gradient);
      optimizer opt({{c, {{"w", {32}}}, moment_format::q8, 1}}, {1, kernel});
      opt.write_moments("w", m0, v0);
      std::vector<float> g(32, 1e-3f);
      g[0] = 1.0f;
      g[1] = element_1_has_gradient ? 1e-14f : 0.0f; // its v stays ~1e-20 either way
      const step_result r = opt.step({g.data(), 32, dtype::f32}, {}, step_options{});
      REQUIRE(r.applied);
      CHECK(r.poisoned_blocks == 0);
      // An element without a gradient (pruned, unused, its v decaying) is not a freeze.
      CHECK(r.saturated_blocks == (element_1_has_gradient ? 1u : 0u));
    }
    // Ordinary ranges (here 1e3 between gradients: 1e6 in v) count nothing.
    optimizer ok({{c, {{"w", {32}}}, moment_format::q8, 1}}, {1, kernel});
    std::vector<float> g(32, 1e-3f);
    g[0] = 1.0f;
    for (int t = 0; t < 3; ++t) {
      const step_result r = ok.step({g.data(), 32, dtype::f32}, {}, step_options{});
      CHECK(r.poisoned_blocks == 0);
      CHECK(r.saturated_blocks == 0);
    }
  }
}

TEST_CASE("a skipped step counts no block, the default check keeps a NaN gradient out of an 8-bit block",
          "[compressed][optimizer][block_counts]") {
  const adam_config c;
  optimizer opt({{c, {{"w", {64}}}, moment_format::q8, 1}}, {1, ""});
  std::vector<float> g(64, 0.01f);
  g[3] = std::nanf("");
  const step_result r = opt.step({g.data(), 64, dtype::f32}, {}, step_options{});
  CHECK_FALSE(r.applied);
  CHECK(r.skipped_steps == 1);
  CHECK(r.poisoned_blocks == 0);
  CHECK(r.saturated_blocks == 0);
  std::vector<float> m(64), v(64);
  opt.read_moments("w", m, v);
  CHECK(std::all_of(m.begin(), m.end(), [](float x) { return x == 0.0f; }));
}
