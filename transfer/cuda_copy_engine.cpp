// The CUDA engine: copy_engine's stream model on the CUDA runtime. Handles are the CUDA
// objects themselves (device_stream = cudaStream_t, device_event = cudaEvent_t), so a
// trainer passes its own streams and events. Only the runtime API is linked (this file is
// built by the host compiler against CUDA::cudart); the few driver functions we need
// (contexts, cuStreamWaitValue32, error names) are reached through the runtime's driver
// entry point (cudaGetDriverEntryPointByVersion from CUDA 12.5, cudaGetDriverEntryPoint
// before), and cuda.h is included for its types only.
//
// Contexts: the engine works in its device's primary context, retained at construction
// (cuDevicePrimaryCtxRetain, the context the runtime itself uses for that device) and
// released with the engine. Every call that reaches CUDA remembers the calling thread's
// current context (possibly none), makes the engine's current only when it is not already,
// and restores exactly the remembered one on return (device_scope, cuCtxGetCurrent /
// cuCtxSetCurrent). Never cudaGetDevice / cudaSetDevice: on a thread with no current
// context cudaGetDevice answers 0, and "restoring" device 0 with cudaSetDevice creates
// device 0's primary context (CUDA 12+), so every rank on device N > 0 would put a context
// on GPU 0 from the pipeline's worker thread. A thread without a context keeps none.
//
// Errors: every CUDA call goes through check(). Misuse that CUDA reports without touching
// the device (an invalid argument or handle, an event not completed yet, out of memory)
// throws std::invalid_argument / std::logic_error / std::runtime_error and leaves the
// engine usable. Any other error (a device fault such as cudaErrorIllegalAddress, reported
// by whichever call comes next, a failed launch, a host function that threw, a call CUDA
// refuses on a capturing stream) is sticky: its text is kept, sticky_error() returns it,
// and every later call that enqueues, synchronizes or creates throws std::runtime_error
// with exactly that text. The runtime's per-thread "last error" belongs to the trainer:
// the engine never calls cudaGetLastError except right after one of its own calls failed
// (forget_own_error), so a trainer's pending launch error survives every engine call.
//
// Flags: a 32-bit word of mapped page-locked memory. The device waits on it with a stream
// memory operation (cuStreamWaitValue32, CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value)
// >= 0), so the host releases device work with a plain store. Where the driver refuses
// stream memory operations (or HOSTOPT_CUDA_FLAG_WAIT=host_function forces it) a wait is a
// host function that blocks until the flag is reached. CUDA runs host functions on its own
// callback thread: a blocked one holds back the host functions of every stream of the
// process, not only its own stream's work, so this fallback is for correctness, not speed.
// Nothing the engine enqueued blocks forever: a fallback wait also returns once the engine
// is sticky-failed or being destroyed, and the destructor first writes every flag to the
// largest value any wait on it asked for (which, the waits being >= with wrap, lets every
// one of them go), then synchronizes its streams.
//
// Host functions the engine enqueued (launch_host_function, fallback flag waits) may sit on
// streams the engine does not own (a trainer's): the engine outlives none of them. Each
// counts itself in a block it shares with the engine, and release() waits until every one
// has run; a flag freed while a fallback wait on it is pending is let go and kept until
// that wait has returned.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <cuda.h> // types and enums only: nothing here links libcuda
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "hostopt/copy_engine.hpp"
#include "steady_clock.hpp"

#if CUDART_VERSION < 11070
#error "hostopt's CUDA engine needs CUDA 11.7 or later (cuStreamWaitValue32 v2, cudaGetDriverEntryPoint)"
#endif

