// The CUDA engine and the pipeline on a real device: copies, events across streams, flags
// that gate copies (both mechanisms), the caller's device kept, sticky errors (a real
// illegal address, in a child process since it ends the CUDA context), the pipeline
// bit-identical to the synchronous step, and its device contract on real streams: gradients
// written late by a kernel, the step ordered by an event, params_ready() waited on by a
// stream right after step_async returns. Without a device this program exits 77, which
// CTest reports as skipped (SKIP_RETURN_CODE).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include <cuda_runtime_api.h>

#include "hostopt/offload_pipeline.hpp"
#include "hostopt/optimizer.hpp"
#if defined(HOSTOPT_TEST_HAVE_KERNELS)
#include "cuda_test_kernels.hpp"
#endif

using namespace hostopt;

namespace {

std::int64_t host_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The gradients of the late "backward" (the kernels' formula when they are built).
float test_gradient(std::size_t i, int seed) {
#if defined(HOSTOPT_TEST_HAVE_KERNELS)
  return hostopt_test::test_gradient(i, seed);
#else
  const std::uint32_t h = std::uint32_t(i) * 2654435761u + std::uint32_t(seed) * 40503u;
  return float(int(h % 2001u) - 1000) * 1e-3f;
#endif
}

// Device work on `s` that takes `ms` before the work after it: a spin kernel, or without
// a CUDA compiler a host function that sleeps.
void delay(copy_engine& e, device_stream s, int ms) {
#if defined(HOSTOPT_TEST_HAVE_KERNELS)
  (void)e;
  hostopt_test::launch_spin(s.handle, std::uint64_t(ms) * 1'000'000);
#else
  e.launch_host_function(s, [ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
#endif
}

// A "backward" on `s` that writes gradients of step `seed` into `dgrad` only after `ms`.
// `staging` (pinned, n floats) is the source of the fallback's copy.
void late_gradients(copy_engine& e, device_stream s, float* dgrad, std::size_t n, int seed, int ms,
                    float* staging) {
#if defined(HOSTOPT_TEST_HAVE_KERNELS)
  (void)e;
  (void)staging;
  hostopt_test::launch_late_gradients(s.handle, dgrad, n, seed, std::uint64_t(ms) * 1'000'000);
#else
  for (std::size_t i = 0; i < n; ++i) staging[i] = test_gradient(i, seed);
  delay(e, s, ms);
  e.copy_async(s, copy_direction::to_device, dgrad, staging, n * 4);
#endif
}

// Device memory of the engine, freed with it.
struct device_buffer {
  copy_engine& engine;
  void* data;
  device_buffer(copy_engine& e, std::size_t bytes) : engine(e), data(e.allocate_device(bytes)) {}
  ~device_buffer() { engine.free_device(data); }
};

// An engine with the flag mechanism forced by HOSTOPT_CUDA_FLAG_WAIT ("" = automatic).
std::unique_ptr<copy_engine> engine_with_flags(const std::string& mechanism) {
  if (mechanism.empty())
    unsetenv("HOSTOPT_CUDA_FLAG_WAIT");
  else
    setenv("HOSTOPT_CUDA_FLAG_WAIT", mechanism.c_str(), 1);
  auto e = make_cuda_copy_engine(0);
  unsetenv("HOSTOPT_CUDA_FLAG_WAIT");
  return e;
}

bool same_state(const optimizer& a, const optimizer& b) {
  const std::size_t bytes = a.arena_size() * 4;
  return std::memcmp(a.params().data(), b.params().data(), bytes) == 0 &&
         std::memcmp(a.exp_avg().data(), b.exp_avg().data(), bytes) == 0 &&
         std::memcmp(a.exp_avg_sq().data(), b.exp_avg_sq().data(), bytes) == 0;
}

std::vector<param_group> test_model() {
  adam_config c;
  c.weight_decay = 0.01;
  return {{c, {{"a", {300007}}, {"b", {77}}, {"c", {4099}}}}};
}

// The device parameters (bf16) equal the synchronous copy-out on every tensor element.
bool same_device_params(const optimizer& sync, const std::uint16_t* device_copy,
                        const std::vector<std::uint16_t>& out) {
  for (const auto& s : sync.segments())
    if (std::memcmp(device_copy + s.offset, out.data() + s.offset, s.size * 2) != 0) return false;
  return true;
}

#if defined(HOSTOPT_TEST_HAVE_KERNELS)
// The child of the sticky-error test: a kernel faults; the engine must name it, keep it,
// and refuse every later call with that text. Prints one line per finding.
int illegal_address_child_body() {
  auto engine = make_cuda_copy_engine(0);
  const device_stream s = engine->create_stream();
  hostopt_test::launch_fault(s.handle);
  std::string first;
  try {
    engine->synchronize_stream(s);
    std::puts("synchronize_stream did not throw");
    return 1;
  } catch (const std::runtime_error& e) {
    first = e.what();
  }
  std::printf("thrown: %s\n", first.c_str());
  std::printf("sticky: %s\n", engine->sticky_error().c_str());
  if (engine->sticky_error() != first) return 2;
  try {
    engine->create_event();
    return 3;
  } catch (const std::runtime_error& e) {
    if (first != e.what()) return 4;
  }
  try {
    char byte = 0;
    engine->copy_async(s, copy_direction::to_host, &byte, &byte, 1);
    return 5;
  } catch (const std::runtime_error& e) {
    if (first != e.what()) return 6;
  }
  std::puts("every later call threw the sticky text");
  return 0;
}

int illegal_address_child() {
  try {
    return illegal_address_child_body();
  } catch (const std::exception& e) {
    std::printf("unexpected exception: %s\n", e.what());
    return 10;
  }
}
#endif

} // namespace

int main(int argc, char** argv) {
#if defined(HOSTOPT_TEST_HAVE_KERNELS)
  if (argc == 2 && std::strcmp(argv[1], "--illegal-address-child") == 0) return illegal_address_child();
#endif
  if (!cuda_device_available()) {
    std::puts("no CUDA device: skipping the CUDA tests");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}

TEST_CASE("the CUDA engine copies both ways; event times lie on steady_clock", "[cuda][engine]") {
  auto engine = make_cuda_copy_engine(0);
  CHECK(engine->name() == "cuda");
  const std::size_t n = std::size_t(1) << 22;
  pinned_buffer a(*engine, n * 4), b(*engine, n * 4);
  CHECK(a.locked());
  for (std::size_t i = 0; i < n; ++i) static_cast<float*>(a.data())[i] = float(i);
  device_buffer dev(*engine, n * 4);
  const device_stream s = engine->create_stream();
  const device_event start = engine->create_event(), end = engine->create_event();
  const std::int64_t before = host_now_ns();
  engine->record_event(start, s);
  engine->copy_async(s, copy_direction::to_device, dev.data, a.data(), n * 4);
  engine->copy_async(s, copy_direction::to_host, b.data(), dev.data, n * 4);
  engine->record_event(end, s);
  engine->synchronize_event(end);
  const std::int64_t after = host_now_ns();
  CHECK(engine->event_done(end));
  CHECK(std::memcmp(a.data(), b.data(), n * 4) == 0);
  const std::int64_t t0 = engine->event_time_ns(start), t1 = engine->event_time_ns(end);
  INFO("host window [" << before << ", " << after << "], events " << t0 << " .. " << t1);
  CHECK(t1 > t0);                // 32 MiB both ways take far more than the timer's resolution
  CHECK(t0 >= before - 200'000); // the time base is good to well under 0.2 ms
  CHECK(t1 <= after + 200'000);
  engine->destroy_event(start);
  engine->destroy_event(end);
  engine->destroy_stream(s);
}

TEST_CASE("a stream waits for another stream's event; an event never recorded is no wait", "[cuda][engine]") {
  auto engine = make_cuda_copy_engine(0);
  const std::size_t n = 1 << 20;
  pinned_buffer src(*engine, n * 4), dst(*engine, n * 4);
  device_buffer dev(*engine, n * 4);
  std::memset(src.data(), 0x11, n * 4);
  const device_stream setup = engine->create_stream(), writer = engine->create_stream(),
                      reader = engine->create_stream();
  engine->copy_async(setup, copy_direction::to_device, dev.data, src.data(), n * 4);
  engine->synchronize_stream(setup);
  pinned_buffer fresh(*engine, n * 4);
  std::memset(fresh.data(), 0x22, n * 4);
  const device_event written = engine->create_event(), never = engine->create_event();
  delay(*engine, writer, 50); // the writer is late: the reader must not copy before it
  engine->copy_async(writer, copy_direction::to_device, dev.data, fresh.data(), n * 4);
  engine->record_event(written, writer);
  engine->stream_wait_event(reader, never);
  engine->stream_wait_event(reader, written);
  engine->copy_async(reader, copy_direction::to_host, dst.data(), dev.data, n * 4);
  CHECK_FALSE(engine->event_done(written));
  engine->synchronize_stream(reader);
  CHECK(engine->event_done(written));
  CHECK(std::memcmp(dst.data(), fresh.data(), n * 4) == 0);
  // A stream that only waits on the never-recorded event runs at once.
  const device_event marker = engine->create_event();
  engine->stream_wait_event(setup, never);
  engine->record_event(marker, setup);
  engine->synchronize_event(marker);
  for (auto s : {setup, writer, reader}) engine->destroy_stream(s);
}

TEST_CASE("a flag-gated copy runs only after write_flag, with either flag mechanism",
          "[cuda][engine][flag]") {
  for (const std::string mechanism : {"", "host_function"}) {
    auto engine = engine_with_flags(mechanism);
    INFO("flag mechanism: " << engine->flag_mechanism());
    if (mechanism == "host_function")
      CHECK(engine->flag_mechanism() == "host function (cudaLaunchHostFunc) blocking the stream");
    else
      WARN("automatic flag mechanism: " << engine->flag_mechanism());
    const std::size_t n = 1 << 16;
    pinned_buffer host(*engine, n * 4), back(*engine, n * 4);
    std::memset(host.data(), 0x5a, n * 4);
    std::memset(back.data(), 0, n * 4);
    device_buffer dev(*engine, n * 4);
    const device_stream s = engine->create_stream();
    engine->copy_async(s, copy_direction::to_device, dev.data, host.data(), n * 4);
    const device_flag f = engine->allocate_flag();
    const device_event done = engine->create_event();
    engine->stream_wait_flag(s, f, 1);
    engine->copy_async(s, copy_direction::to_host, back.data(), dev.data, n * 4);
    engine->record_event(done, s);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    CHECK_FALSE(engine->event_done(done));
    CHECK(static_cast<unsigned char*>(back.data())[0] == 0);
    engine->write_flag(f, 1);
    engine->synchronize_event(done);
    CHECK(std::memcmp(back.data(), host.data(), n * 4) == 0);

    // Wrap-safe: 0xfffffff0 is "before" 5, and 10 is "after" it.
    engine->write_flag(f, 0xfffffff0u);
    engine->stream_wait_flag(s, f, 5);
    engine->record_event(done, s);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK_FALSE(engine->event_done(done));
    engine->write_flag(f, 10);
    engine->synchronize_event(done);
    engine->destroy_stream(s);
    engine->free_flag(f);
  }
}

TEST_CASE("every engine call leaves the caller's current device as it was", "[cuda][engine]") {
  int count = 0;
  REQUIRE(cudaGetDeviceCount(&count) == cudaSuccess);
  const int engine_device = count > 1 ? 1 : 0;
  auto engine = make_cuda_copy_engine(engine_device);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  auto still_zero = [] {
    int d = -1;
    return cudaGetDevice(&d) == cudaSuccess && d == 0;
  };
  const device_stream s = engine->create_stream();
  CHECK(still_zero());
  const device_event e = engine->create_event();
  device_buffer dev(*engine, 4096);
  pinned_buffer host(*engine, 4096);
  CHECK(still_zero());
  engine->copy_async(s, copy_direction::to_device, dev.data, host.data(), 4096);
  engine->record_event(e, s);
  CHECK(still_zero());
  engine->synchronize_event(e);
  (void)engine->event_done(e);
  (void)engine->event_time_ns(e);
  engine->synchronize_stream(s);
  CHECK(still_zero());
  if (engine_device == 1) {
    // The memory is on device 1 although device 0 was current at every call.
    cudaPointerAttributes attr{};
    REQUIRE(cudaPointerGetAttributes(&attr, dev.data) == cudaSuccess);
    CHECK(attr.device == 1);
  } else {
    WARN("one device only: the device switch itself is not exercised");
  }
  engine->destroy_event(e);
  engine->destroy_stream(s);
  CHECK(still_zero());
}

TEST_CASE("misuse throws and leaves the engine usable; a failed host function is sticky",
          "[cuda][engine][errors]") {
  auto engine = make_cuda_copy_engine(0);
  const device_stream s = engine->create_stream();
  const device_event never = engine->create_event();
  CHECK_THROWS_AS(engine->event_time_ns(never), std::invalid_argument);
  char byte = 0;
  CHECK_THROWS_AS(engine->copy_async({}, copy_direction::to_host, &byte, &byte, 1), std::invalid_argument);
  CHECK(engine->sticky_error().empty());

  const device_event e = engine->create_event();
  engine->launch_host_function(s, [] { throw std::runtime_error("the model's backward failed"); });
  // The function runs on CUDA's callback thread; any call may see its error from then on.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (engine->sticky_error().empty() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const std::string text = engine->sticky_error();
  CHECK(text.find("host function") != std::string::npos);
  CHECK(text.find("the model's backward failed") != std::string::npos);
  for (auto call : std::initializer_list<std::function<void()>>{
           [&] { engine->record_event(e, s); }, [&] { engine->synchronize_stream(s); },
           [&] { engine->create_stream(); }, [&] { engine->allocate_device(16); }}) {
    try {
      call();
      FAIL("a call after the sticky error did not throw");
    } catch (const std::runtime_error& x) {
      CHECK(std::string(x.what()) == text);
    }
  }
}

#if defined(HOSTOPT_TEST_HAVE_KERNELS)
TEST_CASE("an illegal address in a kernel is sticky: named, kept, thrown by every later call",
          "[cuda][engine][errors]") {
  // The fault ends this process's CUDA context, so it happens in a child.
  FILE* child = popen("/proc/self/exe --illegal-address-child 2>&1", "r");
  REQUIRE(child != nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, child)) out += buf;
  const int status = pclose(child);
  INFO(out);
  CHECK(status == 0);
  CHECK(out.find("cudaErrorIllegalAddress") != std::string::npos);
  CHECK(out.find("every later call threw the sticky text") != std::string::npos);
}
#endif

TEST_CASE("the pipeline on the CUDA engine matches the synchronous step bit for bit, with accumulation",
          "[cuda][pipeline]") {
  auto engine = make_cuda_copy_engine(0);
  optimizer piped(test_model()), sync(test_model());
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (std::size_t i = 0; i < piped.arena_size(); ++i) piped.params()[i] = sync.params()[i] = nd(rng);
  pipeline_options po;
  po.chunk_elems = 1 << 15;
  po.grad_type = dtype::f32;
  po.param_type = dtype::bf16;
  offload_pipeline pipe(piped, *engine, po);
  const std::size_t n = piped.arena_size();
  constexpr int micro = 2; // micro-batches accumulated before each step's own
  device_buffer dgrad(*engine, n * 4), dparams(*engine, n * 2);
  std::vector<pinned_buffer> staging;
  for (int mb = 0; mb <= micro; ++mb) staging.emplace_back(*engine, n * 4);
  pinned_buffer params_back(*engine, n * 2);
  const device_stream compute = engine->create_stream();
  const device_event grads_ready = engine->create_event();
  std::vector<std::uint16_t> out(n);
  for (int step = 0; step < 3; ++step) {
    std::vector<float> acc(n, 0.0f); // summed in the pipeline's order: ((g0 + g1) + g2)
    pipeline_handle h;
    for (int mb = 0; mb <= micro; ++mb) {
      auto* g = static_cast<float*>(staging[mb].data());
      for (std::size_t i = 0; i < n; ++i) {
        g[i] = nd(rng);
        acc[i] = mb == 0 ? g[i] : g[i] + acc[i];
      }
      engine->copy_async(compute, copy_direction::to_device, dgrad.data, g, n * 4);
      engine->record_event(grads_ready, compute);
      if (mb < micro)
        h = pipe.accumulate_async({dgrad.data, n, dtype::f32}, device_order::after(grads_ready));
      else
        h = pipe.step_async({dgrad.data, n, dtype::f32}, {dparams.data, n, dtype::bf16},
                            device_order::after(grads_ready), 0.5f);
      // The next micro-batch overwrites the gradients only once they are consumed.
      engine->stream_wait_event(compute, h.grads_consumed());
    }
    const step_result r = h.wait();
    CHECK(r.applied);
    sync.step(const_view{acc.data(), n, dtype::f32}, mut_view{out.data(), n, dtype::bf16}, 0.5f);
    REQUIRE(same_state(piped, sync));
    engine->stream_wait_event(compute, h.params_ready());
    engine->copy_async(compute, copy_direction::to_host, params_back.data(), dparams.data, n * 2);
    engine->synchronize_stream(compute);
    CHECK(same_device_params(sync, static_cast<const std::uint16_t*>(params_back.data()), out));
  }
  engine->destroy_stream(compute);
}

TEST_CASE("the device contract on real streams: late gradients, an ordered step, params_ready at once",
          "[cuda][pipeline][contract]") {
  auto engine = make_cuda_copy_engine(0);
  INFO("flag mechanism: " << engine->flag_mechanism());
  optimizer piped(test_model()), sync(test_model());
  for (std::size_t i = 0; i < piped.arena_size(); ++i)
    piped.params()[i] = sync.params()[i] = 0.25f * float(i % 7);
  pipeline_options po;
  po.chunk_elems = 1 << 15;
  offload_pipeline pipe(piped, *engine, po);
  const std::size_t n = piped.arena_size();
  device_buffer dgrad(*engine, n * 4), dparams(*engine, n * 2);
  pinned_buffer staging(*engine, n * 4), params_back(*engine, n * 2);
  const device_stream compute = engine->create_stream();
  const device_event grads_ready = engine->create_event(), copied_back = engine->create_event();
  pipe.push_params({dparams.data, n, dtype::bf16});
  std::vector<float> g(n);
  std::vector<std::uint16_t> out(n);
  for (int step = 0; step < 3; ++step) {
    const bool by_stream = step == 1; // one step ordered by the stream instead of an event
    INFO("step " << step << (by_stream ? ", ordered after the stream" : ", ordered after an event"));
    // The backward: 40 ms of device work, then the gradients.
    late_gradients(*engine, compute, static_cast<float*>(dgrad.data), n, step, 40,
                   static_cast<float*>(staging.data()));
    engine->record_event(grads_ready, compute);
    const auto order = by_stream ? device_order::after(compute) : device_order::after(grads_ready);
    const auto issued = std::chrono::steady_clock::now();
    pipeline_handle h = pipe.step_async({dgrad.data, n, dtype::f32}, {dparams.data, n, dtype::bf16}, order);
    const auto returned = std::chrono::steady_clock::now();
    // step_async enqueued everything and returned while the backward still runs; its
    // events are already usable by a stream: the next "forward" waits, then reads.
    CHECK(returned - issued < std::chrono::milliseconds(20));
    CHECK_FALSE(engine->event_done(grads_ready));
    REQUIRE(h.params_ready());
    REQUIRE(h.grads_consumed());
    engine->stream_wait_event(compute, h.params_ready());
    engine->stream_wait_event(compute, h.grads_consumed());
    engine->copy_async(compute, copy_direction::to_host, params_back.data(), dparams.data, n * 2);
    engine->record_event(copied_back, compute);
    engine->synchronize_event(copied_back); // the host waits on the stream's copy only
    CHECK(h.wait().applied);
    for (std::size_t i = 0; i < n; ++i) g[i] = test_gradient(i, step);
    sync.step(const_view{g.data(), n, dtype::f32}, mut_view{out.data(), n, dtype::bf16});
    REQUIRE(same_state(piped, sync));
    CHECK(same_device_params(sync, static_cast<const std::uint16_t*>(params_back.data()), out));
  }
  engine->destroy_stream(compute);
}

// Hidden (run by hand with a timeout): the whole pipeline on the host-function fallback,
// whose blocked callbacks share CUDA's one host-function thread with every stream.
TEST_CASE("the pipeline on the host-function flag fallback", "[.][cuda][pipeline][fallback]") {
  auto engine = engine_with_flags("host_function");
  REQUIRE(engine->flag_mechanism() == "host function (cudaLaunchHostFunc) blocking the stream");
  optimizer piped(test_model()), sync(test_model());
  pipeline_options po;
  po.chunk_elems = 1 << 14;
  offload_pipeline pipe(piped, *engine, po);
  const std::size_t n = piped.arena_size();
  device_buffer dgrad(*engine, n * 4), dparams(*engine, n * 2);
  pinned_buffer staging(*engine, n * 4);
  const device_stream compute = engine->create_stream();
  std::vector<float> g(n);
  std::vector<std::uint16_t> out(n);
  for (int step = 0; step < 3; ++step) {
    late_gradients(*engine, compute, static_cast<float*>(dgrad.data), n, step, 5,
                   static_cast<float*>(staging.data()));
    pipeline_handle h = pipe.step_async({dgrad.data, n, dtype::f32}, {dparams.data, n, dtype::bf16},
                                        device_order::after(compute));
    engine->stream_wait_event(compute, h.grads_consumed());
    CHECK(h.wait().applied);
    for (std::size_t i = 0; i < n; ++i) g[i] = test_gradient(i, step);
    sync.step(const_view{g.data(), n, dtype::f32}, mut_view{out.data(), n, dtype::bf16});
    REQUIRE(same_state(piped, sync));
  }
  engine->synchronize_stream(compute);
  engine->destroy_stream(compute);
}
