// ZeRO-style sharding, simulated in one process: every rank's shard stepped on its slice
// of the summed gradients, parameters gathered, compared bit for bit with the
// single-process optimizer; sharded checkpoints re-sharded across world sizes.
#include <catch2/catch.hpp>

#include <filesystem>

#include "reference.hpp"

using namespace hostopt;
namespace fs = std::filesystem;

namespace {

std::vector<param_group> model() {
  adam_config a, b;
  a.lr = 1e-2;
  a.weight_decay = 0.1;
  b.mode = adam_mode::adam;
  b.weight_decay = 0.01;
  return {{a, {{"embed", {37, 11}}, {"w1", {64, 3}}, {"tiny", {1}}}},
          {b, {{"bias", {17}}, {"empty", {0}}, {"w2", {300}}}},
          {adam_config{}, {}}};
}

// Steps every rank of a world on the same full gradients; returns the gathered params.
std::vector<float> step_world(std::vector<sharded_optimizer>& ranks, const std::vector<float>& grad, double norm) {
  std::vector<float> params(ranks.front().arena_size(), -1.0f);
  step_options o;
  o.known_grad_norm = norm;
  o.max_grad_norm = 5.0;
  for (auto& r : ranks) {
    const shard_range s = r.shard();
    r.step({grad.data() + s.begin, s.end - s.begin, dtype::f32}, {params.data() + s.begin, s.end - s.begin, dtype::f32},
           o);
  }
  return params;
}

std::vector<sharded_optimizer> make_world(int world) {
  std::vector<sharded_optimizer> ranks;
  for (int r = 0; r < world; ++r) ranks.emplace_back(model(), world, r, execution_options{1, ""});
  return ranks;
}

} // namespace

TEST_CASE("shards are contiguous, aligned, balanced and cover the arena", "[sharding]") {
  for (std::size_t n : {std::size_t(0), std::size_t(16), std::size_t(1000), std::size_t(4096)})
    for (int w : {1, 2, 3, 7}) {
      std::size_t expected = 0, smallest = SIZE_MAX, largest = 0;
      for (int r = 0; r < w; ++r) {
        const shard_range s = shard_of(n, w, r);
        CHECK(s.begin == expected);
        CHECK((s.begin % 16 == 0 || s.begin == n));
        expected = s.end;
        smallest = std::min(smallest, s.end - s.begin);
        largest = std::max(largest, s.end - s.begin);
      }
      CHECK(expected == n);
      CHECK(largest - smallest <= 16);
    }
  CHECK_THROWS_WITH(shard_of(100, 0, 0), Catch::Contains("world_size = 0"));
  CHECK_THROWS_WITH(shard_of(100, 2, 2), Catch::Contains("rank = 2"));
}

TEST_CASE("sharded steps are bit-identical to the single-process optimizer for 1, 2, 3 and 5 ranks", "[sharding]") {
  std::mt19937 rng(6);
  optimizer single(model());
  const std::size_t n = single.arena_size();
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> init;
  for (const auto& s : single.segments()) {
    std::vector<float> v(s.size);
    for (auto& x : v) x = nd(rng);
    single.set_params(s.name, {v.data(), v.size(), dtype::f32});
    init.push_back(v);
  }
  std::vector<std::vector<sharded_optimizer>> worlds;
  for (int w : {1, 2, 3, 5}) {
    worlds.push_back(make_world(w));
    for (auto& r : worlds.back())
      for (std::size_t i = 0; i < init.size(); ++i) r.set_params(single.segments()[i].name, init[i]);
    std::size_t held = 0;
    for (auto& r : worlds.back()) held += r.local().state_bytes();
    CHECK(held >= 12 * n); // each rank holds only its share (plus alignment)
    CHECK(worlds.back().front().local().state_bytes() <= 12 * (n / std::size_t(w) + 32));
  }
  std::vector<float> out(n, -1.0f);
  for (int t = 0; t < 10; ++t) {
    const auto g = ref::random_grad(dtype::f32, n, rng, 2.0f);
    const double norm = gradient_stats(g.view()).norm;
    step_options o;
    o.known_grad_norm = norm;
    o.max_grad_norm = 5.0;
    single.step(g.view(), {out.data(), n, dtype::f32}, o);
    for (auto& world : worlds) {
      const auto gathered = step_world(world, g.f32, norm);
      for (const auto& s : single.segments()) {
        INFO("world " << world.size() << " step " << t << " tensor " << s.name);
        CHECK(std::memcmp(gathered.data() + s.offset, out.data() + s.offset, s.size * 4) == 0);
      }
    }
  }
  // Clipping across ranks: the all-reduced sum of shard sums is the global norm.
  const auto g = ref::random_grad(dtype::f32, n, rng);
  double total = 0;
  for (auto& r : worlds[2]) {
    const shard_range s = r.shard();
    total += r.shard_stats({g.f32.data() + s.begin, s.end - s.begin, dtype::f32}).sum_squares;
  }
  std::vector<const_view> tensors;
  for (const auto& s : single.segments()) tensors.push_back(g.view(s.offset, s.size));
  CHECK(std::sqrt(total) == Approx(gradient_stats(tensors).norm).epsilon(1e-12));
}

