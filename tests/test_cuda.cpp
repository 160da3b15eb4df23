// The CUDA engine and the pipeline on a real device: copies, events across streams, flags
// that gate copies (both mechanisms), the caller's device kept and no context created on a
// thread that had none (in a child process, which starts without contexts), the trainer's
// pending launch error left alone, sticky errors (a real illegal address, in a child
// process since it ends the CUDA context), flag waits that never outlive a failed or
// destroyed engine, the pipeline bit-identical to the synchronous step, and its device
// contract on real streams: a missing dependency refused, a misplaced one giving stale
// gradients, gradients written late by a kernel, the step ordered by an event,
// params_ready() waited on by a stream right after step_async returns, and trainer loops
// (accumulation, synchronous step, delayed parameter update) with the synchronous loop's
// bits. Without a device this program exits 77, which CTest reports as skipped
// (SKIP_RETURN_CODE).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <cuda.h> // types only: driver functions come through the runtime's entry point
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "child_process.hpp"
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

#if !defined(HOSTOPT_TEST_HAVE_KERNELS)
// Device work on `s` that takes `ms` before the work after it, without a CUDA compiler:
// a host function that sleeps.
void delay(copy_engine& e, device_stream s, int ms) {
  e.launch_host_function(s, [ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
}
#endif

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

float bf16_to_float(std::uint16_t b) {
  const std::uint32_t bits = std::uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

constexpr std::uint64_t gate_timeout_ns = 30'000'000'000; // a failing test frees the device

// A word in page-locked host memory that device work waits on until the host opens it.
// Every device with unified addressing reads page-locked host memory directly.
struct host_gate {
  pinned_buffer word;
  explicit host_gate(copy_engine& e) : word(e, 4) { std::memset(word.data(), 0, 4); }
  std::uint32_t* data() const { return static_cast<std::uint32_t*>(word.data()); }
  void open() { std::atomic_ref<std::uint32_t>(*data()).store(1, std::memory_order_release); }
  bool is_open() const {
    return std::atomic_ref<std::uint32_t>(*data()).load(std::memory_order_acquire) != 0;
  }
};

// Device work on `s` that waits until `g` opens (a kernel; without a CUDA compiler a host
// function, which blocks CUDA's one callback thread meanwhile).
void wait_gate(copy_engine& e, device_stream s, host_gate& g) {
#if defined(HOSTOPT_TEST_HAVE_KERNELS)
  (void)e;
  hostopt_test::launch_wait_word(s.handle, g.data(), gate_timeout_ns);
#else
  e.launch_host_function(s, [gp = &g] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(gate_timeout_ns);
    while (!gp->is_open() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
  });
#endif
}

// A "backward" on `s` that writes the gradients of step `seed` into `dgrad` only once the
// host opens `g`: deterministic lateness. `staging` (pinned, n floats) feeds the fallback.
void gated_gradients(copy_engine& e, device_stream s, host_gate& g, float* dgrad, std::size_t n, int seed,
                     float* staging) {
#if defined(HOSTOPT_TEST_HAVE_KERNELS)
  (void)e;
  (void)staging;
  hostopt_test::launch_gated_gradients(s.handle, g.data(), dgrad, n, seed, gate_timeout_ns);
#else
  for (std::size_t i = 0; i < n; ++i) staging[i] = test_gradient(i, seed);
  wait_gate(e, s, g);
  e.copy_async(s, copy_direction::to_device, dgrad, staging, n * 4);
#endif
}

// A gate made of a host function holds CUDA's callback thread, which the host-function
// flag fallback needs for the pipeline's own waits: that combination would deadlock.
bool gates_need_the_callback_thread(const copy_engine& e) {
#if defined(HOSTOPT_TEST_HAVE_KERNELS)
  (void)e;
  return false;
#else
  return e.flag_mechanism().rfind("host function", 0) == 0;
#endif
}

// The trainer loops' model: gradient of 0.5 |w - target - offset|^2 at the bf16 parameters
// w, g = (w - target) + offset, with the sin targets computed once on the host (and
// uploaded), so device and host compute the very same two additions.
struct loop_model {
  copy_engine& engine;
  std::size_t n;
  std::vector<float> targets;
  device_buffer device_targets;
  pinned_buffer staging_params, staging_grads; // the fallback's (no CUDA compiler)

  loop_model(copy_engine& e, std::size_t n_, device_stream s)
      : engine(e), n(n_), targets(n_), device_targets(e, n_ * 4), staging_params(e, n_ * 2),
        staging_grads(e, n_ * 4) {
    for (std::size_t i = 0; i < n; ++i) targets[i] = std::sin(0.001f * float(i));
    std::memcpy(staging_grads.data(), targets.data(), n * 4);
    e.copy_async(s, copy_direction::to_device, device_targets.data, staging_grads.data(), n * 4);
    e.synchronize_stream(s);
  }
  static float offset(int micro_batch) { return 0.01f * float(micro_batch % 3 - 1); }

  void host(const std::uint16_t* w, float* g, int micro_batch) const {
    const float off = offset(micro_batch);
    for (std::size_t i = 0; i < n; ++i) g[i] = (bf16_to_float(w[i]) - targets[i]) + off;
  }
  // Forward + backward of one micro-batch on `s`: reads `params`, writes `grads`.
  void device(device_stream s, const std::uint16_t* params, float* grads, int micro_batch) {
#if defined(HOSTOPT_TEST_HAVE_KERNELS)
    hostopt_test::launch_model_gradient(s.handle, params, static_cast<const float*>(device_targets.data),
                                        grads, n, offset(micro_batch));
#else
    auto* w = static_cast<std::uint16_t*>(staging_params.data());
    auto* g = static_cast<float*>(staging_grads.data());
    engine.copy_async(s, copy_direction::to_host, w, params, n * 2);
    engine.launch_host_function(s, [this, w, g, micro_batch] { host(w, g, micro_batch); });
    engine.copy_async(s, copy_direction::to_device, grads, g, n * 4);
#endif
  }
};

// A driver function through the runtime's entry point (the test links cudart only).
template <class Fn> Fn driver_function(const char* symbol, unsigned version) {
  void* fn = nullptr;
#if CUDART_VERSION >= 12050
  cudaDriverEntryPointQueryResult found{};
  const bool ok =
      cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &found) == cudaSuccess &&
      found == cudaDriverEntryPointSuccess;
#elif CUDART_VERSION >= 12000
  (void)version;
  cudaDriverEntryPointQueryResult found{};
  const bool ok = cudaGetDriverEntryPoint(symbol, &fn, cudaEnableDefault, &found) == cudaSuccess &&
                  found == cudaDriverEntryPointSuccess;
#else
  (void)version;
  const bool ok = cudaGetDriverEntryPoint(symbol, &fn, cudaEnableDefault) == cudaSuccess;
#endif
  if (!ok) (void)cudaGetLastError(); // the test's own failed call
  return ok ? reinterpret_cast<Fn>(fn) : nullptr;
}

// The child of the context test, started with no context anywhere: an engine on the last
// device, used from this thread and from a new one, must leave both threads without a
// current context and create none on device 0. Prints one line per finding.
int context_child_body() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
    std::puts("no device");
    return 20;
  }
  const auto get_current = driver_function<PFN_cuCtxGetCurrent_v4000>("cuCtxGetCurrent", 4000);
  const auto device_get = driver_function<PFN_cuDeviceGet_v2000>("cuDeviceGet", 2000);
  const auto get_state =
      driver_function<PFN_cuDevicePrimaryCtxGetState_v7000>("cuDevicePrimaryCtxGetState", 7000);
  if (!get_current || !device_get || !get_state) {
    std::puts("the driver's entry point lacks a context function");
    return 21;
  }
  const auto has_context = [&] {
    CUcontext c = nullptr;
    return get_current(&c) != CUDA_SUCCESS || c != nullptr;
  };
  CUdevice zero = 0;
  if (device_get(&zero, 0) != CUDA_SUCCESS) return 22;
  const auto device0_active = [&] {
    unsigned flags = 0;
    int active = -1;
    return get_state(zero, &flags, &active) == CUDA_SUCCESS ? active : -1;
  };
  const int dev = count - 1;
  const int active_before = device0_active();
  auto engine = make_cuda_copy_engine(dev);
  if (has_context()) {
    std::puts("the engine's constructor left a context current");
    return 1;
  }
  std::string failure;
  std::thread worker([&] { // the pipeline's worker thread starts like this: no context
    try {
      if (has_context()) {
        failure = "a new thread has a context";
        return;
      }
      const device_stream s = engine->create_stream();
      const device_event e = engine->create_event();
      {
        pinned_buffer host(*engine, 4096);
        device_buffer dev_mem(*engine, 4096);
        const device_flag f = engine->allocate_flag();
        engine->copy_async(s, copy_direction::to_device, dev_mem.data, host.data(), 4096);
        engine->stream_wait_flag(s, f, 1);
        engine->write_flag(f, 1);
        engine->record_event(e, s);
        engine->synchronize_event(e);
        (void)engine->event_done(e);
        (void)engine->event_time_ns(e);
        engine->synchronize_stream(s);
        engine->free_flag(f);
      }
      engine->destroy_event(e);
      engine->destroy_stream(s);
      if (has_context()) failure = "an engine call left a context current on a thread that had none";
    } catch (const std::exception& x) {
      failure = std::string("unexpected exception: ") + x.what();
    }
  });
  worker.join();
  if (!failure.empty()) {
    std::printf("%s\n", failure.c_str());
    return 2;
  }
  engine.reset();
  if (has_context()) {
    std::puts("the engine's destructor left a context current");
    return 3;
  }
  if (dev == 0)
    std::puts("one device: device 0's context is the engine's own (not checked)");
  else if (active_before != 0)
    std::puts("device 0's primary context was active before the engine (not checked)");
  else if (device0_active() != 0) {
    std::puts("a context appeared on device 0");
    return 4;
  } else
    std::puts("no context on device 0");
  std::puts("no thread was left with a context");
  return 0;
}

