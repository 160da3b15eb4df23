// The CUDA runtime double's own promises (tests/cuda_double): it is only worth running the
// CUDA engine on if it is at least as strict as CUDA. Each check plants the mistake a fast
// GPU would hide and asserts the double reports it, or that CUDA's documented rule holds:
// races named with both call sites, the host touching device memory, CUDA calls inside a
// host function, event waits bound at enqueue, cuStreamWaitValue32's flags with wrap-around,
// sticky errors, and injected faults surfacing through the engine and the pipeline with
// nothing half-applied.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "child_process.hpp"
#include "cuda_double/cuda_double.hpp"
#include "hostopt/offload_pipeline.hpp"
#include "hostopt/optimizer.hpp"

using namespace hostopt;

namespace {

// Device work that waits until the host opens a word: holds a stream deterministically.
struct gate {
  std::atomic<std::uint32_t> open{0};
  void enqueue(cudaStream_t s) {
    REQUIRE(cuda_double::launch(s, "gate", {}, [this] {
              while (open.load(std::memory_order_acquire) == 0) usleep(50);
            }) == cudaSuccess);
  }
};

// Records violations for the scope of one check and hands them back.
struct recorded {
  recorded() {
    (void)cuda_double::take_violations();
    cuda_double::record_violations(true);
  }
  ~recorded() { cuda_double::record_violations(false); }
  std::vector<std::string> take() { return cuda_double::take_violations(); }
};

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += s + "\n";
  return out;
}

int touch_device_memory() {
  void* p = nullptr;
  if (cudaMalloc(&p, 4096) != cudaSuccess) return 2;
  std::printf("reading device memory from the host\n");
  std::fflush(stdout);
  return int(*static_cast<volatile char*>(p)); // must fault
}

// The host touching page-locked memory while a copy of it is in flight (a slow modelled
// link keeps it there ~0.3 s): `write` stores into it, else loads from it; `to_device`: it
// is the source of a copy to the device, else the destination of one to the host. Only
// loads from a copy's source are allowed. The host keeps touching until the copy is done,
// so it meets the copy in flight however the machine schedules it.
int touch_pinned_during_copy(bool write, bool to_device) {
  setenv("HOSTOPT_CUDA_DOUBLE_MODEL", "link_gbps=0.0002", 1); // before the first CUDA call
  const std::size_t bytes = 64 * 1024;
  void *host = nullptr, *dev = nullptr;
  cudaStream_t s = nullptr;
  if (cudaHostAlloc(&host, bytes, cudaHostAllocDefault) != cudaSuccess || cudaMalloc(&dev, bytes) != cudaSuccess ||
      cudaStreamCreate(&s) != cudaSuccess)
    return 2;
  auto* words = static_cast<volatile std::uint32_t*>(host);
  const cudaError_t rc = to_device ? cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s)
                                   : cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s);
  if (rc != cudaSuccess) return 2;
  std::printf("%s page-locked memory while a copy %s is in flight\n", write ? "writing" : "reading",
              to_device ? "from it" : "into it");
  std::fflush(stdout);
  std::uint32_t sum = 0;
  for (std::uint32_t i = 0; cudaStreamQuery(s) == cudaErrorNotReady; ++i) {
    const std::size_t at = (i * 1031u) % (bytes / 4);
    if (write) words[at] = i;
    else sum += words[at];
  }
  std::printf("the copy completed, no fault (%u)\n", unsigned(sum & 1));
  return 0;
}

PFN_cuStreamWaitValue32_v11070 wait_value32() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  REQUIRE(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 11070, cudaEnableDefault, &status) ==
          cudaSuccess);
  REQUIRE(status == cudaDriverEntryPointSuccess);
  return reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(fn);
}

bool event_done(cudaEvent_t e) { return cudaEventQuery(e) == cudaSuccess; }

} // namespace

