#pragma once
// The CUDA double's shared internals: the process state (settings, contexts, last and
// sticky errors, faults, violations), the memory model and the stream model's interface.
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "cuda_double.hpp"

namespace cuda_double::detail {

// --- settings ------------------------------------------------------------------------------
struct settings {
  std::uint64_t seed = 0;
  int devices = 2;
  std::uint64_t max_delay_ns = 200'000;
  double link_bytes_per_ns = 0;   // 0: copies take no modelled time
  double device_flops_per_ns = 0; // 0: launches' flops take no modelled time
  bool move_data = true;          // false: copies take their time and move nothing (timing runs)
};
const settings& config();

// --- errors ------------------------------------------------------------------------------
const char* runtime_error_name(cudaError_t e);
const char* runtime_error_string(cudaError_t e);
const char* driver_error_name(CUresult e);
const char* driver_error_string(CUresult e);
/// The cudaError_t or CUresult of a name, for fault specs; false when unknown.
bool error_by_name(const std::string& name, int& value, bool& driver);
/// The driver's code for a runtime error an operation ended with.
CUresult to_driver(cudaError_t e);
cudaError_t from_driver(CUresult e); // the runtime error that maps to it, else cudaErrorUnknown

// --- violations ------------------------------------------------------------------------------
/// A broken rule or a race: printed with the seed, then the process aborts (unless recording).
void violation(const std::string& text);

// --- call sites ------------------------------------------------------------------------------
struct call_site {
  void* frames[16] = {};
  int depth = 0;
};
call_site capture_call_site();
/// "function (file:line) <- caller (file:line) <- ...", the double's own frames skipped.
std::string describe(const call_site& site);

// --- contexts and per-thread runtime state ----------------------------------------------------
struct context { // shared by every thread: the counts are atomic
  int device = 0;
  std::atomic<int> retains{0};             // cuDevicePrimaryCtxRetain minus releases
  std::atomic<bool> runtime_active{false}; // the runtime initialized it (a runtime call, cudaSetDevice)
};
context* primary_context(int device); // null for a device that does not exist
bool is_context(const void* c);
context*& current_context(); // this thread's (driver view)
int& runtime_device();       // cudaSetDevice's choice when no context is current
/// The device a runtime call works on: the current context's; on a thread without one the
/// runtime's device, whose primary context is made current and active (as CUDA does).
int device_for_runtime_call();
cudaError_t& last_error();
/// The device's sticky error (cudaSuccess while healthy); the first one set stays.
cudaError_t sticky_error(int device);
void set_sticky_error(int device, cudaError_t e);

/// Every API function starts here: refuses a call made from a host function (a violation),
/// returns an injected fault if one is due. cudaSuccess: go on.
cudaError_t enter(const char* api);
/// enter() for a driver function: an injected fault as the CUresult it was named by.
CUresult enter_driver(const char* api);
/// Records `e` as the thread's last error (when it is one) and returns it.
cudaError_t result(cudaError_t e);
/// An injected execution fault for the next operation of `api`, or cudaSuccess.
cudaError_t execution_fault(const char* api);
bool& in_host_function();

// --- memory ------------------------------------------------------------------------------
/// One operation's byte range, for the race detector and the page-locked guard.
struct memory_access {
  std::uintptr_t begin = 0, end = 0;
  bool write = false;
};
enum class memory_kind { pageable, pinned, device };
struct memory_span {
  memory_kind kind = memory_kind::pageable;
  int device = -1;            // the allocating device (device memory), else -1
  void* view = nullptr;       // where the double reads and writes it
  bool inside = true;         // the whole range lies in the allocation
  const void* base = nullptr; // the allocation's start (device or pinned)
};
memory_span classify(const void* p, std::size_t bytes);
cudaError_t allocate_device_memory(void** p, std::size_t bytes, int device);
cudaError_t free_device_memory(void* p);
cudaError_t allocate_pinned_memory(void** p, std::size_t bytes, unsigned flags);
cudaError_t free_pinned_memory(void* p);
/// The pinned allocation's flags, or false when `p` is not a pinned allocation's address.
bool pinned_flags(const void* p, unsigned& flags);
/// Guards (on) or unguards the whole pages of a page-locked range while a copy that reads
/// or writes it executes: a host access to them then faults, named by the SIGSEGV handler.
void guard_host_range(const memory_access& r, bool on);


/// Resolves a stream argument (null, cudaStreamLegacy, cudaStreamPerThread or a stream
/// created here) on `device`; null when it is not a live stream (a violation is reported
/// for a destroyed one).
CUstream_st* resolve_stream(cudaStream_t s, int device, const char* api);
int stream_device(CUstream_st* s);

struct work {
  const char* api = "";
  std::vector<memory_access> accesses;
  std::function<void()> body;    // runs on the stream's worker; null for a marker
  std::uint64_t modelled_ns = 0; // it takes at least this long (the body's time included)
  int link = -1;                 // a copy's direction on its device's link (0: to the device, 1: to the host)
  std::vector<memory_access> host_guards; // page-locked ranges guarded while it executes
  cudaError_t fault = cudaSuccess; // the device fault it raises when it executes
  std::function<void()> on_fault;  // what it leaves behind then (a copy: its first half)
};
/// Enqueues `w` on `s`; returns its completion token.
std::shared_ptr<struct completion> enqueue(CUstream_st* s, work w);
/// cuStreamWaitValue32: the stream waits until (int32_t)(*word - value) >= 0 (GEQ), or the
/// other flags' conditions.
cudaError_t enqueue_wait_value(CUstream_st* s, const std::uint32_t* word, std::uint32_t value,
                               unsigned flags);
cudaError_t enqueue_host_function(CUstream_st* s, cudaHostFn_t fn, void* user);
cudaError_t enqueue_event_wait(CUstream_st* s, CUevent_st* e);
cudaError_t record_event(CUevent_st* e, CUstream_st* s);

/// Waits for `c` and tells the race detector the host now knows it happened.
/// The host blocks until `c` completes and, when `learn`, knows all that came before it.
void host_waits(const std::shared_ptr<completion>& c, bool learn = true);
bool host_queries(const std::shared_ptr<completion>& c);
std::shared_ptr<completion> stream_tail(CUstream_st* s);
/// Every operation enqueued so far on the device's streams.
std::vector<std::shared_ptr<completion>> device_tails(int device);
/// Waits until no operation that has not finished touches [p, p + bytes).
void wait_until_unused(const void* p, std::size_t bytes);

cudaError_t create_stream(CUstream_st** out, int device, unsigned flags);
cudaError_t destroy_stream(CUstream_st* s);
bool begin_capture(CUstream_st* s);
/// Ends a capture: false when it was invalidated (or never begun).
bool end_capture(CUstream_st* s);
bool capturing(CUstream_st* s);
void invalidate_capture(CUstream_st* s);

// --- events ------------------------------------------------------------------------------
cudaError_t create_event(CUevent_st** out, int device, unsigned flags);
CUevent_st* resolve_event(cudaEvent_t e, const char* api);
cudaError_t destroy_event(CUevent_st* e);
int event_device(CUevent_st* e);
unsigned event_flags(CUevent_st* e);
/// The completion of the event's current record (null: never recorded).
std::shared_ptr<completion> event_record(CUevent_st* e);
/// The record's completion time (steady_clock ns) once done.
std::int64_t completion_time_ns(const std::shared_ptr<completion>& c);
/// The sticky error an operation ran into (cudaSuccess if none).
cudaError_t completion_error(const std::shared_ptr<completion>& c);

} // namespace cuda_double::detail
