// A stored optimizer's chunked steps (chunk_updater) and the offload pipeline driving it: the
// in-RAM optimizer's bits whatever ranges the gradients arrive in (cutting the store's chunks,
// or covering several), accumulated micro-batches, skipped steps, a step that fails midway or
// at its commit (the store keeps the step before, usable), and what is refused.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <thread>

#include "hostopt/offload_pipeline.hpp"
#include "hostopt/optimizer.hpp"
#include "hostopt/stored_optimizer.hpp"
#include "reference.hpp"
#include "store_test_support.hpp"
#include "temp_dir.hpp"
#include "device_buffer.hpp"

namespace fs = std::filesystem;
using namespace hostopt;
using namespace hostopt_test::store;
using hostopt_test::temp_dir;
using hostopt_test::device_buffer;

namespace {

std::vector<std::uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<std::uint16_t> h(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) h[i] = ref::to_bf16(x[i]);
  return h;
}

// One chunked step of `u` over ranges of `range` elements (the last shorter): bf16 gradients
// and copy-out, plus an f32 accumulator where one is given.
step_result chunked_step(chunk_updater& u, std::size_t range, const std::vector<std::uint16_t>& grad,
                         std::vector<std::uint16_t>& out, const std::vector<float>* acc,
                         const step_options& checks = {1.0f, 0.0, false, -1.0},
                         const std::vector<std::size_t>& without = {}) {
  const std::size_t n = u.arena_size();
  const step_result begun = u.begin_step({dtype::bf16, true, dtype::bf16, acc != nullptr, checks, without});
  if (!begun.applied) return begun;
  for (std::size_t b = 0; b < n; b += range) {
    const std::size_t e = std::min(n, b + range);
    u.update_range(b, e, grad.data() + b, out.data() + b, acc ? acc->data() + b : nullptr);
  }
  if (n == 0) u.update_range(0, 0, grad.data(), out.data(), acc ? acc->data() : nullptr);
  return u.finish_step();
}

// The tensors' elements of a flat f32 buffer equal the optimizer's parameters (padding
// between tensors is no tensor's: the pipeline's copies leave it undefined).
bool tensors_equal(const void* flat, optimizer& o) {
  for (const segment& seg : o.segments())
    if (seg.size && std::memcmp(static_cast<const float*>(flat) + seg.offset, o.params().data() + seg.offset,
                                seg.size * 4) != 0)
      return false;
  return true;
}

// An in-RAM optimizer and a new store of `groups` in `dir` (small_store), both at the same
// initial parameters.
struct both_at_start {
  optimizer reference;
  stored_optimizer stored;
  std::size_t n;
};
both_at_start start_both(const std::vector<param_group>& groups, const temp_dir& dir) {
  optimizer reference(groups);
  const std::size_t n = reference.arena_size();
  const std::vector<float> p0 = initial_params(reference.segments(), n);
  std::copy(p0.begin(), p0.end(), reference.params().begin());
  auto stored = stored_optimizer::create(groups, small_store(dir.str()), {}, {p0.data(), n, dtype::f32});
  return {std::move(reference), std::move(stored), n};
}

// Flips a bit of the byte at `at` of `file` in place.
void flip_bit(const fs::path& file, std::uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(at));
  char c = 0;
  f.get(c);
  f.seekp(std::streamoff(at));
  f.put(char(c ^ 0x40));
}

} // namespace

TEST_CASE("stored_optimizer: chunked steps over ranges that cut its chunks give the in-RAM optimizer's bits") {
  const auto groups = mixed_groups();
  const temp_dir dir("stored_chunked");
  auto [reference, stored, n] = start_both(groups, dir);
  REQUIRE(stored.chunks() > 4);
  REQUIRE(stored.chunk_unit() == 32); // (an 8-bit group: ranges end on whole blocks)
  // Ranges smaller than the store's 512-element chunks, cutting them; larger, covering several;
  // equal; and the whole arena in one.
  const std::size_t ranges[] = {96, 1504, 512, 160, n};
  std::int64_t t = 0;
  for (const std::size_t range : ranges) {
    INFO("ranges of " << range << " elements");
    const auto grad = to_bf16(grad_of(n, ++t));
    std::vector<float> acc = grad_of(n, 1000 + t); // a micro-batch accumulated before, every other step
    const std::vector<float>* with = t % 2 ? &acc : nullptr;
    std::vector<std::uint16_t> out_stored(n, 0xFFFF), out_ram(n, 0xFFFF);
    const step_result a = chunked_step(stored, range, grad, out_stored, with);
    const step_result b = chunked_step(reference, range, grad, out_ram, with);
    CHECK(a.applied);
    CHECK(a.step == b.step);
    CHECK(a.saturated_blocks == b.saturated_blocks);
    REQUIRE(out_stored == out_ram);
    require_same_as(stored, reference, groups);
  }
  // What the store committed is what it reopens with.
  stored.close();
  auto reopened = stored_optimizer::open(groups, small_store(dir.str()));
  require_same_as(reopened, reference, groups);
}