TEST_CASE("an unordered write and read of one device range is a race, named with both call sites",
          "[cuda_double][race]") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  const std::size_t bytes = 1 << 16;
  void *dev = nullptr, *host = nullptr;
  REQUIRE(cudaMalloc(&dev, bytes) == cudaSuccess);
  REQUIRE(cudaHostAlloc(&host, bytes, cudaHostAllocDefault) == cudaSuccess);
  cudaStream_t a, b;
  REQUIRE(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking) == cudaSuccess);
  cudaEvent_t written;
  REQUIRE(cudaEventCreateWithFlags(&written, cudaEventDisableTiming) == cudaSuccess);

  SECTION("no ordering: reported, whichever ran first") {
    recorded r;
    REQUIRE(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, a) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(host, dev, bytes / 2, cudaMemcpyDeviceToHost, b) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    const auto v = r.take();
    REQUIRE(v.size() == 1);
    INFO(v[0]);
    CHECK_THAT(v[0], Catch::Contains("race: cudaMemcpyAsync"));
    CHECK_THAT(v[0], Catch::Contains("with no ordering between them"));
    CHECK_THAT(v[0], Catch::Contains("HOSTOPT_CUDA_DOUBLE_SEED="));
    // Both call sites: the two cudaMemcpyAsync lines of this test.
    const auto first = v[0].find("test_cuda_double.cpp:"), second = v[0].rfind("test_cuda_double.cpp:");
    CHECK(first != std::string::npos);
    CHECK(second != first);
  }
  SECTION("ordered by an event, by stream order or by the host: nothing reported") {
    recorded r;
    REQUIRE(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, a) == cudaSuccess);
    REQUIRE(cudaEventRecord(written, a) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(b, written, 0) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, b) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, b) == cudaSuccess); // stream order
    REQUIRE(cudaStreamSynchronize(b) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, a) ==
            cudaSuccess); // after the host's sync
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(joined(r.take()).empty());
  }
  SECTION("a copy from pageable memory returns with its bytes taken, its device write maybe not done") {
    // CUDA: "the DMA to final destination may not have completed": the host learned nothing,
    // so another stream reading the range unordered races with it.
    recorded r;
    std::vector<char> pageable(bytes, 1);
    REQUIRE(cudaMemcpyAsync(dev, pageable.data(), bytes, cudaMemcpyHostToDevice, a) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, b) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    const auto v = r.take();
    REQUIRE(v.size() == 1);
    CHECK_THAT(v[0], Catch::Contains("with no ordering between them"));
  }
  SECTION("reads of one range from two streams are no race") {
    recorded r;
    void* host2 = nullptr;
    REQUIRE(cudaHostAlloc(&host2, bytes, cudaHostAllocDefault) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, a) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(host2, dev, bytes, cudaMemcpyDeviceToHost, b) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(joined(r.take()).empty());
    REQUIRE(cudaFreeHost(host2) == cudaSuccess);
  }
  REQUIRE(cudaEventDestroy(written) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(a) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(b) == cudaSuccess);
  REQUIRE(cudaFree(dev) == cudaSuccess);
  REQUIRE(cudaFreeHost(host) == cudaSuccess);
}

TEST_CASE("the host touching device memory faults at once, naming the allocation", "[cuda_double][memory]") {
  const auto [status, out] = hostopt_test::run_child("--touch-device-memory");
  INFO(out);
  CHECK(status != 0);
  CHECK_THAT(out, Catch::Contains("reading device memory from the host"));
  CHECK_THAT(out, Catch::Contains("the host touched device memory"));
  CHECK_THAT(out, Catch::Contains("a cudaMalloc allocation"));
}

TEST_CASE("the host touching page-locked memory a copy in flight writes, or writing what it reads, faults at once",
          "[cuda_double][memory]") {
  for (const char* mode : {"--write-pinned-during-copy-into", "--read-pinned-during-copy-into"}) {
    const auto [status, out] = hostopt_test::run_child(mode);
    INFO(out);
    CHECK(status != 0);
    CHECK_THAT(out, Catch::Contains("page-locked memory while a copy into it is in flight"));
    CHECK_THAT(out, Catch::Contains("the host touched page-locked memory at"));
    CHECK_THAT(out, Catch::Contains("while a copy in flight writes it"));
  }
  {
    const auto [status, out] = hostopt_test::run_child("--write-pinned-during-copy-from");
    INFO(out);
    CHECK(status != 0);
    CHECK_THAT(out, Catch::Contains("writing page-locked memory while a copy from it is in flight"));
    CHECK_THAT(out, Catch::Contains("while a copy in flight reads it"));
  }
  {
    const auto [status, out] = hostopt_test::run_child("--read-pinned-during-copy-from");
    INFO(out);
    CHECK(status == 0);
    CHECK_THAT(out, Catch::Contains("the copy completed, no fault"));
  }
}