TEST_CASE("save with 2 ranks, load with 3 and with 1: training continues bit-identically", "[sharding][checkpoint]") {
  const fs::path dir = fs::temp_directory_path() / ("hostopt_shard_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::mt19937 rng(8);
  auto two = make_world(2);
  const std::size_t n = two.front().arena_size();
  std::vector<std::vector<float>> grads;
  for (int t = 0; t < 8; ++t) grads.push_back(ref::random_grad(dtype::f32, n, rng).f32);
  for (int t = 0; t < 4; ++t) step_world(two, grads[t], 1.0);
  for (auto& r : two) r.save(dir.string(), "step-4");
  two.front().commit_save(dir.string(), "step-4");
  std::vector<float> straight;
  for (int t = 4; t < 8; ++t) straight = step_world(two, grads[t], 1.0);
  for (int w : {3, 1}) {
    auto world = make_world(w);
    for (auto& r : world) r.load(dir.string());
    CHECK(world.front().local().step_count() == 4);
    std::vector<float> resumed;
    for (int t = 4; t < 8; ++t) resumed = step_world(world, grads[t], 1.0);
    for (const auto& s : world.front().segments()) {
      INFO("world " << w << " tensor " << s.name);
      CHECK(std::memcmp(resumed.data() + s.offset, straight.data() + s.offset, s.size * 4) == 0);
    }
  }
  // One shard file alone does not cover a whole optimizer: refused, not half-loaded.
  optimizer whole(model());
  CHECK_THROWS_WITH(load_checkpoint(whole, (dir / "shard-1-of-2.step-4.safetensors").string()),
                    Catch::Contains("hold no state for arena elements"));
  CHECK(whole.step_count() == 0);
  fs::remove(dir / "index.json");
  auto world = make_world(2);
  CHECK_THROWS_WITH(world.front().load(dir.string()), Catch::Contains("index.json") && Catch::Contains("No such file"));
  CHECK_THROWS_WITH(world.front().save(dir.string(), "../x"), Catch::Contains("save_id '../x'"));
  // The committed save's id is never written over (a crash would then leave no whole save).
  two.front().commit_save(dir.string(), "step-4");
  CHECK_THROWS_WITH(two.back().save(dir.string(), "step-4"), Catch::Contains("is the committed save"));
  CHECK_THROWS_WITH(world.back().commit_save(dir.string(), "step-4"), Catch::Contains("rank 0"));
  fs::remove_all(dir);
}

TEST_CASE("shard files of different saves are never loaded together", "[sharding][checkpoint]") {
  const fs::path base = fs::temp_directory_path() / ("hostopt_shard_mix_" + std::to_string(::getpid()));
  const fs::path dir = base / "ckpt";
  fs::create_directories(dir);
  std::mt19937 rng(9);
  auto late = make_world(2), early = make_world(2);
  const std::size_t n = late.front().arena_size();
  step_world(early, ref::random_grad(dtype::f32, n, rng).f32, 1.0);
  for (auto& r : early) r.save(dir.string(), "run1");
  early.front().commit_save(dir.string(), "run1");
  for (int t = 0; t < 3; ++t) step_world(late, ref::random_grad(dtype::f32, n, rng).f32, 1.0);
  // A save that crashed after rank 0 wrote its shard: the committed save stays current and whole.
  late.front().save(dir.string(), "run2");
  CHECK_THROWS_WITH(late.front().commit_save(dir.string(), "run2"), Catch::Contains("shard-1-of-2.run2"));
  for (int w : {1, 2, 3}) {
    auto world = make_world(w);
    for (auto& r : world) r.load(dir.string());
    CHECK(world.back().local().step_count() == 1);
  }
  // A shard of another save (or step) under this save's name: refused for every world size.
  fs::copy_file(dir / "shard-0-of-2.run2.safetensors", dir / "shard-0-of-2.run1.safetensors",
                fs::copy_options::overwrite_existing);
  for (int w : {1, 2, 3}) {
    auto world = make_world(w);
    const auto before = std::vector<float>(world.front().local().params().begin(), world.front().local().params().end());
    INFO("world " << w);
    CHECK_THROWS_WITH(world.front().load(dir.string()),
                      Catch::Contains("shard-0-of-2.run1") && Catch::Contains("expected \"run1\""));
    CHECK(world.front().local().step_count() == 0);
    CHECK(std::vector<float>(world.front().local().params().begin(), world.front().local().params().end()) == before);
  }
  // A completed save replaces it; commit removes the other saves' shard files.
  late.back().save(dir.string(), "run2");
  late.front().commit_save(dir.string(), "run2");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"index.json", "shard-0-of-2.run2.safetensors", "shard-1-of-2.run2.safetensors"});
  auto world = make_world(3);
  for (auto& r : world) r.load(dir.string());
  CHECK(world.front().local().step_count() == 3);
  fs::remove_all(base);
}