TEST_CASE("stored_optimizer: read_params gives the committed step's parameters while a chunked step updates them") {
  const auto groups = f32_groups();
  const temp_dir dir("stored_read_params");
  optimizer reference(groups);
  const std::size_t n = reference.arena_size();
  const std::vector<float> p0 = initial_params(reference.segments(), n);
  auto stored = stored_optimizer::create(groups, small_store(dir.str()), {}, {p0.data(), n, dtype::f32});
  std::vector<float> before(n, -1.0f);
  stored.read_params(0, n, before.data(), dtype::f32);
  CHECK(std::memcmp(before.data(), p0.data(), n * 4) == 0); // (padding: zeros, as p0's)
  const std::vector<float> grad = grad_of(n, 1);
  std::vector<float> out(n);
  REQUIRE(stored.begin_step({dtype::f32, true, dtype::f32, false, {1.0f, 0.0, false, -1.0}, {}}).applied);
  stored.update_range(0, 1040, grad.data(), out.data()); // two chunks and a part of the third
  // The updated part and the rest, as the committed step holds them, bf16 too; a range
  // starting inside a chunk.
  std::vector<float> now(n, -1.0f);
  stored.read_params(0, n, now.data(), dtype::f32);
  CHECK(now == before);
  std::vector<std::uint16_t> half(n - 7);
  stored.read_params(7, n, half.data(), dtype::bf16);
  for (std::size_t i = 0; i < half.size(); ++i) REQUIRE(half[i] == ref::to_bf16(p0[7 + i]));
  stored.update_range(1040, n, grad.data() + 1040, out.data() + 1040);
  stored.finish_step();
  // (The last chunk was read before the commit: the commit's, not that one, is read now.)
  const segment& last = stored.segments().back();
  std::vector<float> tail(last.size);
  stored.read_params(last.offset, last.offset + last.size, tail.data(), dtype::f32);
  CHECK(std::memcmp(tail.data(), out.data() + last.offset, last.size * 4) == 0);
  stored.read_params(0, n, now.data(), dtype::f32);
  CHECK(now != before);
  CHECK(std::memcmp(now.data(), out.data(), n * 4) == 0); // the copy-out of the committed step
  CHECK_THROWS_WITH(stored.read_params(0, n + 1, now.data(), dtype::f32), Catch::Contains("expected a range inside"));
}

TEST_CASE("stored_optimizer: an aborted or failed chunked step leaves the store at the step before, usable") {
  const auto groups = mixed_groups();
  const temp_dir dir("stored_aborted");
  optimizer reference(groups);
  const std::size_t n = reference.arena_size();
  auto stored = stored_optimizer::create(groups, small_store(dir.str()));
  const auto grad = to_bf16(grad_of(n, 1)), grad2 = to_bf16(grad_of(n, 2));
  std::vector<std::uint16_t> out(n), out_ram(n);
  chunked_step(stored, 256, grad, out, nullptr);
  chunked_step(reference, 256, grad, out_ram, nullptr);
  const step_options unchecked_step{1.0f, 0.0, false, -1.0};
  // Aborted after updating (and writing back) some of its chunks: nothing applied.
  REQUIRE(stored.begin_step({dtype::bf16, true, dtype::bf16, false, unchecked_step, {}}).applied);
  stored.update_range(0, 1536, grad2.data(), out.data());
  stored.abort_step("the caller gave up");
  CHECK(stored.usable());
  CHECK(stored.step_count() == 1);
  require_same_as(stored, reference, groups);
  // A chunk that fails its checksum when the ranges reach it (chunk 3's slot of commit 1):
  // update_range throws, refuses to go on, and the step can only be aborted; nothing applied.
  const fs::path chunks_file = fs::path(dir.str()) / "chunks";
  const std::uint64_t slot = 4096 + stored.chunk_bytes(), at = (2 * 3 + 1) * slot + 4096 + 10;
  flip_bit(chunks_file, at);
  REQUIRE(stored.begin_step({dtype::bf16, true, dtype::bf16, false, unchecked_step, {}}).applied);
  CHECK_THROWS_WITH(stored.update_range(0, n, grad2.data(), out.data()), Catch::Contains("chunk 3") &&
                                                                              Catch::Contains("checksum"));
  CHECK_THROWS_WITH(stored.update_range(0, n, grad2.data(), out.data()), Catch::Contains("this chunked step failed"));
  CHECK_THROWS_WITH(stored.finish_step(), Catch::Contains("this chunked step failed"));
  stored.abort_step("bad chunk");
  CHECK(stored.usable());
  CHECK(stored.step_count() == 1);
  flip_bit(chunks_file, at); // (mended: the drive holds step 1 whole again)
  require_same_as(stored, reference, groups);
  // Reopened, the store holds step 1; a chunked step there refuses what breaks its order.
  stored.close();
  auto reopened = stored_optimizer::open(groups, small_store(dir.str()));
  REQUIRE(reopened.begin_step({dtype::bf16, true, dtype::bf16, false, unchecked_step, {}}).applied);
  reopened.update_range(0, 512, grad2.data(), out.data());
  CHECK_THROWS_WITH(reopened.step(const_view{grad2.data(), n, dtype::bf16}),
                    Catch::Contains("this thread has a chunked step open"));
  CHECK_THROWS_WITH(reopened.finish_step(), Catch::Contains("the chunks cover [0, 512)"));
  CHECK_THROWS_WITH(reopened.update_range(640, 672, grad2.data() + 640, out.data() + 640),
                    Catch::Contains("expected the next chunk, starting at 512"));
  CHECK_THROWS_WITH(reopened.update_range(512, 520, grad2.data() + 512, out.data() + 512),
                    Catch::Contains("multiple of 32"));
  reopened.abort_step("refusals seen");
  // Then steps go on from the step before, to the in-RAM bits.
  chunked_step(reopened, 448, grad2, out, nullptr);
  chunked_step(reference, 448, grad2, out_ram, nullptr);
  CHECK(out == out_ram);
  require_same_as(reopened, reference, groups);
}