TEST_CASE("device memory holds what was copied in, and a copy past an allocation's end is refused",
          "[cuda_double][memory]") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  const std::size_t n = 1000;
  std::vector<float> in(n), out(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) in[i] = float(i) * 0.5f;
  void* dev = nullptr;
  REQUIRE(cudaMalloc(&dev, n * 4) == cudaSuccess);
  // Pageable memory: synchronous, as CUDA's pageable copies are for the host buffer.
  REQUIRE(cudaMemcpyAsync(dev, in.data(), n * 4, cudaMemcpyHostToDevice, nullptr) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(out.data(), dev, n * 4, cudaMemcpyDeviceToHost, nullptr) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);
  CHECK(out == in);
  CHECK(cudaMemcpyAsync(out.data(), dev, n * 4 + 4, cudaMemcpyDeviceToHost, nullptr) ==
        cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue); // not sticky: read and cleared
  CHECK(cudaGetLastError() == cudaSuccess);
  // The wrong direction for the pointers is refused, not guessed.
  CHECK(cudaMemcpyAsync(dev, in.data(), 4, cudaMemcpyDeviceToHost, nullptr) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
  cudaPointerAttributes attr{};
  REQUIRE(cudaPointerGetAttributes(&attr, static_cast<char*>(dev) + 8) == cudaSuccess);
  CHECK(attr.type == cudaMemoryTypeDevice);
  CHECK(attr.device == 0);
  REQUIRE(cudaFree(dev) == cudaSuccess);
}