namespace hostopt {

namespace {

using detail::now_ns;

/// Errors CUDA reports for a bad call without any device work having failed: the call is
/// refused and the context stays healthy, so the engine stays usable.
bool is_usage_error(cudaError_t rc) {
  switch (rc) {
  case cudaErrorInvalidValue:
  case cudaErrorInvalidResourceHandle:
  case cudaErrorInvalidDevicePointer:
  case cudaErrorInvalidMemcpyDirection:
  case cudaErrorInvalidDevice:
  case cudaErrorMemoryAllocation:
  case cudaErrorNotReady: return true;
  default: return false;
  }
}

/// After one of the engine's own runtime calls failed (and only then): that call also left
/// its error as the thread's "last error", where a trainer's next cudaGetLastError /
/// cudaPeekAtLastError would find it and blame its own kernel launch. The engine reports
/// the error itself (the return code or an exception), so it takes it back — only when the
/// pending error is that very code: where the runtime returned an error without recording
/// it (as a query's cudaErrorNotReady may be), a trainer's pending error stays where it
/// was. A sticky error (a lost context) is not cleared by cudaGetLastError and stays
/// visible, as it must.
void forget_own_error(cudaError_t rc) noexcept {
  if (rc != cudaSuccess && cudaPeekAtLastError() == rc) (void)cudaGetLastError();
}

/// A driver function by name, in the ABI of CUDA `version` (the version of the PFN_..._v
/// typedef it is cast to); null when the driver has none.
void* driver_entry_point(const char* symbol, unsigned version) noexcept {
  void* fn = nullptr;
#if CUDART_VERSION >= 12050
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t rc = cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &found);
  forget_own_error(rc);
  return rc == cudaSuccess && found == cudaDriverEntryPointSuccess ? fn : nullptr;
#elif CUDART_VERSION >= 12000
  // No ByVersion before 12.5: the symbol comes in the ABI of the runtime's own CUDA version,
  // which for every function used here is the typedef's (cuStreamWaitValue32 is v2 from
  // 11.7, cuDevicePrimaryCtxRelease v2 from 11.0, the rest never changed).
  (void)version;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t rc = cudaGetDriverEntryPoint(symbol, &fn, cudaEnableDefault, &found);
  forget_own_error(rc);
  return rc == cudaSuccess && found == cudaDriverEntryPointSuccess ? fn : nullptr;
#else
  // CUDA 11.x: no query result; a missing symbol is a null pointer or an error.
  (void)version;
  const cudaError_t rc = cudaGetDriverEntryPoint(symbol, &fn, cudaEnableDefault);
  forget_own_error(rc);
  return rc == cudaSuccess ? fn : nullptr;
#endif
}

/// A flag: one word of mapped, portable page-locked memory, and its device address.
struct flag_state {
  std::uint32_t* host = nullptr;
  CUdeviceptr device = 0;
  /// The largest value (in the waits' wrap-around order) any stream_wait_flag asked for,
  /// under flag_mu_: the value that lets every wait on this flag go.
  std::uint32_t highest_wait = 0;
  bool waited = false;
  /// Fallback waits enqueued on this flag and not returned yet (under flag_mu_): a freed
  /// flag with some is kept (retired) until they have.
  int pending_waits = 0;
};

/// What one of the engine's host functions carries (its trampoline's argument).
struct engine_host_call {
  virtual ~engine_host_call() = default;
};

/// The engine's host functions not run yet, shared with each of them: the last one's
/// sign-off must not touch an engine that release() may free right after. Each call's
/// block is freed here, under the lock, so that one CUDA will never run (after a device
/// fault) can be freed by release() without racing a trampoline that is finishing.
struct host_calls_in_flight : std::enable_shared_from_this<host_calls_in_flight> {
  std::mutex mu;
  std::condition_variable cv;
  std::unordered_set<engine_host_call*> queued, running;
  bool abandoned = false;
  void add(engine_host_call* c) {
    std::lock_guard<std::mutex> lock(mu);
    queued.insert(c);
  }
  /// CUDA calls it: from here on abandon() leaves it to finish(). False once abandoned:
  /// the trampoline returns at once, touching nothing.
  bool start(engine_host_call* c) {
    std::lock_guard<std::mutex> lock(mu);
    if (abandoned) return false;
    if (queued.erase(c)) running.insert(c);
    return true;
  }
  /// The call ran (or was never enqueued): its block is freed.
  void finish(engine_host_call* c) {
    std::lock_guard<std::mutex> lock(mu);
    if (running.erase(c) || queued.erase(c)) delete c;
    cv.notify_all();
  }
  bool wait_none_for(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [&] { return queued.empty() && running.empty(); });
  }
  /// After a device fault: the calls CUDA has not started are left behind (kept reachable
  /// for the process's life, never freed: one CUDA was handing over as the fault hit may
  /// still enter its trampoline, which then returns at once); those running are waited for.
  void abandon() {
    static std::mutex& left_mu = *new std::mutex;
    static auto& left_behind = *new std::vector<std::shared_ptr<host_calls_in_flight>>;
    std::unique_lock<std::mutex> lock(mu);
    abandoned = true;
    cv.wait(lock, [&] { return running.empty(); });
    lock.unlock();
    std::lock_guard<std::mutex> left(left_mu);
    left_behind.push_back(shared_from_this());
  }
};

bool flag_reached(const flag_state& f, std::uint32_t value) {
  const std::uint32_t now = std::atomic_ref<std::uint32_t>(*f.host).load(std::memory_order_acquire);
  return std::int32_t(now - value) >= 0; // CU_STREAM_WAIT_VALUE_GEQ's wrap-safe test
}

class cuda_copy_engine;

/// Argument of the fallback's blocking host function.
struct flag_wait final : engine_host_call {
  flag_wait(cuda_copy_engine* e, flag_state* f, std::uint32_t v, std::shared_ptr<host_calls_in_flight> i)
      : engine(e), flag(f), value(v), in_flight(std::move(i)) {}
  cuda_copy_engine* engine;
  flag_state* flag;
  std::uint32_t value;
  std::shared_ptr<host_calls_in_flight> in_flight;
};

