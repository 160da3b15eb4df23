// ZeRO-style sharding, simulated in one process: every rank's shard stepped on its slice
// of the summed gradients, parameters gathered, compared bit for bit with the
// single-process optimizer; sharded checkpoints re-sharded across world sizes.
#include <catch2/catch.hpp>

#include <condition_variable>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <tuple>

#include "reference.hpp"
#include "temp_dir.hpp"

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

// One thread per rank and an all-reduce among them, as MPI's (the sum in rank order). A
// rank waiting in it for a rank that has left its call without joining (where MPI would
// wait forever) throws instead of hanging, so a would-be hang fails the test at once.
class thread_world {
public:
  explicit thread_world(int n) : n_(n), parts_(std::size_t(n)) {}

  sum_across_ranks reduction(int rank) {
    return [this, rank](double v) { return sum(rank, v); };
  }
  // Runs fn(rank) on every rank's thread; returns each rank's exception (null: none).
  template <class Fn>
  std::vector<std::exception_ptr> run(Fn fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      arrived_ = left_ = 0;
    }
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n_));
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r)
      threads.emplace_back([&, r] {
        try {
          fn(r);
        } catch (...) {
          errors[std::size_t(r)] = std::current_exception();
        }
        std::lock_guard<std::mutex> lock(mu_);
        ++left_;
        cv_.notify_all();
      });
    for (auto& t : threads) t.join();
    return errors;
  }
  std::int64_t calls() const { return calls_; }

private:
  double sum(int rank, double v) {
    std::unique_lock<std::mutex> lock(mu_);
    ++calls_;
    parts_[std::size_t(rank)] = v;
    const std::int64_t round = round_;
    if (++arrived_ == n_) {
      result_ = 0;
      for (const double p : parts_) result_ += p;
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
      return result_;
    }
    cv_.wait(lock, [&] { return round_ != round || arrived_ + left_ == n_; });
    if (round_ != round) return result_;
    --arrived_; // this rank leaves too; the others waiting see it
    throw std::runtime_error("rank " + std::to_string(rank) +
                             " waits in the reduction for a rank that left its step without joining: MPI would hang");
  }

  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<double> parts_;
  int arrived_ = 0, left_ = 0;
  std::int64_t round_ = 0, calls_ = 0;
  double result_ = 0;
};

std::string message_of(const std::exception_ptr& e) {
  if (!e) return "(no exception)";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
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
  const hostopt_test::temp_dir scratch("shard_test");
  const fs::path& dir = scratch.path;
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
}

TEST_CASE("an index.json with a key twice (a JSON reader keeps one) is refused by load and save",
          "[sharding][checkpoint]") {
  const hostopt_test::temp_dir scratch("shard_dup");
  const fs::path& dir = scratch.path;
  std::mt19937 rng(10);
  auto two = make_world(2);
  const std::size_t n = two.front().arena_size();
  step_world(two, ref::random_grad(dtype::f32, n, rng).f32, 1.0);
  for (auto& r : two) r.save(dir.string(), "s1");
  two.front().commit_save(dir.string(), "s1");
  step_world(two, ref::random_grad(dtype::f32, n, rng).f32, 1.0);
  for (auto& r : two) r.save(dir.string(), "s2");
  const fs::path index = dir / "index.json";
  std::string text;
  {
    std::ifstream f(index);
    text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  auto with = [&](const std::string& from, const std::string& to) {
    const std::size_t at = text.find(from);
    REQUIRE(at != std::string::npos);
    std::string t = text;
    t.replace(at, from.size(), to);
    std::ofstream(index, std::ios::trunc) << t;
  };
  for (const auto& [from, to, key] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"\"save_id\": \"s1\"", "\"save_id\": \"s2\", \"save_id\": \"s1\"", "save_id"},
           {"\"save_id\": \"s1\"", "\"save_id\": \"s1\", \"save_id\": \"s2\"", "save_id"},
           {"\"step\": \"1\"", "\"step\": \"2\", \"step\": \"1\"", "step"}}) {
    INFO(to);
    with(from, to);
    auto world = make_world(2);
    CHECK_THROWS_WITH(world.front().load(dir.string()),
                      Catch::Contains("index.json holds the key '" + key + "' twice") && Catch::Contains("refused"));
    CHECK(world.front().local().step_count() == 0);
    // A save next to an index that may name it (the committed save: it must not be written over).
    CHECK_THROWS_WITH(two.front().save(dir.string(), "s3"), Catch::Contains("holds the key '" + key + "' twice"));
    CHECK_FALSE(fs::exists(dir / "shard-0-of-2.s3.safetensors"));
  }
  std::ofstream(index, std::ios::trunc) << text;
  auto world = make_world(2);
  for (auto& r : world) r.load(dir.string());
  CHECK(world.front().local().step_count() == 1);
}