int context_child() {
  try {
    return context_child_body();
  } catch (const std::exception& e) {
    std::printf("unexpected exception: %s\n", e.what());
    return 10;
  }
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

// The child of the teardown-after-fault test: an engine host function queued on a trainer's
// stream behind a fault, which CUDA will never call; destroying the engine must not wait
// for it. (Enqueued during the spin before the fault; should the fault come first, the
// enqueue throws the sticky error and the destructor has nothing to wait for.)
int destroy_after_fault_child() {
  try {
    auto engine = make_cuda_copy_engine(0);
    cudaStream_t own = nullptr;
    if (cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking) != cudaSuccess) return 2;
    hostopt_test::launch_spin(own, 50'000'000);
    hostopt_test::launch_fault(own);
    try {
      engine->launch_host_function(device_stream{own}, [] { std::puts("a host function ran after the fault"); });
    } catch (const std::runtime_error&) {
    }
    engine.reset();
    std::puts("engine destroyed after the fault");
    return 0;
  } catch (const std::exception& e) {
    std::printf("unexpected exception: %s\n", e.what());
    return 10;
  }
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
  if (argc == 2 && std::strcmp(argv[1], "--destroy-after-fault-child") == 0) return destroy_after_fault_child();
#endif
  if (argc == 2 && std::strcmp(argv[1], "--context-child") == 0) return context_child();
  if (!cuda_device_available()) {
    std::puts("no CUDA device: skipping the CUDA tests");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}

TEST_CASE("the CUDA engine copies both ways, event times lie on steady_clock", "[cuda][engine]") {
  // The engine's time base is a calibration event whose completion the host saw at a
  // steady_clock time it read afterwards. That reading can be late by however long the OS
  // kept the thread off a core, never early, so every bound below holds on a busy machine:
  // event times are never before the host moment that preceded the event, and late by at
  // most the length of the call that calibrated (creation, or an event_time_ns far from the
  // base). The only slack: the device timer's resolution (0.5 us on NVIDIA GPUs) and its
  // rate against steady_clock's (NTP slews the host clock; 1e-4 of the time is allowed).
  const auto slack = [](std::int64_t since_calibration) { return 2'000 + since_calibration / 10'000; };
  const std::int64_t creating = host_now_ns();
  auto engine = make_cuda_copy_engine(0);
  const std::int64_t created = host_now_ns();
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
  const std::int64_t reading = host_now_ns();
  const std::int64_t t0 = engine->event_time_ns(start), t1 = engine->event_time_ns(end);
  const std::int64_t read = host_now_ns();
  const std::int64_t late_at_most = std::max(created - creating, read - reading);
  INFO("host window [" << before << ", " << after << "], events " << t0 << " .. " << t1
                       << ", calibration late by at most " << late_at_most << " ns");
  CHECK(t1 > t0); // 32 MiB both ways take far more than the timer's resolution
  // One base for both reads cancels its lateness; a base renewed between them is late by at
  // most the reads' own length.
  CHECK(t1 - t0 <= after - before + (read - reading) + slack(after - before));
  CHECK(t0 >= before - slack(before - creating));
  CHECK(t1 <= after + late_at_most + slack(after - creating));
  engine->destroy_event(start);
  engine->destroy_event(end);
  engine->destroy_stream(s);
}

TEST_CASE("a stream waits for another stream's event, an event never recorded is no wait", "[cuda][engine]") {
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
  host_gate gate(*engine);
  wait_gate(*engine, writer, gate); // the writer is held: the reader must not copy before it
  engine->copy_async(writer, copy_direction::to_device, dev.data, fresh.data(), n * 4);
  engine->record_event(written, writer);
  engine->stream_wait_event(reader, never);
  engine->stream_wait_event(reader, written);
  engine->copy_async(reader, copy_direction::to_host, dst.data(), dev.data, n * 4);
  const device_event read = engine->create_event();
  engine->record_event(read, reader);
  CHECK_FALSE(engine->event_done(written));
  CHECK_FALSE(engine->event_done(read));
  gate.open();
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

TEST_CASE("misuse throws and leaves the engine usable, a failed host function is sticky",
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

TEST_CASE("an engine on a thread without a context leaves it without one, and creates none on device 0",
          "[cuda][engine][context]") {
  // A fresh process: nothing has touched any device yet (this one has).
  const auto [status, out] = hostopt_test::run_child("--context-child");
  INFO(out);
  CHECK(status == 0);
  CHECK(out.find("no thread was left with a context") != std::string::npos);
  if (out.find("not checked") != std::string::npos) WARN(out);
}

#if defined(HOSTOPT_TEST_HAVE_KERNELS)
TEST_CASE("engine calls leave the trainer's pending launch error for the trainer to read",
          "[cuda][engine][errors]") {
  auto engine = make_cuda_copy_engine(0);
  const device_stream s = engine->create_stream(), t = engine->create_stream();
  const device_event e = engine->create_event(), never = engine->create_event();
  hostopt_test::launch_bad_configuration(s.handle); // the trainer's launch, not checked yet
  REQUIRE(cudaPeekAtLastError() == cudaErrorInvalidConfiguration);
  {
    // Calls that succeed.
    device_buffer dev(*engine, 4096);
    pinned_buffer host(*engine, 4096);
    const device_flag f = engine->allocate_flag();
    engine->copy_async(s, copy_direction::to_device, dev.data, host.data(), 4096);
    engine->stream_wait_flag(s, f, 1);
    engine->write_flag(f, 1);
    engine->record_event(e, s);
    engine->synchronize_event(e);
    CHECK(engine->event_done(e));
    (void)engine->event_time_ns(e);
    engine->free_flag(f);
  }
  CHECK(cudaPeekAtLastError() == cudaErrorInvalidConfiguration);
  // A query that answers "not yet": whether or not the runtime keeps cudaErrorNotReady as
  // the last error (which would replace the trainer's), the engine leaves no trace of it.
  hostopt_test::launch_spin(t.handle, 50'000'000); // checks (and so clears) its own launch
  engine->record_event(e, t);
  CHECK_FALSE(engine->event_done(e));
  CHECK(cudaPeekAtLastError() != cudaErrorNotReady);
  // Calls that free, synchronize and ask, after the trainer's next refused launch.
  hostopt_test::launch_bad_configuration(s.handle);
  engine->destroy_stream(t);
  CHECK(cuda_device_available());
  CHECK(cudaPeekAtLastError() == cudaErrorInvalidConfiguration);
  // A call of the engine's own that fails: its error (which replaced the trainer's in the
  // runtime, as any failed runtime call's does) is reported by the exception and taken back.
  CHECK_THROWS_AS(engine->event_time_ns(never), std::invalid_argument);
  CHECK(cudaPeekAtLastError() != cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
  CHECK(engine->sticky_error().empty());
  engine->destroy_event(never);
  engine->destroy_event(e);
  engine->destroy_stream(s);
}
#endif

TEST_CASE("no flag wait outlives the engine: the destructor releases every wait, with either mechanism",
          "[cuda][engine][flag]") {
  for (const std::string mechanism : {"", "host_function"}) {
    auto engine = engine_with_flags(mechanism);
    INFO("flag mechanism: " << engine->flag_mechanism());
    const device_stream s = engine->create_stream();
    const device_flag f = engine->allocate_flag();
    auto ran = std::make_shared<std::atomic<bool>>(false);
    engine->stream_wait_flag(s, f, 7); // nobody writes 7: only the destructor lets it go
    engine->stream_wait_flag(s, f, 3);
    engine->launch_host_function(s, [ran] { ran->store(true); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK_FALSE(ran->load());
    std::atomic<bool> destroyed{false};
    std::thread destroyer([&] {
      engine.reset();
      destroyed.store(true);
    });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!destroyed.load() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!destroyed.load()) { // a hung destructor holds CUDA: nothing after it could run
      std::printf("FAILED: the engine's destructor still waits after 20 s (flag mechanism '%s')\n",
                  mechanism.c_str());
      std::fflush(stdout);
      std::_Exit(1);
    }
    destroyer.join();
    CHECK(ran->load()); // the stream's work after the wait ran before the stream was destroyed
  }
}

// A trainer's own stream may hold the engine's host functions (launch_host_function, the
// fallback's flag waits) behind work it has not reached yet: freeing a flag, or destroying
// the engine, then must not leave them pointing at freed memory (the ASan build would say).
TEST_CASE("host functions on a trainer's stream outlive neither their flag nor the engine",
          "[cuda][engine][flag]") {
  for (const std::string mechanism : {"", "host_function"}) {
    auto engine = engine_with_flags(mechanism);
    INFO("flag mechanism: " << engine->flag_mechanism());
    cudaStream_t own = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking) == cudaSuccess);
    const device_stream user{own};
    // A gate the trainer's stream reaches first: it opens only when the test says so.
    auto open = std::make_shared<std::atomic<bool>>(false);
    auto ran = std::make_shared<std::atomic<int>>(0);
    engine->launch_host_function(user, [open] {
      while (!open->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    const device_flag freed = engine->allocate_flag(), kept = engine->allocate_flag();
    engine->stream_wait_flag(user, freed, 5); // nobody writes 5: freeing the flag lets it go
    engine->launch_host_function(user, [ran] { ran->fetch_add(1); });
    engine->stream_wait_flag(user, kept, 9); // nor 9: only the destructor lets it go
    engine->launch_host_function(user, [ran] { ran->fetch_add(1); });
    std::atomic<bool> destroyed{false};
    std::thread destroyer([&] {
      // Freeing a flag a pending wait reads, then the engine: both wait for the trainer's
      // stream to pass what the engine enqueued on it (cudaFreeHost waits for the device's
      // waits; the fallback's host functions are counted), however long it takes.
      engine->free_flag(freed);
      engine.reset();
      destroyed.store(true);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK_FALSE(destroyed.load());
    CHECK(ran->load() == 0);
    open->store(true);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!destroyed.load() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!destroyed.load()) {
      std::printf("FAILED: freeing a flag and the engine still waits 20 s after the trainer's stream was let go "
                  "(flag mechanism '%s')\n",
                  mechanism.c_str());
      std::fflush(stdout);
      std::_Exit(1);
    }
    destroyer.join();
    CHECK(ran->load() == 2); // both waits were let go, and the work after them ran
    CHECK(cudaStreamSynchronize(own) == cudaSuccess);
    CHECK(cudaStreamDestroy(own) == cudaSuccess);
  }
}

#if defined(HOSTOPT_TEST_HAVE_KERNELS)
// CUDA does not call a host function once its context has failed: an engine whose host
// functions sit on a trainer's stream behind the fault must still be destroyable.
TEST_CASE("after a device fault the engine's destructor does not wait for host functions CUDA will not run",
          "[cuda][engine][errors]") {
  const auto [status, out] = hostopt_test::run_child("--destroy-after-fault-child");
  INFO(out);
  CHECK(status == 0);
  CHECK(out.find("engine destroyed after the fault") != std::string::npos);
}
#endif

TEST_CASE("the engine refuses its host functions on a stream being captured into a graph", "[cuda][engine]") {
  auto engine = engine_with_flags("host_function");
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t capturing = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&capturing, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  const device_flag f = engine->allocate_flag();
  {
    // An ordinary fallback wait first: later ones are chained after it by an event wait,
    // which a capture would refuse (and the engine keep) if it came before the refusal.
    const device_stream plain = engine->create_stream();
    engine->stream_wait_flag(plain, f, 0);
    const device_flag g = engine->allocate_flag();
    engine->stream_wait_flag(plain, g, 1);
    engine->write_flag(g, 1);
    engine->synchronize_stream(plain);
    engine->free_flag(g);
    engine->destroy_stream(plain);
  }
  CHECK_THROWS_WITH(engine->launch_host_function(device_stream{capturing}, [] {}),
                    Catch::Contains("launch_host_function on a stream being captured into a graph"));
  CHECK_THROWS_WITH(engine->stream_wait_flag(device_stream{capturing}, f, 1),
                    Catch::Contains("stream_wait_flag (the host-function fallback) on a stream being captured"));
  CHECK(engine->sticky_error().empty()); // a usage error: the engine stays usable
  cudaGraph_t graph = nullptr;
  (void)cudaStreamEndCapture(capturing, &graph);
  if (graph) cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  engine->free_flag(f);
  CHECK(cudaStreamDestroy(capturing) == cudaSuccess);
}

TEST_CASE("a sticky error lets the fallback's blocked flag waits go (CUDA's callback thread is not held)",
          "[cuda][engine][flag][errors]") {
  auto engine = engine_with_flags("host_function");
  const device_stream s = engine->create_stream();
  const device_flag f = engine->allocate_flag();
  auto ran = std::make_shared<std::atomic<bool>>(false);
  engine->stream_wait_flag(s, f, 1); // a host function that blocks until the flag, or a failure
  engine->launch_host_function(s, [ran] { ran->store(true); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(ran->load());
  // An error that leaves the context healthy but that the engine keeps: synchronizing a
  // stream that is being captured into a graph (cudaErrorStreamCaptureUnsupported).
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t capturing = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&capturing, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  CHECK_THROWS_AS(engine->synchronize_stream(device_stream{capturing}), std::runtime_error);
  cudaGraph_t graph = nullptr;
  (void)cudaStreamEndCapture(capturing, &graph); // invalidated: an error of the test's own
  if (graph) cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  cudaStreamDestroy(capturing);
  INFO("sticky error: " << engine->sticky_error());
  REQUIRE_FALSE(engine->sticky_error().empty());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!ran->load() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(ran->load());
}

#if defined(HOSTOPT_TEST_HAVE_KERNELS)
TEST_CASE("an illegal address in a kernel is sticky: named, kept, thrown by every later call",
          "[cuda][engine][errors]") {
  // The fault ends this process's CUDA context, so it happens in a child.
  const auto [status, out] = hostopt_test::run_child("--illegal-address-child");
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
    // The backward: held by the host until everything below is enqueued (where a gate
    // would deadlock, 40 ms of device work instead), then the gradients.
    host_gate gate(*engine);
    const bool gated = !gates_need_the_callback_thread(*engine);
    if (gated)
      gated_gradients(*engine, compute, gate, static_cast<float*>(dgrad.data), n, step,
                      static_cast<float*>(staging.data()));
    else
      late_gradients(*engine, compute, static_cast<float*>(dgrad.data), n, step, 40,
                     static_cast<float*>(staging.data()));
    engine->record_event(grads_ready, compute);
    const auto order = by_stream ? device_order::after(compute) : device_order::after(grads_ready);
    pipeline_handle h = pipe.step_async({dgrad.data, n, dtype::f32}, {dparams.data, n, dtype::bf16}, order);
    // step_async enqueued everything and returned while the backward is held (had it
    // waited for the backward it would not have returned); its events are already usable
    // by a stream: the next "forward" waits, then reads.
    if (gated) CHECK_FALSE(engine->event_done(grads_ready));
    REQUIRE(h.params_ready());
    REQUIRE(h.grads_consumed());
    engine->stream_wait_event(compute, h.params_ready());
    engine->stream_wait_event(compute, h.grads_consumed());
    engine->copy_async(compute, copy_direction::to_host, params_back.data(), dparams.data, n * 2);
    engine->record_event(copied_back, compute);
    if (gated) CHECK_FALSE(h.done());
    gate.open();
    engine->synchronize_event(copied_back); // the host waits on the stream's copy only
    CHECK(h.wait().applied);
    for (std::size_t i = 0; i < n; ++i) g[i] = test_gradient(i, step);
    sync.step(const_view{g.data(), n, dtype::f32}, mut_view{out.data(), n, dtype::bf16});
    REQUIRE(same_state(piped, sync));
    CHECK(same_device_params(sync, static_cast<const std::uint16_t*>(params_back.data()), out));
  }
  engine->destroy_stream(compute);
}

TEST_CASE(
    "on real streams, a trainer that omits or misplaces the gradient dependency is refused or gets stale "
    "gradients",
    "[cuda][pipeline][contract]") {
  auto engine = make_cuda_copy_engine(0);
  INFO("flag mechanism: " << engine->flag_mechanism());
  if (gates_need_the_callback_thread(*engine)) {
    WARN("no CUDA compiler and the host-function flag fallback: a gated backward would deadlock (skipped)");
    return;
  }
  const int seed = 7;
  const std::size_t n = optimizer(test_model()).arena_size();
  const auto init = [](optimizer& o) {
    for (std::size_t i = 0; i < o.arena_size(); ++i) o.params()[i] = 0.25f * float(i % 7) - 0.5f;
  };
  // What the step must give: the synchronous step on the backward's gradients.
  optimizer reference(test_model());
  init(reference);
  std::vector<float> fresh(n);
  for (std::size_t i = 0; i < n; ++i) fresh[i] = test_gradient(i, seed);
  std::vector<std::uint16_t> reference_out(n);
  reference.step(const_view{fresh.data(), n, dtype::f32}, mut_view{reference_out.data(), n, dtype::bf16});

  pipeline_options po;
  po.chunk_elems = 1 << 15; // 10 chunks: flag-gated copies in both directions
  device_buffer dgrad(*engine, n * 4), dparams(*engine, n * 2);
  pinned_buffer zeros(*engine, n * 4), staging(*engine, n * 4), params_back(*engine, n * 2);
  std::memset(zeros.data(), 0, n * 4);
  const device_stream compute = engine->create_stream();
  const device_event backward_done = engine->create_event();
  // The buffer holds zeros before every backward: what a step that does not wait reads.
  const auto clear_gradients = [&] {
    engine->copy_async(compute, copy_direction::to_device, dgrad.data, zeros.data(), n * 4);
    engine->synchronize_stream(compute);
  };

  SECTION("no dependency: refused before anything is enqueued") {
    optimizer opt(test_model());
    init(opt);
    offload_pipeline pipe(opt, *engine, po);
    clear_gradients();
    host_gate gate(*engine);
    gated_gradients(*engine, compute, gate, static_cast<float*>(dgrad.data), n, seed,
                    static_cast<float*>(staging.data()));
    // The text of the std::invalid_argument a call throws (anything else fails the test).
    const auto refusal = [](const std::function<void()>& call) -> std::string {
      try {
        call();
      } catch (const std::invalid_argument& e) {
        return e.what();
      }
      return "not refused";
    };
    CHECK_THAT(refusal([&] {
                 pipe.step_async({dgrad.data, n, dtype::f32}, {dparams.data, n, dtype::bf16}, device_order{});
               }),
               Catch::Contains("no gradient dependency"));
    CHECK_THAT(refusal([&] {
                 pipe.accumulate_async({dgrad.data, n, dtype::f32}, device_order{});
               }),
               Catch::Contains("no gradient dependency"));
    gate.open();
    engine->synchronize_stream(compute);
    CHECK(pipe.usable());
    CHECK(pipe.accumulated_micro_batches() == 0);
    optimizer untouched(test_model());
    init(untouched);
    CHECK(same_state(opt, untouched));
  }
  SECTION("an event recorded before the backward: the step reads stale gradients") {
    optimizer opt(test_model()), stale(test_model());
    init(opt);
    init(stale);
    offload_pipeline pipe(opt, *engine, po);
    clear_gradients();
    const device_event too_early = engine->create_event();
    host_gate gate(*engine);
    hostopt_test::begin_planted_races();
    engine->record_event(too_early, compute); // before the backward is enqueued
    gated_gradients(*engine, compute, gate, static_cast<float*>(dgrad.data), n, seed,
                    static_cast<float*>(staging.data()));
    engine->record_event(backward_done, compute);
    CHECK(pipe.step_async({dgrad.data, n, dtype::f32}, {dparams.data, n, dtype::bf16},
                          device_order::after(too_early))
              .wait()
              .applied);
    // The step is done and the backward has not run (the host holds it): it cannot have
    // seen the backward's output.
    CHECK_FALSE(engine->event_done(backward_done));
    gate.open();
    engine->synchronize_stream(compute);
    // The step's gradient copies read what the backward writes, with no ordering between
    // them: the double must report it (whichever of the two started first).
    const int races = hostopt_test::end_planted_races();
    if (races >= 0) CHECK(races >= 1);
    std::vector<float> stale_grads(n, 0.0f);
    stale.step(const_view{stale_grads.data(), n, dtype::f32});
    CHECK(same_state(opt, stale));
    CHECK(std::memcmp(opt.params().data(), reference.params().data(), n * 4) != 0);
    engine->destroy_event(too_early);
  }
  SECTION("ordered after the backward (event or stream): the synchronous step's bits") {
    for (const bool by_event : {true, false}) {
      INFO((by_event ? "ordered after an event" : "ordered after the stream"));
      optimizer opt(test_model());
      init(opt);
      offload_pipeline pipe(opt, *engine, po);
      clear_gradients();
      host_gate gate(*engine);
      gated_gradients(*engine, compute, gate, static_cast<float*>(dgrad.data), n, seed,
                      static_cast<float*>(staging.data()));
      engine->record_event(backward_done, compute);
      pipeline_handle h =
          pipe.step_async({dgrad.data, n, dtype::f32}, {dparams.data, n, dtype::bf16},
                          by_event ? device_order::after(backward_done) : device_order::after(compute));
      // Both events exist at once, while the backward is held: a stream can wait on them now.
      REQUIRE(h.grads_consumed());
      REQUIRE(h.params_ready());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      CHECK_FALSE(h.done());
      CHECK_FALSE(engine->event_done(h.grads_consumed()));
      CHECK_FALSE(engine->event_done(h.params_ready()));
      engine->stream_wait_event(compute, h.params_ready()); // the next forward's wait
      engine->copy_async(compute, copy_direction::to_host, params_back.data(), dparams.data, n * 2);
      gate.open();
      CHECK(h.wait().applied);
      engine->synchronize_stream(compute);
      CHECK(same_state(opt, reference));
      CHECK(same_device_params(reference, static_cast<const std::uint16_t*>(params_back.data()),
                               reference_out));
    }
  }
  engine->destroy_event(backward_done);
  engine->destroy_stream(compute);
}

TEST_CASE("trainer loops on real streams (accumulation, synchronous step, delayed parameter update) give the "
          "synchronous loop's bits",
          "[cuda][pipeline][contract]") {
  const int steps = 5, micro = 3;           // 15 operations, all enqueued before the device computes anything
  REQUIRE(cudaSetDevice(0) == cudaSuccess); // the test's own cudaStreamWaitEvent calls: the engine's device
  for (const bool dpu : {false, true}) {
    INFO((dpu ? "delayed parameter update" : "synchronous step"));
    auto engine = make_cuda_copy_engine(0);
    INFO("flag mechanism: " << engine->flag_mechanism());
    if (gates_need_the_callback_thread(*engine)) {
      WARN("no CUDA compiler and the host-function flag fallback: the loop's gate would deadlock (skipped)");
      return;
    }
    const device_stream compute = engine->create_stream();
    const auto cs = static_cast<cudaStream_t>(compute.handle);
    adam_config cfg;
    cfg.lr = 0.05;
    cfg.weight_decay = 0.01;
    const std::vector<param_group> groups{{cfg, {{"w", {40000}}, {"b", {33}}}}};
    optimizer opt(groups), ref_opt(groups);
    const std::size_t n = opt.arena_size();
    for (std::size_t i = 0; i < n; ++i) opt.params()[i] = ref_opt.params()[i] = 0.001f * float(i % 1000);
    pipeline_options po;
    po.chunk_elems = 8192;
    po.grad_type = dtype::f32;
    po.param_type = dtype::bf16;
    offload_pipeline pipe(opt, *engine, po);
    loop_model model(*engine, n, compute);
    device_buffer grads(*engine, n * 4), p0(*engine, n * 2), p1(*engine, n * 2);
    std::uint16_t* params[2] = {static_cast<std::uint16_t*>(p0.data), static_cast<std::uint16_t*>(p1.data)};
    for (auto* p : params) pipe.push_params({p, n, dtype::bf16});

    // The device-side loop, enqueued entirely while the compute stream is held at a gate.
    host_gate start(*engine);
    wait_gate(*engine, compute, start);
    std::vector<pipeline_handle> step_handles;
    pipeline_handle last_reader; // the last operation that reads `grads`
    for (int s = 0; s < steps; ++s) {
      const int buf = dpu ? s % 2 : 0;
      // sync: the forward needs the previous step's parameters; dpu: those of step s-2,
      // written into this buffer while step s-1 writes the other one.
      const int needed = dpu ? s - 2 : s - 1;
      if (needed >= 0)
        REQUIRE(cudaStreamWaitEvent(
                    cs, static_cast<cudaEvent_t>(step_handles[std::size_t(needed)].params_ready().handle),
                    0) == cudaSuccess);
      for (int mb = 0; mb < micro; ++mb) {
        if (last_reader.grads_consumed()) // the gradient buffer is free to overwrite
          REQUIRE(cudaStreamWaitEvent(cs, static_cast<cudaEvent_t>(last_reader.grads_consumed().handle), 0) ==
                  cudaSuccess);
        model.device(compute, params[buf], static_cast<float*>(grads.data), s * micro + mb);
        if (mb + 1 < micro)
          last_reader = pipe.accumulate_async({grads.data, n, dtype::f32}, device_order::after(compute));
      }
      last_reader = pipe.step_async({grads.data, n, dtype::f32}, {params[buf], n, dtype::bf16},
                                    device_order::after(compute), 1.0f / float(micro));
      step_handles.push_back(last_reader);
    }
    CHECK_FALSE(step_handles.front().done()); // nothing ran yet: the loop never waited on the device
    start.open();
    for (auto& h : step_handles) CHECK(h.wait().applied);
    engine->synchronize_stream(compute);

    // The synchronous loop on the host, the same math in the same order.
    std::vector<std::uint16_t> host_params[2] = {std::vector<std::uint16_t>(n),
                                                 std::vector<std::uint16_t>(n)};
    for (auto& p : host_params) ref_opt.read_params(0, n, p.data(), dtype::bf16);
    std::vector<float> g(n), acc(n);
    for (int s = 0; s < steps; ++s) {
      const int buf = dpu ? s % 2 : 0;
      for (int mb = 0; mb < micro; ++mb) {
        model.host(host_params[buf].data(), g.data(), s * micro + mb);
        for (std::size_t i = 0; i < n; ++i) acc[i] = mb == 0 ? g[i] : g[i] + acc[i];
      }
      ref_opt.step(const_view{acc.data(), n, dtype::f32}, mut_view{host_params[buf].data(), n, dtype::bf16},
                   1.0f / float(micro));
    }
    CHECK(same_state(opt, ref_opt));
    pinned_buffer back(*engine, n * 2);
    for (int b = 0; b < 2; ++b) {
      engine->copy_async(compute, copy_direction::to_host, back.data(), params[b], n * 2);
      engine->synchronize_stream(compute);
      INFO("device parameter buffer " << b);
      CHECK(same_device_params(ref_opt, static_cast<const std::uint16_t*>(back.data()), host_params[b]));
    }
    engine->destroy_stream(compute);
  }
}

// The whole pipeline on the host-function fallback, whose blocked callbacks share CUDA's
// one host-function thread with every stream. It cannot deadlock: the pipeline enqueues
// each flag wait after the copies whose completion lets the CPU write that flag, and the
// gradients come from kernels (or, without a CUDA compiler, host functions that return).
TEST_CASE("the pipeline on the host-function flag fallback", "[cuda][pipeline][fallback]") {
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