TEST_CASE("global decisions are global: a NaN on one rank makes every rank skip; clipping uses the global norm",
          "[sharding][stats]") {
  std::mt19937 rng(10);
  for (int w : {2, 3}) {
    INFO("world " << w);
    auto world = make_world(w);
    optimizer single(model());
    const std::size_t n = single.arena_size();
    auto g = ref::random_grad(dtype::f32, n, rng, 40.0f);
    // Without a global norm a checked (default) or clipping step is refused on every rank,
    // through the sharded optimizer or its shard's optimizer directly.
    for (auto& r : world) {
      const shard_range s = r.shard();
      CHECK_THROWS_WITH(r.step({g.f32.data() + s.begin, s.size(), dtype::f32}, {}, step_options{}),
                        Catch::Contains("need the global gradient norm"));
      step_options clipping;
      clipping.skip_nonfinite = false;
      clipping.max_grad_norm = 1.0;
      CHECK_THROWS_WITH(r.local().step({g.f32.data() + s.begin, s.size(), dtype::f32}, {}, clipping),
                        Catch::Contains("holds a range of the arena"));
      CHECK(r.local().step_count() == 0);
    }
    // The reduction every rank calls: here, in one process, the precomputed sum of all shards.
    auto reduce_all = [&](const std::vector<float>& grad) {
      double total = 0;
      for (auto& r : world) {
        const shard_range s = r.shard();
        total += r.shard_stats({grad.data() + s.begin, s.size(), dtype::f32}).sum_squares;
      }
      for (auto& r : world) r.set_norm_reduction([total](double) { return total; });
      return total;
    };
    step_options clip;
    clip.max_grad_norm = 5.0;
    // A clipped step: every rank scales by the global norm's factor.
    const double total = reduce_all(g.f32);
    std::vector<float> gathered(n, -1.0f), out(n, -1.0f);
    for (auto& r : world) {
      const shard_range s = r.shard();
      const auto res = r.step({g.f32.data() + s.begin, s.size(), dtype::f32}, {gathered.data() + s.begin, s.size(), dtype::f32}, clip);
      CHECK(res.applied);
      CHECK(res.grad_norm == std::sqrt(total));
    }
    step_options known = clip;
    known.known_grad_norm = std::sqrt(total);
    single.step(g.view(), {out.data(), n, dtype::f32}, known);
    for (const auto& s : single.segments())
      CHECK(std::memcmp(gathered.data() + s.offset, out.data() + s.offset, s.size * 4) == 0);
    // A NaN that only the last shard holds (in a tensor, not in padding): every rank skips,
    // step counts stay equal.
    const shard_range last = world.back().shard();
    std::size_t at = last.end;
    for (const auto& s : single.segments())
      if (s.size && s.offset + s.size > last.begin && at == last.end) at = std::max(s.offset, last.begin);
    REQUIRE(at < last.end);
    g.f32[at] = std::nanf("");
    reduce_all(g.f32);
    for (auto& r : world) {
      const shard_range s = r.shard();
      const auto before = std::vector<float>(r.local().params().begin(), r.local().params().end());
      const auto res = r.step({g.f32.data() + s.begin, s.size(), dtype::f32}, {}, clip);
      CHECK_FALSE(res.applied);
      CHECK(res.step == 1);
      CHECK(std::vector<float>(r.local().params().begin(), r.local().params().end()) == before);
    }
    for (auto& r : world) CHECK(r.local().skipped_steps() == 1);
  }
}