TEST_CASE("shard files of different saves are never loaded together", "[sharding][checkpoint]") {
  const hostopt_test::temp_dir scratch("shard_mix");
  const fs::path dir = scratch.path / "ckpt";
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
}

TEST_CASE("global decisions are global: a NaN on one rank makes every rank skip, clipping uses the global norm",
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
    // The reduction every rank calls: an all-reduce among the ranks' threads.
    thread_world threads(w);
    for (int k = 0; k < w; ++k) world[std::size_t(k)].set_norm_reduction(threads.reduction(k));
    auto total_of = [&](const std::vector<float>& grad) { // the same sum, in rank order
      double total = 0;
      for (auto& r : world) {
        const shard_range s = r.shard();
        total += r.shard_stats({grad.data() + s.begin, s.size(), dtype::f32}).sum_squares;
      }
      return total;
    };
    step_options clip;
    clip.max_grad_norm = 5.0;
    // A clipped step: every rank scales by the global norm's factor.
    const double total = total_of(g.f32);
    std::vector<float> gathered(n, -1.0f), out(n, -1.0f);
    std::vector<step_result> res(static_cast<std::size_t>(w));
    auto errors = threads.run([&](int k) {
      const shard_range s = world[std::size_t(k)].shard();
      res[std::size_t(k)] = world[std::size_t(k)].step({g.f32.data() + s.begin, s.size(), dtype::f32},
                                                       {gathered.data() + s.begin, s.size(), dtype::f32}, clip);
    });
    for (int k = 0; k < w; ++k) {
      CHECK(message_of(errors[std::size_t(k)]) == "(no exception)");
      CHECK(res[std::size_t(k)].applied);
      CHECK(res[std::size_t(k)].grad_norm == std::sqrt(total));
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
    std::vector<std::vector<float>> before;
    for (auto& r : world) before.emplace_back(r.local().params().begin(), r.local().params().end());
    errors = threads.run([&](int k) {
      const shard_range s = world[std::size_t(k)].shard();
      res[std::size_t(k)] = world[std::size_t(k)].step({g.f32.data() + s.begin, s.size(), dtype::f32}, {}, clip);
    });
    for (int k = 0; k < w; ++k) {
      auto& r = world[std::size_t(k)];
      CHECK(message_of(errors[std::size_t(k)]) == "(no exception)");
      CHECK_FALSE(res[std::size_t(k)].applied);
      CHECK(res[std::size_t(k)].step == 1);
      CHECK(std::vector<float>(r.local().params().begin(), r.local().params().end()) == before[std::size_t(k)]);
    }
    for (auto& r : world) CHECK(r.local().skipped_steps() == 1);
  }
}

namespace {

// The shard's slices of a full gradient and copy-out, and the options of a clipping step
// that reduces (no known norm).
struct shard_buffers {
  std::vector<float> grad, out;
};
shard_buffers buffers_of(const sharded_optimizer& r, const std::vector<float>& full) {
  const shard_range s = r.shard();
  return {std::vector<float>(full.begin() + std::ptrdiff_t(s.begin), full.begin() + std::ptrdiff_t(s.end)),
          std::vector<float>(s.size(), -1.0f)};
}
step_options reducing_clip() {
  step_options o;
  o.max_grad_norm = 5.0;
  return o;
}

} // namespace