TEST_CASE("stored_optimizer: chunked steps refuse a tensor it has not and an unknown norm, and count skipped ones") {
  const auto groups = mixed_groups();
  const temp_dir dir("stored_chunked_refusals");
  optimizer reference(groups);
  const std::size_t n = reference.arena_size();
  auto stored = stored_optimizer::create(groups, small_store(dir.str()));
  const step_options unchecked_step{1.0f, 0.0, false, -1.0};
  CHECK_THROWS_WITH(stored.begin_step({dtype::bf16, true, dtype::bf16, false, unchecked_step, {1, 8}}),
                    Catch::Contains("tensors_without_grad names tensor 8: expected an index below 8"));
  CHECK_THROWS_WITH(stored.check_options({dtype::bf16, true, dtype::bf16, false, unchecked_step, {8}}),
                    Catch::Contains("tensors_without_grad names tensor 8"));
  step_options checked; // skip_nonfinite, the norm not known: the gradients have not arrived
  CHECK_THROWS_WITH(stored.begin_step({dtype::bf16, true, dtype::bf16, false, checked, {}}),
                    Catch::Contains("known_grad_norm"));
  CHECK_THROWS_WITH(stored.check_options({dtype::bf16, true, dtype::bf16, false, checked, {}}),
                    Catch::Contains("known_grad_norm"));
  CHECK_THROWS_AS(stored.begin_step({dtype(77), true, dtype::bf16, false, unchecked_step, {}}), std::invalid_argument);
  // A non-finite known norm skips: counted, nothing streamed, committed with the next step.
  checked.known_grad_norm = std::numeric_limits<double>::infinity();
  const step_result skipped = stored.begin_step({dtype::bf16, true, dtype::bf16, false, checked, {}});
  CHECK_FALSE(skipped.applied);
  CHECK(stored.skipped_steps() == 1);
  CHECK_THROWS_WITH(stored.update_range(0, 32, nullptr, nullptr), Catch::Contains("no chunked step is open"));
  checked.known_grad_norm = 3.0;
  checked.max_grad_norm = 1.0; // clipped by the known norm, as the in-RAM optimizer clips
  const auto grad = to_bf16(grad_of(n, 1));
  std::vector<std::uint16_t> out(n), out_ram(n);
  REQUIRE(chunked_step(stored, 320, grad, out, nullptr, checked).applied_scale == Approx(1.0f / 3.0f));
  reference.step(const_view{grad.data(), n, dtype::bf16}, {}, checked);
  CHECK(reference.skipped_steps() == 0);
  stored.close();
  auto reopened = stored_optimizer::open(groups, small_store(dir.str()));
  CHECK(reopened.skipped_steps() == 1);
  CHECK(reopened.step_count() == 1);
  optimizer copy(groups);
  reopened.copy_state_to(copy);
  CHECK(std::memcmp(copy.params().data(), reference.params().data(), n * 4) == 0);
}

TEST_CASE("stored_optimizer: another thread's call waits for the open chunked step, then runs") {
  const auto groups = f32_groups();
  const temp_dir dir("stored_chunked_turns");
  optimizer reference(groups);
  const std::size_t n = reference.arena_size();
  auto stored = stored_optimizer::create(groups, small_store(dir.str()));
  const std::vector<float> g1 = grad_of(n, 1), g2 = grad_of(n, 2);
  REQUIRE(stored.begin_step({dtype::f32, false, dtype::f32, false, {1.0f, 0.0, false, -1.0}, {}}).applied);
  stored.update_range(0, 1024, g1.data());
  std::atomic<bool> stepped{false};
  std::thread other([&] { // a whole step: it must come after the chunked one, never inside it
    stored.step(const_view{g2.data(), n, dtype::f32}, {}, 1.0f);
    stepped = true;
  });
  stored.update_range(1024, n, g1.data() + 1024);
  const step_result first = stored.finish_step();
  other.join();
  CHECK(first.step == 1);
  CHECK(stepped);
  reference.step(const_view{g1.data(), n, dtype::f32}, {}, 1.0f);
  reference.step(const_view{g2.data(), n, dtype::f32}, {}, 1.0f);
  require_same_as(stored, reference, groups);
}