TEST_CASE("a CUDA call from inside a host function is refused and reported", "[cuda_double][rules]") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t s;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  recorded r;
  static cudaError_t inside;
  inside = cudaSuccess;
  REQUIRE(cudaLaunchHostFunc(
              s, [](void*) { inside = cudaStreamQuery(nullptr); }, nullptr) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(inside == cudaErrorNotPermitted);
  const auto v = r.take();
  REQUIRE(v.size() == 1);
  CHECK_THAT(v[0], Catch::Contains("cudaStreamQuery called from inside a host function"));
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("an event wait binds to the record current when the wait is enqueued", "[cuda_double][rules]") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t held, waiter, other;
  for (auto* s : {&held, &waiter, &other})
    REQUIRE(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking) == cudaSuccess);
  cudaEvent_t e, after;
  REQUIRE(cudaEventCreate(&e) == cudaSuccess);
  REQUIRE(cudaEventCreate(&after) == cudaSuccess);
  gate g;
  g.enqueue(held);
  REQUIRE(cudaEventRecord(e, held) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(waiter, e, 0) == cudaSuccess); // binds to the held record
  REQUIRE(cudaEventRecord(after, waiter) == cudaSuccess);
  REQUIRE(cudaEventRecord(e, other) == cudaSuccess); // a later record on an idle stream
  REQUIRE(cudaEventSynchronize(e) == cudaSuccess);   // that one completes...
  CHECK_FALSE(event_done(after));                    // ...the wait still holds
  CHECK(cudaEventQuery(after) == cudaErrorNotReady);
  // As PyTorch's CUDAEvent::query assumes, cudaErrorNotReady is left as the thread's last
  // error (a caller clears it): the engine must not leave it for the trainer.
  CHECK(cudaGetLastError() == cudaErrorNotReady);
  CHECK(cudaGetLastError() == cudaSuccess);
  g.open.store(1, std::memory_order_release);
  REQUIRE(cudaEventSynchronize(after) == cudaSuccess);
  // A wait on an event never recorded is no wait at all.
  cudaEvent_t never;
  REQUIRE(cudaEventCreate(&never) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(other, never, 0) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(other) == cudaSuccess);
  float ms = -1.0f;
  CHECK(cudaEventElapsedTime(&ms, never, after) == cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
  for (auto x : {e, after, never}) REQUIRE(cudaEventDestroy(x) == cudaSuccess);
  for (auto s : {held, waiter, other}) REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("cuStreamWaitValue32 waits as the driver documents (GEQ with wrap-around, EQ, AND, NOR)",
          "[cuda_double][rules]") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  const auto wait = wait_value32();
  void* word = nullptr;
  REQUIRE(cudaHostAlloc(&word, 4, cudaHostAllocMapped) == cudaSuccess);
  auto* w = static_cast<std::uint32_t*>(word);
  void* dword = nullptr;
  REQUIRE(cudaHostGetDevicePointer(&dword, word, 0) == cudaSuccess);
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  cudaEvent_t done;
  REQUIRE(cudaEventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess);
  const auto store = [&](std::uint32_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); };
  struct wait_case {
    unsigned flags;
    std::uint32_t value, blocks_at, passes_at;
  };
  const wait_case cases[] = {
      {CU_STREAM_WAIT_VALUE_GEQ, 5, 0xfffffff0u, 10}, // 0xfffffff0 is "before" 5; 10 is after
      {CU_STREAM_WAIT_VALUE_GEQ, 0xfffffff0u, 0x7ffffff0u, 3},
      {CU_STREAM_WAIT_VALUE_EQ, 42, 43, 42},
      {CU_STREAM_WAIT_VALUE_AND, 0x4, 0x3, 0x6},
      {CU_STREAM_WAIT_VALUE_NOR, 0xfffffffeu, 0xffffffffu, 0x0}, // ~(x | v) != 0
  };
  for (const auto& c : cases) {
    INFO("flags " << c.flags << " value " << c.value);
    store(c.blocks_at);
    REQUIRE(wait(reinterpret_cast<CUstream>(s), CUdeviceptr(dword), c.value, c.flags) == CUDA_SUCCESS);
    REQUIRE(cudaEventRecord(done, s) == cudaSuccess);
    usleep(20'000); // time to pass wrongly: a wait that must hold holds however long
    CHECK_FALSE(event_done(done));
    store(c.passes_at);
    REQUIRE(cudaEventSynchronize(done) == cudaSuccess);
  }
  CHECK(wait(reinterpret_cast<CUstream>(s), CUdeviceptr(dword), 1, 0x7) == CUDA_ERROR_INVALID_VALUE);
  REQUIRE(cudaEventDestroy(done) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  REQUIRE(cudaFreeHost(word) == cudaSuccess);
}

TEST_CASE("injected faults surface where CUDA reports them, and a device fault is sticky",
          "[cuda_double][faults]") {
  const auto [status, out] = hostopt_test::run_child("--sticky-fault");
  INFO(out);
  CHECK(status == 0);
  CHECK_THAT(out, Catch::Contains("sticky: ok"));
}

int sticky_fault() {
  // A fresh process: the fault ends device 0's context for good, as on a GPU.
  if (cudaSetDevice(0) != cudaSuccess) return 2;
  cuda_double::inject_faults("cudaMalloc#1=cudaErrorMemoryAllocation");
  void* p = nullptr;
  if (cudaMalloc(&p, 64) != cudaErrorMemoryAllocation) return 3;
  if (cudaGetLastError() != cudaErrorMemoryAllocation || cudaGetLastError() != cudaSuccess) return 4;
  if (cudaMalloc(&p, 64) != cudaSuccess) return 5; // one call, not sticky
  cudaStream_t s, blocked;
  if (cudaStreamCreate(&s) != cudaSuccess || cudaStreamCreate(&blocked) != cudaSuccess) return 6;
  // A stream held by a flag wait nobody will satisfy: the fault must end it, as CUDA
  // ends every stream's pending work when the context fails.
  void* word = nullptr;
  void* word_dev = nullptr;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaHostAlloc(&word, 4, cudaHostAllocMapped) != cudaSuccess ||
      cudaHostGetDevicePointer(&word_dev, word, 0) != cudaSuccess ||
      cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 11070, cudaEnableDefault, &found) !=
          cudaSuccess)
    return 15;
  std::memset(word, 0, 4);
  if (reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(fn)(reinterpret_cast<CUstream>(blocked),
                                                           reinterpret_cast<CUdeviceptr>(word_dev), 1,
                                                           CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
    return 16;
  cuda_double::inject_faults("exec:cudaMemsetAsync#1=cudaErrorIllegalAddress");
  if (cudaMemsetAsync(p, 0, 64, s) != cudaSuccess) return 7;         // enqueued fine...
  if (cudaStreamSynchronize(s) != cudaErrorIllegalAddress) return 8; // ...fails when it runs
  if (cudaGetLastError() != cudaErrorIllegalAddress) return 9;
  if (cudaStreamSynchronize(blocked) != cudaErrorIllegalAddress) return 17; // an answer, not a hang
  // Sticky: every later call on the device reports it, and reading it does not clear it.
  if (cudaMemsetAsync(p, 0, 64, s) != cudaErrorIllegalAddress) return 10;
  if (cudaGetLastError() != cudaErrorIllegalAddress) return 11;
  if (cudaPeekAtLastError() != cudaErrorIllegalAddress) return 12;
  // Another device is untouched.
  if (cudaSetDevice(1) != cudaSuccess) return 13;
  void* q = nullptr;
  if (cudaMalloc(&q, 64) != cudaSuccess || cudaFree(q) != cudaSuccess) return 14;
  std::printf("sticky: ok\n");
  return 0;
}

TEST_CASE("a malformed fault spec is refused with its text", "[cuda_double][faults]") {
  CHECK_THROWS_WITH(cuda_double::inject_faults("cudaMalloc#x=cudaErrorMemoryAllocation"),
                    Catch::Contains("cudaMalloc#x"));
  CHECK_THROWS_WITH(cuda_double::inject_faults("cudaMalloc#1=cudaErrorNoSuchThing"),
                    Catch::Contains("cudaErrorNoSuchThing"));
  cuda_double::clear_faults();
}

namespace {
// The text of what `call` throws as E ("" when it throws nothing; anything else fails).
template <class E, class F> std::string thrown(F&& call) {
  try {
    call();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

struct scoped_env {
  const char* name;
  scoped_env(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~scoped_env() { unsetenv(name); }
};
} // namespace

TEST_CASE("every CUDA call site of the engine reports its failure as hostopt documents",
          "[cuda_double][faults][engine]") {
  // Each fault is the next call of one API only (counted from inject_faults) and none makes
  // the double's device sticky, so the checks share one process.
  SECTION("construction: no device, a device that does not exist, the driver refusing") {
    cuda_double::inject_faults("cudaGetDeviceCount#1=cudaErrorNoDevice");
    CHECK_THAT(thrown<std::runtime_error>([] { (void)make_cuda_copy_engine(0); }),
               Catch::Contains("cudaGetDeviceCount failed: cudaErrorNoDevice"));
    CHECK_THAT(thrown<std::runtime_error>([] { (void)make_cuda_copy_engine(5); }),
               Catch::Contains("device 5 does not exist (2 visible)"));
    cuda_double::inject_faults("cuDeviceGet#1=CUDA_ERROR_INVALID_DEVICE");
    CHECK_THAT(thrown<std::runtime_error>([] { (void)make_cuda_copy_engine(0); }),
               Catch::Contains("cuDeviceGet(0) failed: CUDA_ERROR_INVALID_DEVICE"));
    cuda_double::inject_faults("cuDevicePrimaryCtxRetain#1=CUDA_ERROR_OUT_OF_MEMORY");
    CHECK_THAT(thrown<std::runtime_error>([] { (void)make_cuda_copy_engine(0); }),
               Catch::Contains("cuDevicePrimaryCtxRetain failed: CUDA_ERROR_OUT_OF_MEMORY"));
    cuda_double::clear_faults();
  }
  SECTION("the flag mechanism: a bad HOSTOPT_CUDA_FLAG_WAIT, and stream memory operations refused") {
    {
      scoped_env env("HOSTOPT_CUDA_FLAG_WAIT", "sometimes");
      CHECK_THAT(thrown<std::invalid_argument>([] { (void)make_cuda_copy_engine(0); }),
                 Catch::Contains("HOSTOPT_CUDA_FLAG_WAIT='sometimes'"));
    }
    // The probe fails: the engine falls back, or refuses where the user demanded them.
    cuda_double::inject_faults("cuStreamWaitValue32#1=CUDA_ERROR_NOT_SUPPORTED");
    CHECK(make_cuda_copy_engine(0)->flag_mechanism() ==
          "host function (cudaLaunchHostFunc) blocking the stream");
    {
      scoped_env env("HOSTOPT_CUDA_FLAG_WAIT", "stream_memory_operations");
      cuda_double::inject_faults("cuStreamWaitValue32#1=CUDA_ERROR_NOT_SUPPORTED");
      CHECK_THAT(thrown<std::runtime_error>([] { (void)make_cuda_copy_engine(0); }),
                 Catch::Contains("cuStreamWaitValue32 returned CUDA_ERROR_NOT_SUPPORTED"));
    }
    cuda_double::clear_faults();
  }
  SECTION("calls on a working engine: bad arguments refused, out of memory, a failed flag allocation") {
    auto engine = make_cuda_copy_engine(0);
    const device_stream s = engine->create_stream();
    void* dev = engine->allocate_device(64);
    const pinned_allocation host = engine->allocate_pinned(64);
    CHECK_THAT(thrown<std::invalid_argument>(
                   [&] { engine->copy_async(s, copy_direction::to_device, dev, nullptr, 64); }),
               Catch::Contains("with a null source"));
    CHECK_THAT(
        thrown<std::invalid_argument>([&] { engine->copy_async(s, copy_direction(7), dev, host.data, 64); }),
        Catch::Contains("copy direction 7"));
    CHECK_THAT(thrown<std::invalid_argument>([&] { engine->record_event(device_event{}, s); }),
               Catch::Contains("with an empty device_event"));
    cuda_double::inject_faults("cudaMalloc#1=cudaErrorMemoryAllocation");
    CHECK_THAT(thrown<std::runtime_error>([&] { (void)engine->allocate_device(1 << 20); }),
               Catch::Contains("cudaErrorMemoryAllocation"));
    cuda_double::inject_faults("cudaHostGetDevicePointer#1=cudaErrorInvalidValue");
    CHECK_THAT(thrown<std::invalid_argument>([&] { (void)engine->allocate_flag(); }),
               Catch::Contains("cudaHostGetDevicePointer (flag word)"));
    // None of that is sticky: the engine still works.
    CHECK(engine->sticky_error().empty());
    void* more = engine->allocate_device(1 << 20);
    engine->free_device(more);
    // An event whose record is still pending has no time yet.
    gate g;
    g.enqueue(static_cast<cudaStream_t>(s.handle));
    const device_event e = engine->create_event();
    engine->record_event(e, s);
    CHECK_THAT(thrown<std::logic_error>([&] { (void)engine->event_time_ns(e); }),
               Catch::Contains("has not completed"));
    g.open.store(1, std::memory_order_release);
    engine->synchronize_stream(s);
    CHECK(engine->event_time_ns(e) > 0);
    // A driver call refusing an argument is the caller's error; a driver failure is sticky.
    const device_flag f = engine->allocate_flag();
    cuda_double::inject_faults("cuStreamWaitValue32#1=CUDA_ERROR_INVALID_VALUE");
    CHECK_THAT(thrown<std::invalid_argument>([&] { engine->stream_wait_flag(s, f, 1); }),
               Catch::Contains("cuStreamWaitValue32 failed: CUDA_ERROR_INVALID_VALUE"));
    CHECK(engine->sticky_error().empty());
    cuda_double::inject_faults("cuStreamWaitValue32#1=CUDA_ERROR_LAUNCH_FAILED");
    CHECK_THAT(thrown<std::runtime_error>([&] { engine->stream_wait_flag(s, f, 1); }),
               Catch::Contains("cuStreamWaitValue32 failed: CUDA_ERROR_LAUNCH_FAILED"));
    CHECK_THAT(engine->sticky_error(), Catch::Contains("CUDA_ERROR_LAUNCH_FAILED"));
    CHECK_THAT(thrown<std::runtime_error>([&] { (void)engine->create_event(); }),
               Catch::Contains("CUDA_ERROR_LAUNCH_FAILED"));
    cuda_double::clear_faults();
    engine->free_pinned(host, 64);
  }
}

TEST_CASE("a host-function flag wait starts blocking only once its stream reached it",
          "[cuda_double][engine][flags]") {
  // A trainer's backward ends in a host function; the pipeline's copy stream waits for the
  // backward, then for a flag the CPU writes once it saw the host function run. CUDA may run
  // every host function on one thread: a wait that blocked it before its stream got there
  // (e.g. one queued on a stream of its own) would keep the trainer's host function, and so
  // the flag, from ever coming. On the old engine that did so, this hangs.
  scoped_env env("HOSTOPT_CUDA_FLAG_WAIT", "host_function");
  auto engine = make_cuda_copy_engine(0);
  REQUIRE(engine->flag_mechanism() == "host function (cudaLaunchHostFunc) blocking the stream");
  const device_stream compute = engine->create_stream(), copies = engine->create_stream();
  const device_flag f = engine->allocate_flag();
  const device_event backward_done = engine->create_event(), passed = engine->create_event();
  std::atomic<bool> ran{false};
  engine->launch_host_function(compute, [&] { ran.store(true, std::memory_order_release); });
  engine->record_event(backward_done, compute);
  engine->stream_wait_event(copies, backward_done);
  engine->stream_wait_flag(copies, f, 1);
  engine->record_event(passed, copies);
  while (!ran.load(std::memory_order_acquire)) usleep(50); // the CPU's side: after the host function
  engine->write_flag(f, 1);
  engine->synchronize_event(passed);
  CHECK(engine->sticky_error().empty());
  engine->free_flag(f);
}

namespace {
std::vector<param_group> small_model() {
  adam_config c;
  c.lr = 1e-2;
  return {{c, {{"w", {40000}}, {"b", {1000}}}}};
}
} // namespace

TEST_CASE("a copy that fails mid-pipeline surfaces as the pipeline's error, the optimizer untouched or the "
          "pipeline refusing",
          "[cuda_double][faults][pipeline]") {
  // Each copy of the first step may fail, at enqueue or when it runs (having moved half its
  // bytes): the error names the CUDA error, and either the state is unchanged and the
  // pipeline usable, or the pipeline is unusable (documented: a device error is sticky) and
  // says why. small_model() in chunks of 8192: 6 chunks, 6 copies in and 6 out.
  for (const char* mode : {"", "exec:"}) {
    for (int nth = 1; nth <= 12; ++nth) {
      const std::string spec =
          std::string(mode) + "cudaMemcpyAsync#" + std::to_string(nth) + "=cudaErrorLaunchFailure";
      INFO(spec);
      const auto [status, out] = hostopt_test::run_child(("--pipeline-fault '" + spec + "'").c_str());
      INFO(out);
      CHECK(status == 0);
      CHECK_THAT(out, Catch::Contains("pipeline fault: ok"));
      // A copy refused at enqueue leaves the state as it was.
      if (std::string(mode).empty()) CHECK_THAT(out, Catch::Contains("state unchanged"));
    }
  }
}

int pipeline_fault(const std::string& spec) {
  auto engine = make_cuda_copy_engine(0);
  optimizer opt(small_model()), untouched(small_model());
  const std::size_t n = opt.arena_size();
  pipeline_options po;
  po.chunk_elems = 8192;
  offload_pipeline pipe(opt, *engine, po);
  void* dgrad = engine->allocate_device(n * 4);
  void* dparams = engine->allocate_device(n * 2);
  const device_stream compute = engine->create_stream();
  // Gradients of 1 on the device.
  std::vector<float> ones(n, 1.0f);
  const pinned_allocation staging = engine->allocate_pinned(n * 4);
  std::memcpy(staging.data, ones.data(), n * 4);
  engine->copy_async(compute, copy_direction::to_device, dgrad, staging.data, n * 4);
  engine->synchronize_stream(compute);
  cuda_double::inject_faults(spec);
  std::string error;
  try {
    const step_result r =
        pipe.step({dgrad, n, dtype::f32}, {dparams, n, dtype::bf16}, device_order::after(compute));
    std::printf("step %s\n", r.applied ? "applied" : "not applied");
  } catch (const std::exception& e) {
    error = e.what();
  }
  cuda_double::clear_faults();
  std::printf("error: %s\nusable: %d\nreason: %s\n", error.c_str(), int(pipe.usable()),
              pipe.failure_reason().c_str());
  if (error.empty()) return 20; // every fault in this step must surface
  // Whichever call sees a fault at execution first reports it: a runtime call by the
  // runtime's name, a driver call (cuStreamWaitValue32) by the driver's.
  const auto names_fault = [](const std::string& text) {
    return text.find("cudaErrorLaunchFailure") != std::string::npos ||
           text.find("CUDA_ERROR_LAUNCH_FAILED") != std::string::npos;
  };
  if (!names_fault(error)) return 21;
  // The launch failure is sticky: the pipeline must refuse from now on, and say why.
  if (pipe.usable() || !names_fault(pipe.failure_reason())) return 22;
  bool refused = false;
  try {
    (void)pipe.step({dgrad, n, dtype::f32}, {dparams, n, dtype::bf16}, device_order::after(compute));
  } catch (const std::logic_error&) {
    refused = true;
  }
  if (!refused) return 23;
  // What the host holds is exactly what the error says: nothing updated, or chunks [0, k)
  // at step 1 (the synchronous step's bits) and the rest untouched, never anything else.
  std::size_t k = 0;
  if (error.find("nothing was updated") != std::string::npos ||
      error.find("no chunk was updated") != std::string::npos) {
    std::printf("state unchanged\n");
  } else if (error.find("every chunk was updated: the optimizer state holds step 1") != std::string::npos) {
    k = pipe.num_chunks();
    std::printf("every chunk stepped\n");
  } else {
    const auto at = error.find("chunks [0, ");
    if (at == std::string::npos || error.find("hold step 1 and the rest step 0") == std::string::npos)
      return 24;
    k = std::stoul(error.substr(at + 11));
    std::printf("chunks [0, %zu) stepped, the rest unchanged\n", k);
  }
  bool hidden = false;
  try {
    (void)opt.params(); // an optimizer the pipeline marked hides its state until told otherwise
  } catch (const std::runtime_error& e) {
    hidden = std::string(e.what()).find("not usable") != std::string::npos;
  }
  // A part-stepped state is hidden until the caller restores it. A whole step (the copy-out
  // failed) is finished: step count and state agree, so reset_failure() is all it takes.
  if (k > 0 && !hidden) return 25;
  if (hidden) opt.reset_failure();
  if (opt.step_count() != (k == pipe.num_chunks() ? 1 : 0)) return 28;
  optimizer stepped(small_model());
  stepped.step(const_view{ones.data(), n, dtype::f32});
  const std::size_t split = std::min(n, k * pipe.chunk_elems());
  if (std::memcmp(opt.params().data(), stepped.params().data(), split * 4) != 0) return 26;
  if (std::memcmp(opt.params().data() + split, untouched.params().data() + split, (n - split) * 4) != 0)
    return 27;
  std::printf("pipeline fault: ok\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--touch-device-memory") == 0) return touch_device_memory();
  if (argc == 2 && std::strcmp(argv[1], "--sticky-fault") == 0) return sticky_fault();
  for (const bool write : {false, true})
    for (const bool to_device : {false, true})
      if (argc == 2 && std::string(argv[1]) == std::string(write ? "--write" : "--read") +
                                                   "-pinned-during-copy-" + (to_device ? "from" : "into"))
        return touch_pinned_during_copy(write, to_device);
  if (argc == 3 && std::strcmp(argv[1], "--pipeline-fault") == 0) {
    try {
      return pipeline_fault(argv[2]);
    } catch (const std::exception& e) {
      std::printf("unexpected: %s\n", e.what());
      return 30;
    }
  }
  return Catch::Session().run(argc, argv);
}