TEST_CASE("a step refused on one rank is refused on every rank before any rank waits in the reduction",
          "[sharding][agreement]") {
  std::mt19937 rng(13);
  // What the bad rank does wrong; `reason` is a part of its own error.
  struct fault {
    const char* name;
    const char* reason;
    bool unchecked = false; // every rank steps with skip_nonfinite = false (clipping alone)
  };
  const fault faults[] = {{"a gradient one element short", "shard_grad.size"},
                          {"a negative max_grad_norm, unchecked", "max_grad_norm", true},
                          {"a NaN max_grad_norm, unchecked", "max_grad_norm", true},
                          {"a copy-out of the wrong size", "shard_params.size"},
                          {"a copy-out that is its gradient", "overlap"},
                          {"a negative max_grad_norm", "max_grad_norm"},
                          {"a state that is not usable", "not usable"},
                          {"no step call: its buffers failed to convert", "could not convert"}};
  for (int w : {2, 3})
    for (int bad = 0; bad < w; ++bad)
      for (const fault& f : faults) {
        INFO("world " << w << ", rank " << bad << " has " << f.name);
        auto world = make_world(w);
        thread_world threads(w);
        for (int k = 0; k < w; ++k) world[std::size_t(k)].set_norm_reduction(threads.reduction(k));
        const auto full = ref::random_grad(dtype::f32, world.front().arena_size(), rng, 4.0f).f32;
        std::vector<shard_buffers> bufs;
        std::vector<std::vector<float>> before;
        for (auto& r : world) {
          bufs.push_back(buffers_of(r, full));
          before.emplace_back(r.local().params().begin(), r.local().params().end());
        }
        const std::string fault_name = f.name;
        if (fault_name == "a state that is not usable") world[std::size_t(bad)].local().mark_unusable("a test broke it");
        auto errors = threads.run([&](int k) {
          sharded_optimizer& r = world[std::size_t(k)];
          shard_buffers& b = bufs[std::size_t(k)];
          step_options o = reducing_clip();
          if (f.unchecked) o.skip_nonfinite = false;
          const_view grad{b.grad.data(), b.grad.size(), dtype::f32};
          mut_view out{b.out.data(), b.out.size(), dtype::f32};
          if (k == bad) {
            if (fault_name == "a gradient one element short") grad.size -= 1;
            if (fault_name == "a copy-out of the wrong size") out.size += 16;
            if (fault_name == "a copy-out that is its gradient") out.data = b.grad.data();
            if (fault_name == "a negative max_grad_norm" || fault_name == "a negative max_grad_norm, unchecked")
              o.max_grad_norm = -1;
            if (fault_name == "a NaN max_grad_norm, unchecked") o.max_grad_norm = std::nan("");
            if (fault_name == "no step call: its buffers failed to convert") {
              r.refuse_step("could not convert its buffers", o);
              throw std::logic_error("refuse_step returned although the other ranks wait");
            }
          }
          r.step(grad, out, o);
        });
        if (fault_name == "a state that is not usable") world[std::size_t(bad)].local().reset_failure();
        for (int k = 0; k < w; ++k) {
          INFO("rank " << k << ": " << message_of(errors[std::size_t(k)]));
          bool refused = false;
          try {
            std::rethrow_exception(errors[std::size_t(k)]);
          } catch (const sharded_step_refused& e) {
            refused = true;
            const std::string what = e.what();
            CHECK(e.refused_ranks() == 1);
            CHECK_THAT(what, Catch::StartsWith("sharded step refused by 1 of " + std::to_string(w) + " ranks (rank " +
                                               std::to_string(bad) + ")"));
            CHECK_THAT(what, Catch::EndsWith("nothing was applied on any rank"));
            if (k == bad) {
              CHECK_THAT(what, Catch::Contains("rank " + std::to_string(bad) + " refused it: "));
              CHECK_THAT(e.reason(), Catch::Contains(f.reason));
            } else {
              CHECK_THAT(what, Catch::Contains(": see that rank's error"));
              CHECK(e.reason().empty());
            }
          } catch (...) {
          }
          CHECK(refused);
          const auto& params = world[std::size_t(k)].local().params();
          CHECK(world[std::size_t(k)].local().step_count() == 0);
          CHECK(std::vector<float>(params.begin(), params.end()) == before[std::size_t(k)]);
          CHECK(bufs[std::size_t(k)].out == std::vector<float>(bufs[std::size_t(k)].out.size(), -1.0f));
        }
        // Nothing applied anywhere; then the same step, valid on every rank, is taken by all
        // (the ranks' reductions are still in step with each other).
        std::vector<step_result> res(static_cast<std::size_t>(w));
        errors = threads.run([&](int k) {
          sharded_optimizer& r = world[std::size_t(k)];
          shard_buffers& b = bufs[std::size_t(k)];
          res[std::size_t(k)] = r.step({b.grad.data(), b.grad.size(), dtype::f32},
                                       {b.out.data(), b.out.size(), dtype::f32}, reducing_clip());
        });
        for (int k = 0; k < w; ++k) {
          INFO("rank " << k << ": " << message_of(errors[std::size_t(k)]));
          CHECK_FALSE(errors[std::size_t(k)]);
          CHECK(res[std::size_t(k)].applied);
          CHECK(res[std::size_t(k)].grad_norm == res[0].grad_norm);
          CHECK(world[std::size_t(k)].local().step_count() == 1);
        }
        CHECK(threads.calls() == 3 * w); // the refused step's agreement; the agreement and the norm
      }
}