TEST_CASE("offload_pipeline over a stored optimizer: steps and micro-batches give the in-RAM pipeline's bits") {
  const auto groups = mixed_groups();
  const temp_dir dir("stored_pipeline");
  auto [reference, stored, n] = start_both(groups, dir);
  auto engine = make_host_copy_engine(), engine_ram = make_host_copy_engine();
  pipeline_options po;
  po.chunk_elems = 200; // rounded up to 224 (8-bit blocks): ranges that cut the store's 512-element chunks
  po.depth = 3;
  po.grad_type = dtype::bf16;
  po.param_type = dtype::bf16;
  offload_pipeline pipe(stored, *engine, po), pipe_ram(reference, *engine_ram, po);
  CHECK(pipe.chunk_elems() == 224);
  device_buffer g(*engine, n * 2), p(*engine, n * 2), g_ram(*engine_ram, n * 2), p_ram(*engine_ram, n * 2);
  pipe.push_params({p.data, n, dtype::bf16});
  pipe_ram.push_params({p_ram.data, n, dtype::bf16});
  REQUIRE(std::memcmp(p.data, p_ram.data, n * 2) == 0);
  const device_stream s = engine->create_stream(), s_ram = engine_ram->create_stream();
  for (std::int64_t t = 1; t <= 4; ++t) {
    INFO("step " << t);
    const auto grad = to_bf16(grad_of(n, t));
    std::memcpy(g.data, grad.data(), n * 2);
    std::memcpy(g_ram.data, grad.data(), n * 2);
    if (t % 2 == 0) { // a micro-batch first
      const auto micro = to_bf16(grad_of(n, 100 + t));
      std::memcpy(g.data, micro.data(), n * 2);
      std::memcpy(g_ram.data, micro.data(), n * 2);
      pipe.accumulate_async({g.data, n, dtype::bf16}, device_order::after(s)).wait();
      pipe_ram.accumulate_async({g_ram.data, n, dtype::bf16}, device_order::after(s_ram)).wait();
      std::memcpy(g.data, grad.data(), n * 2);
      std::memcpy(g_ram.data, grad.data(), n * 2);
    }
    const step_result a = pipe.step({g.data, n, dtype::bf16}, {p.data, n, dtype::bf16}, device_order::after(s));
    const step_result b =
        pipe_ram.step({g_ram.data, n, dtype::bf16}, {p_ram.data, n, dtype::bf16}, device_order::after(s_ram));
    CHECK(a.step == b.step);
    REQUIRE(std::memcmp(p.data, p_ram.data, n * 2) == 0);
  }
  require_same_as(stored, reference, groups);
  CHECK(stored.cached_pages() == 0); // (the drive's I/O bypassed the page cache)
}

TEST_CASE("offload_pipeline over a stored optimizer: a step failing midway or at its commit keeps the step before") {
  const auto groups = mixed_groups();
  const temp_dir dir("stored_pipeline_faults");
  optimizer reference(groups);
  const std::size_t n = reference.arena_size();
  auto stored = stored_optimizer::create(groups, small_store(dir.str()));
  auto engine = make_host_copy_engine();
  pipeline_options po;
  po.chunk_elems = 416;
  po.grad_type = dtype::bf16;
  po.param_type = dtype::f32;
  std::atomic<int> fail_at{-1};
  po.before_update = [&](std::size_t k) {
    if (int(k) == fail_at) throw std::runtime_error("injected update error");
  };
  offload_pipeline pipe(stored, *engine, po);
  device_buffer g(*engine, n * 2), p(*engine, n * 4);
  const device_stream s = engine->create_stream();
  auto step_both = [&](std::int64_t t) {
    const auto grad = to_bf16(grad_of(n, t));
    std::memcpy(g.data, grad.data(), n * 2);
    const step_result r = pipe.step({g.data, n, dtype::bf16}, {p.data, n, dtype::f32}, device_order::after(s));
    reference.step(const_view{grad.data(), n, dtype::bf16}, {}, 1.0f);
    CHECK(r.step == reference.step_count());
  };
  step_both(1);
  // Midway: chunks 0 and 1 updated, then the error. The store keeps step 1 whole and stays
  // usable; the device's chunks from 2 on got step 1's parameters, 0 and 1 are ahead.
  fail_at = 2;
  const auto grad = to_bf16(grad_of(n, 2));
  std::memcpy(g.data, grad.data(), n * 2);
  CHECK_THROWS_WITH(pipe.step({g.data, n, dtype::bf16}, {p.data, n, dtype::f32}, device_order::after(s)),
                    Catch::Contains("injected update error") &&
                        Catch::Contains("the optimizer state is unchanged (it holds step 1: the updater commits a "
                                        "step whole or not at all)") &&
                        Catch::Contains("chunks [0, 2) hold the step that was not applied: call push_params()"));
  fail_at = -1;
  CHECK(pipe.usable());
  CHECK(stored.usable());
  CHECK(stored.step_count() == 1);
  require_same_as(stored, reference, groups);
  const float* dev = static_cast<const float*>(p.data);
  const std::size_t from = 2 * pipe.chunk_elems();
  CHECK(std::memcmp(dev + from, reference.params().data() + from, (n - from) * 4) == 0);
  CHECK(std::memcmp(dev, reference.params().data(), from * 4) != 0);
  pipe.push_params({p.data, n, dtype::f32});
  CHECK(std::memcmp(p.data, reference.params().data(), n * 4) == 0);
  step_both(2);
  CHECK(tensors_equal(p.data, reference));
  // At the commit: the store's commit record replaced under it (another inode) refuses the
  // commit before any record is written; the step is not applied, the store stays at step 2.
  const fs::path commit = fs::path(dir.str()) / "commit";
  fs::copy_file(commit, commit.string() + ".copy");
  fs::rename(commit.string() + ".copy", commit);
  std::memcpy(g.data, to_bf16(grad_of(n, 3)).data(), n * 2);
  CHECK_THROWS_WITH(pipe.step({g.data, n, dtype::bf16}, {p.data, n, dtype::f32}, device_order::after(s)),
                    Catch::Contains("offload step failed finishing") && Catch::Contains("were removed or replaced") &&
                        Catch::Contains("the optimizer state is unchanged (it holds step 2)") &&
                        Catch::Contains("call push_params()"));
  CHECK(stored.step_count() == 2);
  require_same_as(stored, reference, groups);
}

