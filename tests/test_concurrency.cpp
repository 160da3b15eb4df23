// One optimizer, many threads: every public operation is serialized (concurrent steps give
// the serial result, a save never tears), a chunked step belongs to its thread, and a
// half-updated state is refused everywhere until it is restored.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <limits>
#include <filesystem>
#include <thread>

#include "../cpu_adam/fair_mutex.hpp" // the lock itself, tested for its order
#include "reference.hpp"
#include "temp_dir.hpp"

using namespace hostopt;
namespace fs = std::filesystem;

namespace {

std::vector<param_group> model(std::size_t n) {
  adam_config c;
  c.lr = 1e-2;
  c.weight_decay = 0.1;
  return {{c, {{"w", {std::int64_t(n)}}, {"b", {7}}}}};
}

std::vector<float> state_of(const optimizer& o) {
  std::vector<float> s(o.params().begin(), o.params().end());
  s.insert(s.end(), o.exp_avg().begin(), o.exp_avg().end());
  s.insert(s.end(), o.exp_avg_sq().begin(), o.exp_avg_sq().end());
  return s;
}

} // namespace

TEST_CASE("two threads stepping one optimizer give the serial result", "[concurrency][per_arch]") {
  const std::size_t n = 200000;
  const int steps_each = 20;
  for (const auto& kernel : ref::supported_kernels()) {
    INFO("kernel " << kernel);
    std::mt19937 rng(5);
    const auto g = ref::random_grad(dtype::f32, optimizer(model(n)).arena_size(), rng);
    optimizer serial(model(n), {2, kernel}), shared(model(n), {1, kernel});
    for (int i = 0; i < 2 * steps_each; ++i) serial.step(g.view());
    // The same gradient every step: any serial order gives the same bits.
    auto worker = [&] {
      for (int i = 0; i < steps_each; ++i) shared.step(g.view());
    };
    std::thread a(worker), b(worker);
    a.join();
    b.join();
    CHECK(shared.step_count() == 2 * steps_each);
    CHECK(state_of(shared) == state_of(serial));
  }
}

// Waits until `opt` has `n` callers blocked on it: the caller has queued, whatever the
// scheduler did. Structural, not timed: no test here counts events against a clock.
static void await_waiting(const optimizer& opt, std::size_t n) {
  while (opt.waiting_callers() < n) std::this_thread::yield();
}

TEST_CASE("the optimizer's lock serves callers in the order they queued", "[concurrency]") {
  // std::mutex is not fair: a thread stepping in a loop released the lock and took it back
  // before a waiter ran (on x86-64 some calls waited for 80-621 steps, under qemu a save for
  // over 40 s). Here each thread takes its ticket only after the one before it has queued,
  // so the order is fixed; the holder then unlocks and locks again at once, as a stepping
  // loop does, and must come after every caller already queued.
  detail::fair_mutex mu;
  std::vector<int> order;
  mu.lock();
  std::vector<std::thread> callers;
  for (int i = 1; i <= 4; ++i) {
    callers.emplace_back([&, i] {
      std::lock_guard<detail::fair_mutex> lock(mu);
      order.push_back(i);
    });
    while (mu.waiting() < std::uint64_t(i)) std::this_thread::yield();
  }
  mu.unlock();
  mu.lock(); // the stepping loop's next turn
  order.push_back(0);
  CHECK(mu.waiting() == 0);
  mu.unlock();
  for (auto& t : callers) t.join();
  CHECK(order == std::vector<int>{1, 2, 3, 4, 0});
  CHECK(mu.try_lock());
  CHECK_FALSE(mu.try_lock());
  mu.unlock();
}

TEST_CASE("a caller that waited for a chunked step goes before the next one opens", "[concurrency]") {
  // A pipeline opens its next chunked step as soon as one finishes; a caller that waited
  // for the close (a learning-rate change, or a second pipeline's chunked step) must go
  // first, or it could wait through every step of a run.
  const std::size_t n = 1000;
  std::vector<float> g(optimizer(model(n)).arena_size(), 0.25f);
  const bool other_steps = GENERATE(false, true); // the waiting call: set_lr, or a chunked step of its own
  INFO((other_steps ? "a chunked step" : "set_lr") << " waits for the owner's chunked step");
  optimizer opt(model(n), {1, ""});
  auto chunked_step = [&] {
    opt.begin_step({});
    opt.update_range(0, g.size(), g.data());
    return opt.finish_step().step;
  };
  opt.begin_step({});
  std::int64_t other_step = 0;
  std::thread other([&] {
    if (other_steps) other_step = chunked_step();
    else opt.set_lr(0, 3e-2);
  });
  await_waiting(opt, 1); // the other call waits for this chunked step to close
  opt.update_range(0, g.size(), g.data());
  CHECK(opt.finish_step().step == 1);
  const std::int64_t next = chunked_step(); // opened at once: the waiting call goes first
  other.join();
  CHECK(opt.waiting_callers() == 0);
  if (other_steps) {
    CHECK(other_step == 2);
    CHECK(next == 3);
  } else {
    // The second step ran with the new learning rate: the serial order's bits.
    optimizer serial(model(n), {1, ""});
    const const_view gv{g.data(), g.size(), dtype::f32};
    serial.step(gv);
    serial.set_lr(0, 3e-2);
    serial.step(gv);
    CHECK(next == 2);
    CHECK(state_of(opt) == state_of(serial));
  }
}