class cuda_copy_engine final : public copy_engine {
public:
  explicit cuda_copy_engine(int device) : device_(device) {
    int count = 0;
    const cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess) {
      forget_own_error(rc); // "no device" or "no driver": reported by the exception
      throw std::runtime_error(std::string("cuda copy engine: cudaGetDeviceCount failed: ") +
                               cudaGetErrorName(rc) + ": " + cudaGetErrorString(rc));
    }
    if (device < 0 || device >= count)
      throw std::runtime_error("cuda copy engine: device " + std::to_string(device) + " does not exist (" +
                               std::to_string(count) + " visible)");
    resolve_driver_functions();
    retain_primary_context();
    try {
      device_scope scope(*this);
      check(cudaStreamCreateWithFlags(&private_stream_, cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags (private)");
      // Default flags (spin on synchronize): the host sees the calibration event complete
      // within a microsecond or so, which is the whole error of the time base.
      check(cudaEventCreateWithFlags(&calib_, cudaEventDefault), "cudaEventCreate (calibration)");
      calibrate();
      choose_flag_mechanism();
    } catch (...) {
      release();
      throw;
    }
  }

  ~cuda_copy_engine() override { release(); }

  /// Lets every flag wait go, waits for the engine's streams, then frees everything it
  /// created and releases its hold on the primary context.
  void release() noexcept {
    if (!ctx_) return;
    closing_.store(true, std::memory_order_release);
    release_flag_waits(); // and the fallback's blocked host functions see closing_
    {
      device_scope scope(*this, std::nothrow);
      // Errors here cannot be reported (noexcept); each one is our own call's.
      for (auto s : streams_) forget_own_error(cudaStreamSynchronize(s));
      if (private_stream_) forget_own_error(cudaStreamSynchronize(private_stream_));
      // Host functions on streams the engine does not own run when those streams reach
      // them (the flag waits among them now return at once): until then they use the engine.
      // A failed context never runs them (cudaLaunchHostFunc's functions are not called
      // after a device error): then their blocks are freed, never to be run. (An error the
      // engine keeps with the context healthy does not stop them: they run, and are waited.)
      while (!in_flight_->wait_none_for(std::chrono::milliseconds(10)))
        if (context_failed()) {
          in_flight_->abandon();
          break;
        }
      for (auto e : events_) forget_own_error(cudaEventDestroy(e));
      for (auto s : streams_) forget_own_error(cudaStreamDestroy(s));
      for (auto* f : flags_) {
        forget_own_error(cudaFreeHost(f->host));
        delete f;
      }
      for (auto* f : retired_flags_) {
        forget_own_error(cudaFreeHost(f->host));
        delete f;
      }
      for (auto* p : device_allocations_) forget_own_error(cudaFree(p));
      for (auto* p : pinned_allocations_) forget_own_error(cudaFreeHost(p));
      if (calib_) forget_own_error(cudaEventDestroy(calib_));
      if (wait_chain_) forget_own_error(cudaEventDestroy(wait_chain_));
      if (private_stream_) forget_own_error(cudaStreamDestroy(private_stream_));
    }
    streams_.clear();
    events_.clear();
    flags_.clear();
    retired_flags_.clear();
    device_allocations_.clear();
    pinned_allocations_.clear();
    calib_ = nullptr;
    wait_chain_ = nullptr;
    private_stream_ = nullptr;
    if (primary_ctx_release_) primary_ctx_release_(cu_device_);
    ctx_ = nullptr;
  }

  std::string_view name() const override { return "cuda"; }

  // --- memory ------------------------------------------------------------------------------
  void* allocate_device(std::size_t bytes) override {
    throw_if_sticky();
    if (bytes == 0) return nullptr;
    device_scope scope(*this);
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
    std::lock_guard<std::mutex> lock(owned_mu_);
    device_allocations_.insert(p);
    return p;
  }
  void free_device(void* p) noexcept override {
    if (!p) return;
    {
      std::lock_guard<std::mutex> lock(owned_mu_);
      if (device_allocations_.erase(p) == 0) return; // not ours, or freed already
    }
    device_scope scope(*this, std::nothrow);
    forget_own_error(cudaFree(p));
  }

  pinned_allocation allocate_pinned(std::size_t bytes) override {
    throw_if_sticky();
    if (bytes == 0) return {};
    device_scope scope(*this);
    void* p = nullptr;
    check(cudaHostAlloc(&p, bytes, cudaHostAllocPortable),
          ("cudaHostAlloc of " + std::to_string(bytes) + " bytes").c_str());
    std::lock_guard<std::mutex> lock(owned_mu_);
    pinned_allocations_.insert(p);
    return {p, true};
  }
  void free_pinned(pinned_allocation a, std::size_t) noexcept override {
    if (!a.data) return;
    {
      std::lock_guard<std::mutex> lock(owned_mu_);
      if (pinned_allocations_.erase(a.data) == 0) return;
    }
    device_scope scope(*this, std::nothrow);
    forget_own_error(cudaFreeHost(a.data));
  }

  // --- streams and events --------------------------------------------------------------------
  device_stream create_stream() override {
    throw_if_sticky();
    device_scope scope(*this);
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    std::lock_guard<std::mutex> lock(owned_mu_);
    streams_.insert(s);
    return {s};
  }
  // A stream the engine did not create (the trainer's) is synchronized, never destroyed.
  void destroy_stream(device_stream s) noexcept override {
    if (!s) return;
    const auto cs = stream(s);
    bool owned = false;
    {
      std::lock_guard<std::mutex> lock(owned_mu_);
      owned = streams_.erase(cs) != 0;
    }
    // After a sticky error nobody can count on flag-gated work any more, and a stream
    // waiting on a flag that will not be written would make this wait forever.
    if (sticky_set_.load(std::memory_order_acquire)) release_flag_waits();
    device_scope scope(*this, std::nothrow);
    forget_own_error(cudaStreamSynchronize(cs));
    if (owned) forget_own_error(cudaStreamDestroy(cs));
  }

  device_event create_event() override {
    throw_if_sticky();
    device_scope scope(*this);
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventBlockingSync),
          "cudaEventCreateWithFlags (blocking sync, timing)");
    std::lock_guard<std::mutex> lock(owned_mu_);
    events_.insert(e);
    return {e};
  }
  // As destroy_stream: an event the engine did not create is left to its owner.
  void destroy_event(device_event e) noexcept override {
    if (!e) return;
    const auto ce = event(e);
    {
      std::lock_guard<std::mutex> lock(owned_mu_);
      if (events_.erase(ce) == 0) return;
    }
    device_scope scope(*this, std::nothrow);
    forget_own_error(cudaEventDestroy(ce)); // CUDA releases it once its pending record completes
  }

  void record_event(device_event e, device_stream s) override {
    enter("record_event", e, s);
    device_scope scope(*this);
    check(cudaEventRecord(event(e), stream(s)), "cudaEventRecord");
  }

  void stream_wait_event(device_stream s, device_event e) override {
    enter("stream_wait_event", e, s);
    device_scope scope(*this);
    check(cudaStreamWaitEvent(stream(s), event(e), 0), "cudaStreamWaitEvent");
  }

  void synchronize_event(device_event e) override {
    enter("synchronize_event", e);
    device_scope scope(*this);
    check(cudaEventSynchronize(event(e)), "cudaEventSynchronize");
  }

  bool event_done(device_event e) override {
    enter("event_done", e);
    device_scope scope(*this);
    const cudaError_t rc = cudaEventQuery(event(e));
    if (rc == cudaErrorNotReady) {
      forget_own_error(rc); // an answer, not an error: cudaEventQuery records it all the same
      return false;
    }
    check(rc, "cudaEventQuery");
    return true;
  }

  // cudaEventElapsedTime from a calibration event whose steady_clock time we know. Its
  // float milliseconds keep ~60 ns within 1 s of the base, so the base moves to "now"
  // when an event lies further than that from it (and the base is over a second old).
  std::int64_t event_time_ns(device_event e) override {
    enter("event_time_ns", e);
    device_scope scope(*this);
    std::lock_guard<std::mutex> lock(calib_mu_);
    float ms = elapsed_since_calibration(event(e));
    if (std::fabs(ms) > 1000.0f && now_ns() - calib_ns_ > 1'000'000'000) {
      calibrate();
      ms = elapsed_since_calibration(event(e));
    }
    return calib_ns_ + std::llround(double(ms) * 1e6);
  }

  void synchronize_stream(device_stream s) override {
    enter("synchronize_stream", s);
    device_scope scope(*this);
    check(cudaStreamSynchronize(stream(s)), "cudaStreamSynchronize");
  }

  // --- work -----------------------------------------------------------------------------------
  void copy_async(device_stream s, copy_direction dir, void* dst, const void* src,
                  std::size_t bytes) override {
    enter("copy_async", s);
    if (bytes == 0) return;
    if (!dst || !src)
      throw std::invalid_argument("cuda copy engine: copy_async of " + std::to_string(bytes) +
                                  " bytes with a null " + (dst ? "source" : "destination"));
    device_scope scope(*this);
    if (dir == copy_direction::to_host)
      check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream(s)),
            "cudaMemcpyAsync (device to host)");
    else if (dir == copy_direction::to_device)
      check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream(s)),
            "cudaMemcpyAsync (host to device)");
    else
      throw std::invalid_argument("cuda copy engine: copy direction " + std::to_string(int(dir)) +
                                  " is neither to_host (0) nor to_device (1)");
  }

  void launch_host_function(device_stream s, std::function<void()> fn) override {
    enter("launch_host_function", s);
    if (!fn) throw std::invalid_argument("cuda copy engine: launch_host_function with an empty function");
    device_scope scope(*this);
    refuse_capture(s, "launch_host_function");
    auto* call = new host_call(this, std::move(fn), in_flight_);
    in_flight_->add(call);
    const cudaError_t rc = cudaLaunchHostFunc(stream(s), &host_call_trampoline, call);
    if (rc != cudaSuccess) { // not enqueued: the trampoline will never run
      in_flight_->finish(call);
    }
    check(rc, "cudaLaunchHostFunc");
  }

  // --- flags ----------------------------------------------------------------------------------
  device_flag allocate_flag() override {
    throw_if_sticky();
    device_scope scope(*this);
    void* host = nullptr;
    check(cudaHostAlloc(&host, sizeof(std::uint32_t), cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc (mapped flag word)");
    void* dev = nullptr;
    const cudaError_t rc = cudaHostGetDevicePointer(&dev, host, 0);
    if (rc != cudaSuccess) {
      forget_own_error(cudaFreeHost(host));
      check(rc, "cudaHostGetDevicePointer (flag word)"); // throws
    }
    std::memset(host, 0, sizeof(std::uint32_t));
    auto* f = new flag_state{static_cast<std::uint32_t*>(host), reinterpret_cast<CUdeviceptr>(dev)};
    std::lock_guard<std::mutex> lock(owned_mu_);
    flags_.insert(f);
    return {f};
  }
  /// Waits on `f` still pending (on streams that have not reached them) are let go: the
  /// flag is written to the largest value any asked for. Its word is freed only when no
  /// wait can read it any more: at once if it was never waited on; a flag with fallback
  /// waits pending once their host functions returned; one a device wait (stream memory
  /// operation) read at the engine's end, after its streams (a page-locked word each: an
  /// engine that makes and frees flags without end should be remade now and then).
  void free_flag(device_flag f) noexcept override {
    if (!f) return;
    auto* fs = static_cast<flag_state*>(f.handle);
    std::vector<flag_state*> done;
    {
      std::lock_guard<std::mutex> lock(owned_mu_);
      if (flags_.erase(fs) == 0) return;
      {
        std::lock_guard<std::mutex> flags(flag_mu_);
        if (fs->waited && !flag_reached(*fs, fs->highest_wait))
          std::atomic_ref<std::uint32_t>(*fs->host).store(fs->highest_wait, std::memory_order_release);
        // A device wait (stream memory operation) may still read the word, and nothing says
        // when it has: such a flag is kept until the engine's end, after its streams.
        if (fs->pending_waits > 0 || (fs->waited && wait_value32_)) {
          retired_flags_.push_back(fs);
          fs = nullptr;
        }
        // Retired flags whose waits have all returned since.
        auto idle = std::stable_partition(retired_flags_.begin(), retired_flags_.end(), [&](const flag_state* r) {
          return r->pending_waits > 0 || (r->waited && wait_value32_);
        });
        done.assign(idle, retired_flags_.end());
        retired_flags_.erase(idle, retired_flags_.end());
      }
      if (fs) done.push_back(fs);
    }
    flag_cv_.notify_all(); // the fallback's waits on it go
    device_scope scope(*this, std::nothrow);
    for (auto* d : done) {
      forget_own_error(cudaFreeHost(d->host));
      delete d;
    }
  }

  void stream_wait_flag(device_stream s, device_flag f, std::uint32_t value) override {
    enter("stream_wait_flag", s);
    flag_state& fs = flag(f);
    device_scope scope(*this);
    // Before anything is enqueued or noted (the chain's event wait would itself be refused
    // by a capture, and sticky).
    if (!wait_value32_) refuse_capture(s, "stream_wait_flag (the host-function fallback)");
    note_wait(fs, value);
    if (wait_value32_) {
      const CUresult rc =
          wait_value32_(reinterpret_cast<CUstream>(stream(s)), fs.device, value, CU_STREAM_WAIT_VALUE_GEQ);
      if (rc != CUDA_SUCCESS) driver_failed(rc, "cuStreamWaitValue32");
      return;
    }
    // Fallback. A flag already at `value` stays there (flags are counters that only move
    // forward, as the pipeline's do), so that wait costs no host function: fewer blocked
    // callbacks holding CUDA's host-function thread.
    if (flag_reached(fs, value)) return;
    // CUDA may run host functions of independent streams in any order on one thread
    // (cudaLaunchHostFunc: "may be serialized"), so a blocked wait could hold back the
    // wait that must pass first for the CPU to write its flag: the pipeline releasing
    // chunk k's copy-out while chunk k's copy-in still sits behind its own wait. Chaining
    // every fallback wait after the previous one (an event: no host function) makes them
    // run in the order they were enqueued, the order in which callers make them satisfiable.
    // The price: a wait is also ordered after the previous wait's stream's earlier work. A
    // private stream holding the waits instead would start blocking CUDA's host-function
    // thread before `s` reached the wait, deadlocking when work before it on `s` (or on what
    // `s` waits for) is itself a host function that must run first.
    std::lock_guard<std::mutex> chain_lock(chain_mu_);
    if (!wait_chain_)
      check(cudaEventCreateWithFlags(&wait_chain_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    else if (wait_chain_recorded_)
      check(cudaStreamWaitEvent(stream(s), wait_chain_, 0), "cudaStreamWaitEvent");
    auto* w = new flag_wait(this, &fs, value, in_flight_);
    in_flight_->add(w);
    {
      std::lock_guard<std::mutex> lock(flag_mu_);
      ++fs.pending_waits;
    }
    const cudaError_t rc = cudaLaunchHostFunc(stream(s), &flag_wait_trampoline, w);
    if (rc != cudaSuccess) { // not enqueued: the trampoline will never run
      {
        std::lock_guard<std::mutex> lock(flag_mu_);
        --fs.pending_waits;
      }
      in_flight_->finish(w);
    }
    check(rc, "cudaLaunchHostFunc (flag wait)");
    check(cudaEventRecord(wait_chain_, stream(s)), "cudaEventRecord");
    wait_chain_recorded_ = true;
  }

  // A host store, no CUDA call: the release orders the host's writes before it (e.g. the
  // parameters of a chunk) before the device work the flag lets go.
  void write_flag(device_flag f, std::uint32_t value) override {
    flag_state& fs = flag(f);
    if (wait_value32_) {
      std::atomic_ref<std::uint32_t>(*fs.host).store(value, std::memory_order_release);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(flag_mu_);
      std::atomic_ref<std::uint32_t>(*fs.host).store(value, std::memory_order_release);
    }
    flag_cv_.notify_all();
  }

  std::string flag_mechanism() const override {
    return wait_value32_ ? "stream memory operations (cuStreamWaitValue32)"
                         : "host function (cudaLaunchHostFunc) blocking the stream";
  }

  std::string sticky_error() const override {
    std::lock_guard<std::mutex> lock(error_mu_);
    return sticky_;
  }

  // --- used by the host-function trampolines (CUDA's callback thread) --------------------------
  void host_function_failed(const std::string& what) noexcept {
    try {
      make_sticky("cuda device " + std::to_string(device_) +
                  ": a host function (cudaLaunchHostFunc) threw: " + what);
    } catch (...) {
    }
  }
  /// The fallback's wait. Also returns when the engine failed (sticky) or is being
  /// destroyed: CUDA has one callback thread for the whole process, and a wait nobody will
  /// release must not hold it (and every stream's host functions) forever. The work after
  /// it then runs on data the flag did not vouch for, which is what a failed engine's
  /// remaining work is worth anyway.
  void wait_for_flag(flag_state& f, std::uint32_t value) {
    std::unique_lock<std::mutex> lock(flag_mu_);
    // The timeout re-reads the word: a write that did not go through write_flag (the
    // device's, or another process's) still lets the wait go.
    while (!flag_reached(f, value) && !closing_.load(std::memory_order_acquire) &&
           !sticky_set_.load(std::memory_order_acquire))
      flag_cv_.wait_for(lock, std::chrono::milliseconds(1));
  }
  /// A fallback wait on `f` has returned (or failed): from here on free_flag may free it.
  void flag_wait_returned(flag_state& f) noexcept {
    std::lock_guard<std::mutex> lock(flag_mu_);
    --f.pending_waits;
  }

private:
  /// Makes the engine's context current when it is not; the destructor makes the caller's
  /// previous context (possibly none) current again.
  class device_scope {
  public:
    explicit device_scope(cuda_copy_engine& e) : engine_(e) {
      CUresult rc = e.ctx_get_(&previous_);
      if (rc != CUDA_SUCCESS) e.driver_failed(rc, "cuCtxGetCurrent");
      if (previous_ != e.ctx_) {
        rc = e.ctx_set_(e.ctx_);
        if (rc != CUDA_SUCCESS) e.driver_failed(rc, "cuCtxSetCurrent (the device's primary context)");
        restore_ = true;
      }
    }
    device_scope(cuda_copy_engine& e, std::nothrow_t) noexcept : engine_(e) {
      if (!e.ctx_ || e.ctx_get_(&previous_) != CUDA_SUCCESS) return;
      if (previous_ != e.ctx_) restore_ = e.ctx_set_(e.ctx_) == CUDA_SUCCESS;
    }
    ~device_scope() {
      if (restore_) engine_.ctx_set_(previous_);
    }
    device_scope(const device_scope&) = delete;
    device_scope& operator=(const device_scope&) = delete;

  private:
    cuda_copy_engine& engine_;
    CUcontext previous_ = nullptr;
    bool restore_ = false;
  };

  struct host_call final : engine_host_call {
    host_call(cuda_copy_engine* e, std::function<void()> f, std::shared_ptr<host_calls_in_flight> i)
        : engine(e), fn(std::move(f)), in_flight(std::move(i)) {}
    cuda_copy_engine* engine;
    std::function<void()> fn;
    std::shared_ptr<host_calls_in_flight> in_flight;
  };

  // Each trampoline signs off last: once it has, release() may free the engine.
  static void CUDART_CB host_call_trampoline(void* p) {
    auto* call = static_cast<host_call*>(p);
    if (!call->in_flight->start(call)) return; // abandoned after a device fault
    try {
      call->fn();
    } catch (const std::exception& e) {
      call->engine->host_function_failed(e.what());
    } catch (...) {
      call->engine->host_function_failed("an exception that is not a std::exception");
    }
    call->fn = nullptr; // the user's captures go before the engine may
    const auto in_flight = call->in_flight; // keeps the block alive through finish()
    in_flight->finish(call);
  }

  static void CUDART_CB flag_wait_trampoline(void* p) {
    auto* w = static_cast<flag_wait*>(p);
    if (!w->in_flight->start(w)) return; // abandoned after a device fault
    try {
      w->engine->wait_for_flag(*w->flag, w->value);
    } catch (...) {
      w->engine->host_function_failed("waiting for a flag");
    }
    w->engine->flag_wait_returned(*w->flag);
    const auto in_flight = w->in_flight; // keeps the block alive through finish()
    in_flight->finish(w);
  }

  static cudaStream_t stream(device_stream s) { return static_cast<cudaStream_t>(s.handle); }
  static cudaEvent_t event(device_event e) { return static_cast<cudaEvent_t>(e.handle); }
  static flag_state& flag(device_flag f) {
    if (!f) throw std::invalid_argument("cuda copy engine: empty device_flag (use allocate_flag)");
    return *static_cast<flag_state*>(f.handle);
  }

  /// Writes every flag that some wait asked for more than it holds to the largest value
  /// asked for: with >= waits (wrap-safe), that lets every one of them go. For streams that
  /// may wait on flags nobody will write any more (a pipeline that failed, an engine used
  /// alone): the engine's destruction, and a stream destroyed after a sticky error.
  void release_flag_waits() noexcept {
    {
      std::lock_guard<std::mutex> owned(owned_mu_);
      std::lock_guard<std::mutex> lock(flag_mu_);
      for (auto* f : flags_)
        if (f->waited && !flag_reached(*f, f->highest_wait))
          std::atomic_ref<std::uint32_t>(*f->host).store(f->highest_wait, std::memory_order_release);
    }
    flag_cv_.notify_all();
  }

  /// Remembers the largest value waited for on `f` (wrap-around order, as the wait's).
  void note_wait(flag_state& f, std::uint32_t value) {
    std::lock_guard<std::mutex> lock(flag_mu_);
    if (!f.waited || std::int32_t(value - f.highest_wait) > 0) f.highest_wait = value;
    f.waited = true;
  }

  /// The engine's host functions run once per enqueue, counted until they have: one captured
  /// into a graph would run once per launch of it, or never.
  void refuse_capture(device_stream s, const char* call) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t rc = cudaStreamIsCapturing(stream(s), &status);
    // The legacy stream while another stream of the context is captured: as good as capturing.
    if (rc == cudaErrorStreamCaptureImplicit) {
      forget_own_error(rc);
      status = cudaStreamCaptureStatusActive;
    } else {
      check(rc, "cudaStreamIsCapturing");
    }
    if (status != cudaStreamCaptureStatusNone)
      throw std::invalid_argument(std::string("cuda copy engine: ") + call +
                                  " on a stream being captured into a graph: the engine's host functions are not "
                                  "graph nodes (enqueue them outside the capture)");
  }

  /// Whether the context has failed (a device fault): an idle stream's query answers the
  /// sticky error then. Only errors that end a context count: another (e.g. a query refused
  /// during another thread's graph capture) says nothing of it, and CUDA still runs the
  /// host functions. For teardown only: the error is forgotten, not kept.
  bool context_failed() noexcept {
    if (!private_stream_) return false;
    const cudaError_t rc = cudaStreamQuery(private_stream_);
    forget_own_error(rc);
    switch (rc) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorUnknown: return true;
    default: return false;
    }
  }

  /// The checks every enqueuing or synchronizing call starts with: not poisoned, and no
  /// empty handle (CUDA would read a null stream as the legacy default stream; pass
  /// cudaStreamLegacy for that on purpose).
  void enter(const char* call, device_stream s) {
    throw_if_sticky();
    if (!s)
      throw std::invalid_argument(std::string("cuda copy engine: ") + call + " with an empty device_stream");
  }
  void enter(const char* call, device_event e) {
    throw_if_sticky();
    if (!e)
      throw std::invalid_argument(std::string("cuda copy engine: ") + call + " with an empty device_event");
  }
  void enter(const char* call, device_event e, device_stream s) {
    enter(call, s);
    enter(call, e);
  }

  void throw_if_sticky() const {
    if (!sticky_set_.load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> lock(error_mu_);
    throw std::runtime_error(sticky_);
  }

  void make_sticky(const std::string& text) {
    {
      std::lock_guard<std::mutex> lock(error_mu_);
      if (sticky_.empty()) {
        sticky_ = text;
        sticky_set_.store(true, std::memory_order_release);
      }
    }
    flag_cv_.notify_all(); // the fallback's waits give up (wait_for_flag)
  }

  /// The one checking helper: a usage error throws and leaves the engine usable; any other
  /// error becomes the sticky error (the first one wins) and throws its text. Either way
  /// the error was this call's own and is reported by the exception, so it is taken back
  /// from the thread's last error (forget_own_error).
  void check(cudaError_t rc, const char* what) {
    if (rc == cudaSuccess) return;
    forget_own_error(rc);
    const std::string text = "cuda device " + std::to_string(device_) + ": " + what +
                             " failed: " + cudaGetErrorName(rc) + ": " + cudaGetErrorString(rc);
    if (is_usage_error(rc)) {
      if (rc == cudaErrorMemoryAllocation) throw std::runtime_error(text);
      if (rc == cudaErrorNotReady) throw std::logic_error(text);
      throw std::invalid_argument(text);
    }
    make_sticky(text);
    throw std::runtime_error(sticky_error());
  }

  std::string driver_error_text(CUresult rc, const char* what) const {
    const char* name = "CUDA_ERROR_?";
    const char* desc = "unknown driver error";
    if (get_error_name_) get_error_name_(rc, &name);
    if (get_error_string_) get_error_string_(rc, &desc);
    return "cuda device " + std::to_string(device_) + ": " + what + " failed: " + name + ": " + desc;
  }

  [[noreturn]] void driver_failed(CUresult rc, const char* what) {
    const std::string text = driver_error_text(rc, what);
    if (rc == CUDA_ERROR_INVALID_VALUE || rc == CUDA_ERROR_INVALID_HANDLE) throw std::invalid_argument(text);
    make_sticky(text);
    throw std::runtime_error(sticky_error());
  }

  float elapsed_since_calibration(cudaEvent_t e) {
    float ms = 0;
    const cudaError_t rc = cudaEventElapsedTime(&ms, calib_, e);
    if (rc == cudaErrorNotReady) {
      forget_own_error(rc);
      throw std::logic_error("cuda copy engine: event_time_ns of an event whose record has not completed");
    }
    if (rc == cudaErrorInvalidResourceHandle) {
      forget_own_error(rc);
      throw std::invalid_argument(
          "cuda copy engine: event_time_ns of an event never recorded, or created with "
          "cudaEventDisableTiming");
    }
    check(rc, "cudaEventElapsedTime");
    return ms;
  }

  /// The time base: `calib_` recorded on an idle private stream, and steady_clock read as
  /// soon as the host sees it complete. A try the OS interrupted (over 50 us between
  /// recording and seeing it) is taken again, up to 5 times.
  void calibrate() {
    for (int attempt = 0; attempt < 5; ++attempt) {
      const std::int64_t before = now_ns();
      check(cudaEventRecord(calib_, private_stream_), "cudaEventRecord (calibration)");
      check(cudaEventSynchronize(calib_), "cudaEventSynchronize (calibration)");
      calib_ns_ = now_ns();
      if (calib_ns_ - before < 50'000) break;
    }
  }

  /// The driver functions the engine calls directly. Contexts and the device's primary
  /// context have been in every driver since CUDA 4 / 7: their absence is an error.
  void resolve_driver_functions() {
    get_error_name_ = reinterpret_cast<PFN_cuGetErrorName_v6000>(driver_entry_point("cuGetErrorName", 6000));
    get_error_string_ =
        reinterpret_cast<PFN_cuGetErrorString_v6000>(driver_entry_point("cuGetErrorString", 6000));
    ctx_get_ = reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(driver_entry_point("cuCtxGetCurrent", 4000));
    ctx_set_ = reinterpret_cast<PFN_cuCtxSetCurrent_v4000>(driver_entry_point("cuCtxSetCurrent", 4000));
    device_get_ = reinterpret_cast<PFN_cuDeviceGet_v2000>(driver_entry_point("cuDeviceGet", 2000));
    primary_ctx_retain_ = reinterpret_cast<PFN_cuDevicePrimaryCtxRetain_v7000>(
        driver_entry_point("cuDevicePrimaryCtxRetain", 7000));
    primary_ctx_release_ = reinterpret_cast<PFN_cuDevicePrimaryCtxRelease_v11000>(
        driver_entry_point("cuDevicePrimaryCtxRelease", 11000));
    const char* missing = !ctx_get_               ? "cuCtxGetCurrent"
                          : !ctx_set_             ? "cuCtxSetCurrent"
                          : !device_get_          ? "cuDeviceGet"
                          : !primary_ctx_retain_  ? "cuDevicePrimaryCtxRetain"
                          : !primary_ctx_release_ ? "cuDevicePrimaryCtxRelease"
                                                  : nullptr;
    if (missing)
      throw std::runtime_error(std::string("cuda copy engine: the driver's entry point has no ") + missing);
  }

  /// The device's primary context (the runtime's for that device), held until release().
  /// Retained, not made current: the constructor's caller keeps its own context, or none.
  void retain_primary_context() {
    CUresult rc = device_get_(&cu_device_, device_);
    if (rc != CUDA_SUCCESS)
      throw std::runtime_error(
          driver_error_text(rc, ("cuDeviceGet(" + std::to_string(device_) + ")").c_str()));
    CUcontext ctx = nullptr;
    rc = primary_ctx_retain_(&ctx, cu_device_);
    if (rc != CUDA_SUCCESS || !ctx)
      throw std::runtime_error(driver_error_text(rc, "cuDevicePrimaryCtxRetain"));
    ctx_ = ctx;
  }

  /// Stream memory operations when the driver has cuStreamWaitValue32 and accepts one on
  /// this device (a wait on a word that already holds the value, on the private stream);
  /// otherwise the host-function fallback. HOSTOPT_CUDA_FLAG_WAIT=host_function forces
  /// the fallback, =stream_memory_operations makes its absence an error.
  void choose_flag_mechanism() {
    const char* env = std::getenv("HOSTOPT_CUDA_FLAG_WAIT");
    const std::string forced = env ? env : "";
    if (!forced.empty() && forced != "host_function" && forced != "stream_memory_operations")
      throw std::invalid_argument("HOSTOPT_CUDA_FLAG_WAIT='" + forced +
                                  "': expected host_function or stream_memory_operations");
    if (forced == "host_function") return;

    std::string why;
    auto wait =
        reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(driver_entry_point("cuStreamWaitValue32", 11070));
    if (!wait) why = "the driver has no cuStreamWaitValue32 (v2)";
    if (wait) {
      // The probe: a flag at 0 and a wait for >= 0, which the device passes at once.
      device_flag probe = allocate_flag();
      const CUresult rc =
          wait(reinterpret_cast<CUstream>(private_stream_), flag(probe).device, 0, CU_STREAM_WAIT_VALUE_GEQ);
      const cudaError_t sync = cudaStreamSynchronize(private_stream_);
      free_flag(probe);
      check(sync, "cudaStreamSynchronize (stream memory operation probe)");
      if (rc == CUDA_SUCCESS) {
        wait_value32_ = wait;
        return;
      }
      const char* name = "?";
      if (get_error_name_) get_error_name_(rc, &name);
      why = std::string("cuStreamWaitValue32 returned ") + name;
    }
    if (forced == "stream_memory_operations")
      throw std::runtime_error("cuda copy engine: HOSTOPT_CUDA_FLAG_WAIT=stream_memory_operations, but " +
                               why);
  }

  const int device_;
  CUdevice cu_device_ = 0;
  CUcontext ctx_ = nullptr; // the device's primary context, retained; null once released

  mutable std::mutex error_mu_;
  std::string sticky_;
  std::atomic<bool> sticky_set_{false};
  std::atomic<bool> closing_{false}; // release() has begun: fallback waits give up
  std::shared_ptr<host_calls_in_flight> in_flight_ = std::make_shared<host_calls_in_flight>();

  std::mutex owned_mu_; // what the destructor frees
  std::unordered_set<cudaStream_t> streams_;
  std::unordered_set<cudaEvent_t> events_;
  std::unordered_set<flag_state*> flags_;
  std::vector<flag_state*> retired_flags_; // freed by the user, fallback waits pending (free_flag)
  std::unordered_set<void*> device_allocations_;
  std::unordered_set<void*> pinned_allocations_;

  cudaStream_t private_stream_ = nullptr; // idle but for calibration and the probe
  std::mutex calib_mu_;
  cudaEvent_t calib_ = nullptr;
  std::int64_t calib_ns_ = 0;

  PFN_cuStreamWaitValue32_v11070 wait_value32_ = nullptr; // null: the host-function fallback
  PFN_cuGetErrorName_v6000 get_error_name_ = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string_ = nullptr;
  PFN_cuCtxGetCurrent_v4000 ctx_get_ = nullptr;
  PFN_cuCtxSetCurrent_v4000 ctx_set_ = nullptr;
  PFN_cuDeviceGet_v2000 device_get_ = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 primary_ctx_retain_ = nullptr;
  PFN_cuDevicePrimaryCtxRelease_v11000 primary_ctx_release_ = nullptr;
  std::mutex chain_mu_;              // the fallback's waits run in enqueue order: see stream_wait_flag
  cudaEvent_t wait_chain_ = nullptr; // recorded after the last fallback wait enqueued
  bool wait_chain_recorded_ = false;
  std::mutex flag_mu_; // the fallback's waits, write_flag's notify, each flag's highest_wait
  std::condition_variable flag_cv_;
};

} // namespace

bool cuda_device_available() noexcept {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  forget_own_error(rc); // "no device" or "no driver" is an answer, not an error to keep
  return rc == cudaSuccess && count > 0;
}

std::unique_ptr<copy_engine> make_cuda_copy_engine(int device) {
  return std::make_unique<cuda_copy_engine>(device);
}

} // namespace hostopt