TEST_CASE("offload_pipeline over a stored optimizer: a failed step keeps its accumulated micro-batches for the "
          "retry, a store marked unusable drops them") {
  // The store still holds the step before, whole, and never read the accumulator into it:
  // the retry averages the micro-batches with its gradients, as the in-RAM pipeline's step.
  const auto groups = f32_groups();
  const temp_dir dir("stored_pipeline_micro");
  auto [reference, stored, n] = start_both(groups, dir);
  auto engine = make_host_copy_engine(), engine_ram = make_host_copy_engine();
  pipeline_options po;
  po.chunk_elems = 1024;
  std::atomic<bool> fail{false}, mark{false};
  po.before_update = [&](std::size_t k) { // (called for accumulations too)
    if (!fail || k != 1) return;
    if (mark) std::thread([&] { stored.mark_unusable("injected: the drive vanished"); }).join();
    throw std::runtime_error("injected update error");
  };
  offload_pipeline pipe(stored, *engine, po);
  pipeline_options po_ram = po;
  po_ram.before_update = nullptr;
  offload_pipeline pipe_ram(reference, *engine_ram, po_ram);
  device_buffer g(*engine, n * 4), p(*engine, n * 2), g_ram(*engine_ram, n * 4), p_ram(*engine_ram, n * 2);
  const device_order ready = device_order::after(engine->create_stream());
  const device_order ready_ram = device_order::after(engine_ram->create_stream());
  const std::vector<float> micro = grad_of(n, 1), last = grad_of(n, 2);
  std::memcpy(g.data, micro.data(), n * 4);
  std::memcpy(g_ram.data, micro.data(), n * 4);
  pipe.accumulate_async({g.data, n, dtype::f32}, ready).wait();
  pipe_ram.accumulate_async({g_ram.data, n, dtype::f32}, ready_ram).wait();
  CHECK(pipe.accumulated_micro_batches() == 1);
  std::memcpy(g.data, last.data(), n * 4);
  std::memcpy(g_ram.data, last.data(), n * 4);
  fail = true;
  CHECK_THROWS_WITH(pipe.step({g.data, n, dtype::f32}, {p.data, n, dtype::bf16}, ready),
                    Catch::Contains("the optimizer state is unchanged (it holds step 0") &&
                        Catch::Contains("the 1 micro-batch(es) accumulated for it are kept"));
  CHECK(pipe.accumulated_micro_batches() == 1);
  fail = false;
  pipe.step({g.data, n, dtype::f32}, {p.data, n, dtype::bf16}, ready);
  pipe_ram.step({g_ram.data, n, dtype::f32}, {p_ram.data, n, dtype::bf16}, ready_ram);
  CHECK(std::memcmp(p.data, p_ram.data, n * 2) == 0);
  require_same_as(stored, reference, groups);

  // A store marked unusable midway (a failed write, another thread's fault) cannot promise
  // the step before: the micro-batches go with the failed step.
  std::memcpy(g.data, micro.data(), n * 4);
  pipe.accumulate_async({g.data, n, dtype::f32}, ready).wait();
  fail = mark = true;
  CHECK_THROWS_WITH(pipe.step({g.data, n, dtype::f32}, {p.data, n, dtype::bf16}, ready),
                    Catch::Contains("the 1 micro-batch(es) accumulated for it were dropped with it"));
  CHECK(pipe.accumulated_micro_batches() == 0);
}