TEST_CASE("refusals on several ranks are counted and named, beyond 24 ranks counted", "[sharding][agreement]") {
  std::mt19937 rng(14);
  struct world_case {
    int w;
    std::vector<int> bad;
    std::string who; // what every rank's error says
  };
  const world_case cases[] = {{3, {0, 2}, "sharded step refused by 2 of 3 ranks (ranks 0, 2)"},
                              {3, {0, 1, 2}, "sharded step refused by 3 of 3 ranks (ranks 0, 1, 2)"},
                              {30, {7}, "sharded step refused by 1 of 30 ranks: see that rank's error"},
                              {30, {3, 29}, "sharded step refused by 2 of 30 ranks: see their errors"}};
  for (const auto& c : cases) {
    INFO("world " << c.w << ": " << c.who);
    auto world = make_world(c.w);
    thread_world threads(c.w);
    for (int k = 0; k < c.w; ++k) world[std::size_t(k)].set_norm_reduction(threads.reduction(k));
    const auto full = ref::random_grad(dtype::f32, world.front().arena_size(), rng, 4.0f).f32;
    auto errors = threads.run([&](int k) {
      auto b = buffers_of(world[std::size_t(k)], full);
      const bool is_bad = std::find(c.bad.begin(), c.bad.end(), k) != c.bad.end();
      world[std::size_t(k)].step({b.grad.data(), b.grad.size() + (is_bad ? 1 : 0), dtype::f32}, {}, reducing_clip());
    });
    for (int k = 0; k < c.w; ++k) {
      const bool is_bad = std::find(c.bad.begin(), c.bad.end(), k) != c.bad.end();
      const std::string what = message_of(errors[std::size_t(k)]);
      INFO("rank " << k << ": " << what);
      CHECK_THAT(what, Catch::StartsWith(is_bad && c.w > 24 ? c.who.substr(0, c.who.find(':')) : c.who));
      if (is_bad) CHECK_THAT(what, Catch::Contains("rank " + std::to_string(k) + " refused it: shard_grad.size"));
      try {
        std::rethrow_exception(errors[std::size_t(k)]);
      } catch (const sharded_step_refused& e) {
        CHECK(e.refused_ranks() == int(c.bad.size()));
      } catch (...) {
        FAIL("not sharded_step_refused");
      }
      CHECK(world[std::size_t(k)].local().step_count() == 0);
    }
  }
}