TEST_CASE("save while another thread steps writes a whole, loadable state", "[concurrency][checkpoint]") {
  const hostopt_test::temp_dir scratch("concurrency_test");
  const fs::path& dir = scratch.path;
  const std::size_t n = 300000;
  std::mt19937 rng(6);
  optimizer opt(model(n), {1, ""});
  const auto g = ref::random_grad(dtype::bf16, opt.arena_size(), rng);
  std::atomic<bool> stop{false};
  std::thread stepper([&] {
    while (!stop) opt.step(g.view());
  });
  std::vector<std::string> files;
  for (int i = 0; i < 6; ++i) {
    files.push_back((dir / ("s" + std::to_string(i) + ".safetensors")).string());
    save_checkpoint(opt, files.back());
  }
  stop = true;
  stepper.join();
  // Each file is one consistent state: it loads (checksum) and replaying its step count
  // from scratch gives exactly its bits.
  for (const auto& f : files) {
    optimizer loaded(model(n));
    REQUIRE_NOTHROW(load_checkpoint(loaded, f));
    optimizer replay(model(n));
    for (std::int64_t s = 0; s < loaded.step_count(); ++s) replay.step(g.view());
    INFO(f << " at step " << loaded.step_count());
    CHECK(state_of(loaded) == state_of(replay));
  }
}

TEST_CASE("a chunked step belongs to its thread, others wait for it", "[concurrency]") {
  optimizer opt(model(64));
  std::vector<float> g(opt.arena_size(), 0.25f);
  opt.begin_step({});
  // The owner may not start anything else (it would wait for itself).
  CHECK_THROWS_WITH(opt.step(const_view{g.data(), g.size(), dtype::f32}), Catch::Contains("chunked step open"));
  CHECK_THROWS_WITH(save_checkpoint(opt, "unused"), Catch::Contains("chunked step open"));
  // Another thread cannot drive it, and its step waits until the chunked one is finished.
  std::atomic<bool> other_done{false};
  std::string other_error;
  std::int64_t other_step = 0;
  std::thread other([&] {
    try {
      opt.update_range(0, 16, g.data());
    } catch (const std::logic_error& e) {
      other_error = e.what();
    }
    other_step = opt.step(const_view{g.data(), g.size(), dtype::f32}).step;
    other_done = true;
  });
  await_waiting(opt, 1); // its step queued behind the open chunked step
  CHECK_FALSE(other_done);
  opt.update_range(0, opt.arena_size(), g.data());
  CHECK(opt.finish_step().step == 1);
  other.join();
  CHECK_THAT(other_error, Catch::Contains("belongs to another thread"));
  CHECK(other_step == 2);
}

TEST_CASE("a half-updated state is refused everywhere until a checkpoint restores it", "[concurrency][faults]") {
  const hostopt_test::temp_dir scratch("concurrency_test");
  const fs::path& dir = scratch.path;
  const std::string good = (dir / "good.safetensors").string(), other = (dir / "other.safetensors").string();
  optimizer opt(model(100));
  std::vector<float> g(opt.arena_size(), 0.5f);
  opt.step(const_view{g.data(), g.size(), dtype::f32});
  save_checkpoint(opt, good);
  const auto whole = state_of(opt);

  // Aborting a chunked step that updated nothing is harmless.
  opt.begin_step({});
  opt.abort_step();
  CHECK(opt.usable());

  opt.begin_step({});
  opt.update_range(0, 16, g.data());
  opt.abort_step("copy fault at chunk 1");
  CHECK_FALSE(opt.usable());
  CHECK(opt.failure_reason() == "copy fault at chunk 1");
  const const_view gv{g.data(), g.size(), dtype::f32};
  CHECK_THROWS_WITH(opt.step(gv), Catch::Contains("not usable") && Catch::Contains("copy fault at chunk 1"));
  CHECK_THROWS_WITH(save_checkpoint(opt, other), Catch::Contains("not usable"));
  CHECK_FALSE(fs::exists(other));
  CHECK_THROWS_AS(opt.params(), std::runtime_error);
  CHECK_THROWS_AS(opt.exp_avg_sq("w"), std::runtime_error);
  CHECK_THROWS_AS(opt.set_params("b", {g.data(), 7, dtype::f32}), std::runtime_error);
  chunk_step_options skip;
  skip.checks.skip_nonfinite = true;
  skip.checks.known_grad_norm = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(opt.begin_step(skip), std::runtime_error); // even a skip is not counted
  CHECK(opt.skipped_steps() == 0);
  CHECK_THROWS_AS(opt.set_step_count(3), std::runtime_error);
  CHECK_THROWS_AS(opt.begin_step({}), std::runtime_error);
  CHECK(opt.step_count() == 1); // counters and hyper-parameters can still be read

  load_checkpoint(opt, good);
  CHECK(opt.usable());
  CHECK(state_of(opt) == whole);
  opt.step(gv);

  // reset_failure() is the explicit way out.
  opt.begin_step({});
  opt.update_range(0, 16, g.data());
  opt.abort_step();
  CHECK_FALSE(opt.usable());
  opt.reset_failure();
  CHECK(opt.usable());
}