TEST_CASE("offload_pipeline over a stored optimizer: marked unusable midway by another thread, its step is still "
          "reported whole") {
  // Whether a failed step left the state whole is the updater's property, not read from its
  // usable state: a store marked unusable meanwhile still holds the step before, whole.
  const auto groups = f32_groups();
  const temp_dir dir("stored_pipeline_marked");
  auto [reference, stored, n] = start_both(groups, dir);
  auto engine = make_host_copy_engine();
  pipeline_options po;
  po.chunk_elems = 1024;
  po.param_type = dtype::f32;
  po.before_update = [&](std::size_t k) {
    if (k != 2) return;
    std::thread([&] { stored.mark_unusable("an operator stopped it"); }).join();
    throw std::runtime_error("injected update error");
  };
  offload_pipeline pipe(stored, *engine, po);
  device_buffer g(*engine, n * 4), p(*engine, n * 4);
  const device_order ready = device_order::after(engine->create_stream());
  CHECK_THROWS_WITH(pipe.step({g.data, n, dtype::f32}, {p.data, n, dtype::f32}, ready),
                    Catch::Contains("the optimizer state is unchanged (it holds step 0") &&
                        !Catch::Contains("load a checkpoint"));
  CHECK_FALSE(stored.usable());
  CHECK(stored.failure_reason() == "an operator stopped it");
  CHECK_THROWS_WITH(stored.step(const_view{g.data, n, dtype::f32}), Catch::Contains("an operator stopped it"));
  stored.close();
  auto reopened = stored_optimizer::open(groups, small_store(dir.str()));
  require_same_as(reopened, reference, groups);
}

TEST_CASE("offload_pipeline over a stored optimizer: a device fault midway keeps the step before and says to reopen") {
  const auto groups = f32_groups();
  const temp_dir dir("stored_pipeline_device");
  auto [reference, stored, n] = start_both(groups, dir);
  host_engine_options eo;
  eo.before_copy = [](copy_direction d, std::uint64_t k) { // the third gradient copy fails, stickily
    if (d == copy_direction::to_host && k == 3) throw std::runtime_error("injected DMA error");
  };
  auto engine = make_host_copy_engine(eo);
  pipeline_options po;
  po.chunk_elems = 1024;
  po.param_type = dtype::f32;
  offload_pipeline pipe(stored, *engine, po);
  device_buffer g(*engine, n * 4), p(*engine, n * 4);
  const device_order ready = device_order::after(engine->create_stream());
  CHECK_THROWS_WITH(pipe.step({g.data, n, dtype::f32}, {p.data, n, dtype::f32}, ready),
                    Catch::Contains("injected DMA error") &&
                        Catch::Contains("the optimizer state is unchanged (it holds step 0") &&
                        Catch::Contains("the pipeline refuses from now on (reopen the optimizer") &&
                        !Catch::Contains("reset_failure"));
  CHECK_FALSE(pipe.usable());
  CHECK_FALSE(stored.usable());
  CHECK_THAT(stored.failure_reason(), Catch::Contains("injected DMA error") && Catch::Contains("reopen it") &&
                                          !Catch::Contains("reset_failure"));
  stored.close();
  auto reopened = stored_optimizer::open(groups, small_store(dir.str()));
  require_same_as(reopened, reference, groups);
}