TEST_CASE("steps given the norm make no collective, and check_step and agree_step let the caller agree",
          "[sharding][agreement]") {
  std::mt19937 rng(15);
  const int w = 3, bad = 1;
  auto world = make_world(w);
  thread_world threads(w);
  for (int k = 0; k < w; ++k) world[std::size_t(k)].set_norm_reduction(threads.reduction(k));
  const auto full = ref::random_grad(dtype::f32, world.front().arena_size(), rng, 4.0f).f32;
  std::vector<shard_buffers> bufs;
  for (auto& r : world) bufs.push_back(buffers_of(r, full));
  auto grad_of = [&](int k, std::size_t less = 0) {
    return const_view{bufs[std::size_t(k)].grad.data(), bufs[std::size_t(k)].grad.size() - less, dtype::f32};
  };
  step_options known = reducing_clip();
  known.known_grad_norm = 3.0;
  // check_step throws what step throws, on this rank alone, and calls no reduction; it
  // takes the norm as known (the norm's all-reduce can carry its verdict).
  sharded_optimizer& r = world[bad];
  std::string step_error;
  try {
    r.step(grad_of(bad, 1), {}, known);
  } catch (const std::invalid_argument& e) {
    step_error = e.what();
  }
  REQUIRE_THAT(step_error, Catch::Contains("shard_grad.size"));
  CHECK_THROWS_WITH(r.check_step(grad_of(bad, 1), {}, known), step_error);
  step_options negative = reducing_clip();
  negative.max_grad_norm = -1;
  CHECK_THROWS_WITH(r.check_step(grad_of(bad), {}, negative), Catch::Contains("max_grad_norm"));
  r.local().mark_unusable("a test broke it");
  CHECK_THROWS_WITH(r.check_step(grad_of(bad), {}, known), Catch::Contains("a test broke it"));
  r.local().reset_failure();
  CHECK_NOTHROW(r.check_step(grad_of(bad), {}, reducing_clip())); // the norm to come
  CHECK_NOTHROW(r.check_step(grad_of(bad), {}, known));
  CHECK(threads.calls() == 0);
  CHECK(r.local().step_count() == 0);

  // agree_step: one collective, every rank refuses together.
  auto errors = threads.run([&](int k) {
    world[std::size_t(k)].agree_step(grad_of(k, k == bad ? 1 : 0), {}, known, threads.reduction(k));
  });
  for (int k = 0; k < w; ++k) {
    const std::string what = message_of(errors[std::size_t(k)]);
    INFO("rank " << k << ": " << what);
    CHECK_THAT(what, Catch::StartsWith("sharded step refused by 1 of 3 ranks (rank 1)"));
  }
  CHECK(threads.calls() == w);
  // Accepted everywhere: agree_step returns, and the steps given the norm call no reduction.
  std::vector<step_result> res(static_cast<std::size_t>(w));
  errors = threads.run([&](int k) {
    world[std::size_t(k)].agree_step(grad_of(k), {}, known, threads.reduction(k));
    res[std::size_t(k)] = world[std::size_t(k)].step(grad_of(k), {}, known);
  });
  for (int k = 0; k < w; ++k) {
    INFO("rank " << k << ": " << message_of(errors[std::size_t(k)]));
    CHECK_FALSE(errors[std::size_t(k)]);
    CHECK(res[std::size_t(k)].applied);
    CHECK(res[std::size_t(k)].grad_norm == 3.0);
  }
  CHECK(threads.calls() == 2 * w);
  // Without an agreement to join (the step would not reduce), refuse_step returns.
  CHECK_NOTHROW(r.refuse_step("its own error", known));
  CHECK(threads.calls() == 2 * w);
}