TEST_CASE("stored_optimizer: adopt_at_next_step sets masters at the next applied step, whole or chunked, kept "
          "across skipped and failed steps") {
  // The in-RAM optimizer's parameters are its masters: a front writes them, then steps. The
  // store takes such values as the next applied step reads their chunks.
  const auto groups = mixed_groups();
  const temp_dir dir("stored_adopt_next");
  auto [reference, stored, n] = start_both(groups, dir);
  const std::vector<segment> segs(reference.segments().begin(), reference.segments().end());
  REQUIRE(segs.size() >= 3);
  // Two tensors' values (one spanning several of the store's 512-element chunks, cut by the ranges).
  std::vector<arena_range> adopt;
  std::vector<float> values;
  for (std::size_t t : {std::size_t(0), segs.size() - 1}) {
    adopt.push_back({segs[t].offset, segs[t].offset + segs[t].size});
    for (std::size_t i = 0; i < segs[t].size; ++i) values.push_back(0.25f + 0.001f * float(i % 97));
  }
  std::sort(adopt.begin(), adopt.end(), [](auto& a, auto& b) { return a.begin < b.begin; });
  auto set_reference = [&] {
    std::size_t at = 0;
    for (const arena_range& r : adopt)
      for (std::size_t i = r.begin; i < r.end; ++i) reference.params()[i] = values[at++];
  };
  // Refused, nothing pending: unsorted or overlapping ranges, the wrong number of values.
  const std::vector<arena_range> backwards{adopt[1], adopt[0]};
  CHECK_THROWS_WITH(stored.adopt_at_next_step(backwards, values), Catch::Contains("sorted, disjoint"));
  CHECK_THROWS_WITH(stored.adopt_at_next_step(adopt, std::span<const float>(values).first(3)),
                    Catch::Contains("3 values for ranges of"));
  CHECK(stored.pending_adoption() == 0);

  stored.adopt_at_next_step(adopt, values);
  CHECK(stored.pending_adoption() == values.size());
  // A skipped step keeps it (in RAM, the values were adopted before the skipped step).
  step_options checked{1.0f, 0.0, true, std::numeric_limits<double>::infinity()};
  const auto grad1 = to_bf16(grad_of(n, 1)), grad2 = to_bf16(grad_of(n, 2)), grad3 = to_bf16(grad_of(n, 3));
  std::vector<std::uint16_t> out(n), out_ram(n);
  CHECK_FALSE(chunked_step(stored, 224, grad1, out, nullptr, checked).applied);
  CHECK(stored.pending_adoption() == values.size());
  // A chunked step that fails midway keeps it: the store holds the step before.
  REQUIRE(stored.begin_step({dtype::bf16, true, dtype::bf16, false, {1.0f, 0.0, false, -1.0}, {}}).applied);
  stored.update_range(0, 640, grad1.data(), out.data());
  stored.abort_step("injected");
  CHECK(stored.pending_adoption() == values.size());
  // The chunked step applies it (ranges of 224 cut the adopted tensors and the chunks).
  set_reference();
  reference.step(const_view{grad1.data(), n, dtype::bf16}, mut_view{out_ram.data(), n, dtype::bf16},
                 step_options{1.0f, 0.0, true, std::numeric_limits<double>::infinity()});
  chunked_step(reference, 224, grad1, out_ram, nullptr);
  CHECK(chunked_step(stored, 224, grad1, out, nullptr).applied);
  CHECK(out == out_ram);
  CHECK(stored.pending_adoption() == 0);
  require_same_as(stored, reference, groups);
  // And the whole step (another set of values), committed with it: a reopened store has them.
  for (float& v : values) v = -v;
  stored.adopt_at_next_step(adopt, values);
  set_reference();
  stored.step(const_view{grad2.data(), n, dtype::bf16}, {}, 1.0f);
  reference.step(const_view{grad2.data(), n, dtype::bf16}, {}, 1.0f);
  stored.adopt_at_next_step(adopt, values); // (no step commits it: lost with the store)
  stored.close();
  CHECK(stored.pending_adoption() == 0);
  auto reopened = stored_optimizer::open(groups, small_store(dir.str()));
  CHECK(reopened.pending_adoption() == 0);
  require_same_as(reopened, reference, groups);
  // An empty call clears what is pending.
  reopened.adopt_at_next_step(adopt, values);
  reopened.adopt_at_next_step({}, {});
  chunked_step(reopened, 448, grad3, out, nullptr);
  chunked_step(reference, 448, grad3, out_ram, nullptr);
  require_same_as(reopened, reference, groups);
}

TEST_CASE("stored_optimizer: per-tensor steps, whole and chunked, give the in-RAM optimizer's bits and counts, "
          "kept by every commit") {
  const auto groups = mixed_groups(); // tensors: emb norm empty | attn bias | mlp head proj
  const temp_dir dir("stored_per_tensor");
  auto [reference, stored, n] = start_both(groups, dir);
  struct planned {
    bool whole;
    std::vector<std::size_t> without;
    bool accumulate;
  };
  // Tensors of every format without a gradient, one named twice, the empty one; whole steps
  // (the flat step) and chunked ones over ranges cutting the chunks and the tensors.
  const planned plan[] = {{false, {}, false},     {false, {1, 5}, true}, {true, {0, 6, 6}, false},
                          {false, {3, 2}, false}, {true, {}, false},     {true, {5, 7, 4}, false}};
  std::int64_t t = 0;
  std::vector<std::int64_t> counts_before_last;
  for (const planned& p : plan) {
    INFO("step " << t + 1);
    counts_before_last = stored.tensor_steps();
    const auto grad = to_bf16(grad_of(n, ++t));
    std::vector<float> acc = grad_of(n, 100 + t);
    std::vector<std::uint16_t> out_stored(n, 0xFFFF), out_ram(n, 0xFFFF);
    if (p.whole) {
      const step_result a = stored.step(const_view{grad.data(), n, dtype::bf16}, mut_view{out_stored.data(), n, dtype::bf16},
                                        step_options{1.0f, 0.0, true, -1.0}, {}, {}, p.without);
      CHECK(a.applied);
    } else {
      CHECK(chunked_step(stored, 160, grad, out_stored, p.accumulate ? &acc : nullptr, {1.0f, 0.0, false, -1.0},
                         p.without)
                .applied);
    }
    CHECK(chunked_step(reference, n, grad, out_ram, p.accumulate ? &acc : nullptr, {1.0f, 0.0, false, -1.0},
                       p.without)
              .applied);
    for (const segment& seg : reference.segments()) // (the padding is no tensor's)
      REQUIRE(std::memcmp(out_stored.data() + seg.offset, out_ram.data() + seg.offset, seg.size * 2) == 0);
    REQUIRE(stored.tensor_steps() == reference.tensor_steps());
    require_same_as(stored, reference, groups);
  }
  const std::vector<std::int64_t> counts = reference.tensor_steps();
  REQUIRE(counts == std::vector<std::int64_t>{5, 5, 5, 5, 5, 4, 5, 5}); // (6 steps: each tensor missed some)
  CHECK(counts_before_last != counts);
  // The streamed export is the in-RAM save's file, per-tensor counts included.
  const fs::path streamed = dir.path / "streamed.safetensors", in_ram = dir.path / "in_ram.safetensors";
  stored.save_checkpoint(streamed.string());
  save_checkpoint(reference, in_ram.string());
  {
    std::ifstream a(streamed, std::ios::binary), b(in_ram, std::ios::binary);
    const std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
    REQUIRE(sa == sb);
  }
  // Reopened: the counts, and the next step's bits.
  stored.close();
  std::vector<std::int64_t> last_counts;
  {
    auto reopened = stored_optimizer::open(groups, small_store(dir.str()));
    CHECK(reopened.recovery().empty());
    REQUIRE(reopened.tensor_steps() == counts);
    const auto grad = to_bf16(grad_of(n, 50));
    std::vector<std::uint16_t> out_stored(n), out_ram(n);
    optimizer next(groups);
    reopened.copy_state_to(next);
    REQUIRE(next.tensor_steps() == counts);
    chunked_step(reopened, 96, grad, out_stored, nullptr, {1.0f, 0.0, false, -1.0}, {0});
    chunked_step(next, n, grad, out_ram, nullptr, {1.0f, 0.0, false, -1.0}, {0});
    REQUIRE(reopened.tensor_steps() == next.tensor_steps());
    require_same_as(reopened, next, groups);
    last_counts = next.tensor_steps();
  }
  // The step before's counts unreadable (its place of the record corrupt: commit 6, the even
  // place): open_previous refuses before it rolls anything back, and the store still opens at
  // its last step.
  const fs::path counts_record = dir.path / "tensor_steps";
  flip_bit(counts_record, 40);
  CHECK_THROWS_WITH(stored_optimizer::open_previous(groups, small_store(dir.str())),
                    Catch::Contains("cannot go back from step_count 7") && Catch::Contains("corrupt") &&
                        Catch::Contains("nothing was rolled back"));
  REQUIRE(stored_optimizer::open(groups, small_store(dir.str())).tensor_steps() == last_counts);
  flip_bit(counts_record, 40); // (mended)
  {
    auto previous = stored_optimizer::open_previous(groups, small_store(dir.str()));
    REQUIRE(previous.tensor_steps() == counts); // (the step before the last: the 7th step undone)
  }
  // An import keeps the in-RAM optimizer's counts.
  const temp_dir imported_dir("stored_per_tensor_import");
  {
    auto imported = stored_optimizer::create(reference, groups, small_store(imported_dir.str()));
    REQUIRE(imported.tensor_steps() == counts);
    imported.close();
    REQUIRE(stored_optimizer::open(groups, small_store(imported_dir.str())).tensor_steps() == counts);
  }
  // The counts' record unreadable (both places corrupt): open refuses, naming it, rather than
  // step with other bias corrections.
  const fs::path record = imported_dir.path / "tensor_steps";
  REQUIRE(fs::exists(record));
  flip_bit(record, 40);
  flip_bit(record, fs::file_size(record) / 2 + 40);
  CHECK_THROWS_WITH(stored_optimizer::open(groups, small_store(imported_dir.str())),
                    Catch::Contains("own step counts of step 6 cannot be read") && Catch::Contains("tensor_steps") &&
                        Catch::Contains("corrupt"));
}

TEST_CASE("stored_optimizer: a store of a shard refuses per-tensor steps, whole and chunked, changing nothing") {
  const auto groups = mixed_groups();
  const temp_dir dir("stored_per_tensor_shard");
  state_store_options o = small_store(dir.str());
  o.range = shard_of(groups, 2, 0);
  auto stored = stored_optimizer::create(groups, o);
  const std::size_t n = stored.arena_size();
  const std::vector<float> grad = grad_of(n, 1);
  const std::vector<std::size_t> without{1};
  CHECK_THROWS_WITH(stored.step(const_view{grad.data(), n, dtype::f32}, {}, step_options{1.0f, 0.0, false, -1.0}, {},
                                {}, without),
                    Catch::Contains("holds a range of the arena (a shard)"));
  CHECK_THROWS_WITH(stored.begin_step({dtype::f32, false, dtype::f32, false, {1.0f, 0.0, false, -1.0}, without}),
                    Catch::Contains("holds a range of the arena (a shard)"));
  CHECK(stored.step_count() == 0);
  CHECK(stored.step(const_view{grad.data(), n, dtype::f32}).applied);
}
