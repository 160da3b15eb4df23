// The CUDA double's runtime API: the cuda* functions hostopt, its tests, examples and
// benchmarks call, with libcudart's signatures (the toolkit's own declarations).
#include <cstring>
#include <string>

#include "double_internal.hpp"

using namespace cuda_double::detail;

namespace {

// The common prologue of a call that works on a device: rule checks and injected faults,
// the device (making its primary context current as CUDA's runtime does), its sticky error.
struct device_call {
  cudaError_t error = cudaSuccess;
  int device = -1;
  explicit device_call(const char* api) {
    error = enter(api);
    if (error != cudaSuccess) return;
    device = device_for_runtime_call();
    if (device < 0) {
      error = cudaErrorInvalidDevice;
      return;
    }
    error = sticky_error(device);
  }
};

// A stream argument that must be live and belong to the current device.
cudaError_t stream_for(cudaStream_t s, int device, const char* api, CUstream_st*& out) {
  out = resolve_stream(s, device, api);
  if (!out) return cudaErrorInvalidResourceHandle;
  if (stream_device(out) != device)
    return cudaErrorInvalidResourceHandle; // stricter: current device's streams only
  if (capturing(out)) {
    invalidate_capture(out);
    return cudaErrorStreamCaptureUnsupported; // the double does not build graphs
  }
  return cudaSuccess;
}

std::uint64_t copy_time_ns(std::size_t bytes) {
  const double rate = config().link_bytes_per_ns;
  return rate > 0 ? std::uint64_t(double(bytes) / rate) : 0;
}

memory_access range_of(const void* p, std::size_t n, bool write) {
  const auto b = reinterpret_cast<std::uintptr_t>(p);
  return {b, b + n, write};
}

} // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  if (cudaError_t e = enter("cudaGetDeviceCount"); e != cudaSuccess) return result(e);
  if (!count) return result(cudaErrorInvalidValue);
  *count = config().devices;
  return result(config().devices > 0 ? cudaSuccess : cudaErrorNoDevice);
}

cudaError_t cudaGetDevice(int* device) {
  if (cudaError_t e = enter("cudaGetDevice"); e != cudaSuccess) return result(e);
  if (!device) return result(cudaErrorInvalidValue);
  // No context is created: a thread without one reports the runtime's device (0 at first).
  *device = current_context() ? current_context()->device : runtime_device();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (cudaError_t e = enter("cudaSetDevice"); e != cudaSuccess) return result(e);
  context* c = primary_context(device);
  if (!c) return result(cudaErrorInvalidDevice);
  runtime_device() = device;
  c->runtime_active = true; // CUDA 12+: cudaSetDevice initializes the primary context
  current_context() = c;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (cudaError_t e = enter("cudaGetDeviceProperties"); e != cudaSuccess) return result(e);
  if (!prop) return result(cudaErrorInvalidValue);
  if (!primary_context(device)) return result(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof *prop);
  std::snprintf(prop->name, sizeof prop->name, "hostopt CUDA double (test only)");
  prop->totalGlobalMem = std::size_t(80) << 30;
  prop->multiProcessorCount = 4;
  prop->major = 9;
  prop->minor = 0;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->unifiedAddressing = 1;
  prop->canMapHostMemory = 1;
  prop->asyncEngineCount = 2;
  prop->concurrentKernels = 1;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (cudaError_t e = enter("cudaDeviceGetAttribute"); e != cudaSuccess) return result(e);
  if (!value) return result(cudaErrorInvalidValue);
  if (!primary_context(device)) return result(cudaErrorInvalidDevice);
  switch (attr) {
  case cudaDevAttrMultiProcessorCount: *value = 4; break;
  case cudaDevAttrWarpSize: *value = 32; break;
  case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
  case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
  case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
  case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
  case cudaDevAttrUnifiedAddressing:
  case cudaDevAttrCanMapHostMemory:
  case cudaDevAttrConcurrentKernels: *value = 1; break;
  default: return result(cudaErrorInvalidValue); // not modelled: say so rather than invent
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  device_call call("cudaDeviceSynchronize");
  if (call.error != cudaSuccess) return result(call.error);
  for (const auto& c : device_tails(call.device)) host_waits(c);
  return result(sticky_error(call.device));
}

cudaError_t cudaDriverGetVersion(int* v) {
  if (!v) return result(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  if (!v) return result(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

// --- errors ------------------------------------------------------------------------------------
cudaError_t cudaGetLastError(void) {
  const cudaError_t e = last_error();
  // A sticky error is not cleared: it stays the answer for the context's lifetime.
  const int device = current_context() ? current_context()->device : runtime_device();
  const cudaError_t sticky = sticky_error(device);
  if (sticky != cudaSuccess) return sticky;
  last_error() = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) {
  const int device = current_context() ? current_context()->device : runtime_device();
  const cudaError_t sticky = sticky_error(device);
  return sticky != cudaSuccess ? sticky : last_error();
}
const char* cudaGetErrorName(cudaError_t e) { return runtime_error_name(e); }
const char* cudaGetErrorString(cudaError_t e) { return runtime_error_string(e); }

// --- memory ------------------------------------------------------------------------------------
cudaError_t cudaMalloc(void** p, size_t bytes) {
  device_call call("cudaMalloc");
  if (call.error != cudaSuccess) return result(call.error);
  if (!p) return result(cudaErrorInvalidValue);
  if (bytes == 0) {
    *p = nullptr;
    return cudaSuccess;
  }
  return result(allocate_device_memory(p, bytes, call.device));
}

cudaError_t cudaFree(void* p) {
  device_call call("cudaFree");
  if (call.error != cudaSuccess) return result(call.error);
  if (!p) return cudaSuccess;
  return result(free_device_memory(p));
}

cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned int flags) {
  device_call call("cudaHostAlloc");
  if (call.error != cudaSuccess) return result(call.error);
  if (!p || (flags & ~unsigned(cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined)))
    return result(cudaErrorInvalidValue);
  return result(allocate_pinned_memory(p, bytes, flags));
}

cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaHostAlloc(p, bytes, cudaHostAllocDefault); }

cudaError_t cudaFreeHost(void* p) {
  device_call call("cudaFreeHost");
  if (call.error != cudaSuccess) return result(call.error);
  if (!p) return cudaSuccess;
  // As CUDA in practice: freeing page-locked memory synchronizes the device (whatever the
  // freed range), so code that frees it while a stream waits on something the caller
  // would only release later deadlocks here as it would on a GPU.
  for (const auto& tail : device_tails(call.device)) host_waits(tail, /*learn=*/false);
  return result(free_pinned_memory(p));
}

cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned int flags) {
  device_call call("cudaHostGetDevicePointer");
  if (call.error != cudaSuccess) return result(call.error);
  unsigned alloc_flags = 0;
  if (!dev || flags != 0 || !pinned_flags(host, alloc_flags)) return result(cudaErrorInvalidValue);
  *dev = host; // unified addressing: the mapped device address is the host's
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p) {
  if (cudaError_t e = enter("cudaPointerGetAttributes"); e != cudaSuccess) return result(e);
  if (!attr) return result(cudaErrorInvalidValue);
  const memory_span span = classify(p, 0);
  std::memset(attr, 0, sizeof *attr);
  attr->device = span.device < 0 ? 0 : span.device;
  switch (span.kind) {
  case memory_kind::device:
    attr->type = cudaMemoryTypeDevice;
    attr->devicePointer = const_cast<void*>(p);
    break;
  case memory_kind::pinned:
    attr->type = cudaMemoryTypeHost;
    attr->devicePointer = const_cast<void*>(p);
    attr->hostPointer = const_cast<void*>(p);
    break;
  case memory_kind::pageable: attr->type = cudaMemoryTypeUnregistered; break;
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  device_call call("cudaMemcpyAsync");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = nullptr;
  if (cudaError_t e = stream_for(stream, call.device, "cudaMemcpyAsync", s); e != cudaSuccess)
    return result(e);
  if (bytes == 0) return cudaSuccess;
  if (!dst || !src) return result(cudaErrorInvalidValue);
  const memory_span d = classify(dst, bytes), r = classify(src, bytes);
  if (!d.inside || !r.inside) return result(cudaErrorInvalidValue); // past the allocation's end
  const bool dst_dev = d.kind == memory_kind::device, src_dev = r.kind == memory_kind::device;
  bool ok = false;
  switch (kind) {
  case cudaMemcpyHostToDevice: ok = dst_dev && !src_dev; break;
  case cudaMemcpyDeviceToHost: ok = !dst_dev && src_dev; break;
  case cudaMemcpyDeviceToDevice: ok = dst_dev && src_dev; break;
  case cudaMemcpyHostToHost: ok = !dst_dev && !src_dev; break;
  case cudaMemcpyDefault: ok = true; break;
  default: return result(cudaErrorInvalidMemcpyDirection);
  }
  if (!ok) return result(cudaErrorInvalidValue); // stricter than CUDA: the direction must match
  work w;
  w.api = "cudaMemcpyAsync";
  w.accesses = {range_of(src, bytes, false), range_of(dst, bytes, true)};
  // Guarded while in flight, unless a timing run (move_data=0) wants the modelled time only.
  if (config().move_data && r.kind == memory_kind::pinned) w.host_guards.push_back(range_of(src, bytes, false));
  if (config().move_data && d.kind == memory_kind::pinned) w.host_guards.push_back(range_of(dst, bytes, true));
  // A timing run (move_data=0) leaves the host's cores to the code under test.
  if (config().move_data) {
    w.body = [to = d.view, from = r.view, bytes] { std::memcpy(to, from, bytes); };
    // A copy that faults has moved some of its bytes: nobody may trust its destination.
    w.on_fault = [to = d.view, from = r.view, bytes] { std::memcpy(to, from, bytes / 2); };
  }
  w.modelled_ns = copy_time_ns(bytes);
  if (dst_dev != src_dev) w.link = dst_dev ? 0 : 1;
  w.fault = execution_fault("cudaMemcpyAsync");
  auto done = enqueue(s, std::move(w));
  // Pageable host memory: CUDA stages it, so the call returns only once the bytes are in
  // (to the host) or taken (from the host). Only the first tells the host anything about the
  // device: a copy to the device may still be on its way when the call returns.
  if (!dst_dev && d.kind == memory_kind::pageable)
    host_waits(done);
  else if (!src_dev && r.kind == memory_kind::pageable)
    host_waits(done, /*learn=*/false);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, cudaStreamLegacy);
  if (e != cudaSuccess) return e;
  return cudaStreamSynchronize(cudaStreamLegacy);
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  device_call call("cudaMemsetAsync");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = nullptr;
  if (cudaError_t e = stream_for(stream, call.device, "cudaMemsetAsync", s); e != cudaSuccess)
    return result(e);
  if (bytes == 0) return cudaSuccess;
  const memory_span d = classify(p, bytes);
  if (d.kind != memory_kind::device || !d.inside) return result(cudaErrorInvalidValue);
  work w;
  w.api = "cudaMemsetAsync";
  w.accesses = {range_of(p, bytes, true)};
  w.body = [to = d.view, value, bytes] { std::memset(to, value, bytes); };
  w.fault = execution_fault("cudaMemsetAsync");
  enqueue(s, std::move(w));
  return cudaSuccess;
}

// --- streams ------------------------------------------------------------------------------------
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* out, unsigned int flags) {
  device_call call("cudaStreamCreateWithFlags");
  if (call.error != cudaSuccess) return result(call.error);
  if (!out || (flags & ~unsigned(cudaStreamNonBlocking))) return result(cudaErrorInvalidValue);
  return result(create_stream(out, call.device, flags));
}
cudaError_t cudaStreamCreate(cudaStream_t* out) { return cudaStreamCreateWithFlags(out, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  device_call call("cudaStreamDestroy");
  if (call.error != cudaSuccess && call.error != sticky_error(call.device)) return result(call.error);
  CUstream_st* s = resolve_stream(stream, call.device, "cudaStreamDestroy");
  if (!s || !stream) return result(cudaErrorInvalidResourceHandle);
  return result(destroy_stream(s));
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  device_call call("cudaStreamSynchronize");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = resolve_stream(stream, call.device, "cudaStreamSynchronize");
  if (!s) return result(cudaErrorInvalidResourceHandle);
  if (capturing(s)) {
    invalidate_capture(s);
    return result(cudaErrorStreamCaptureUnsupported);
  }
  host_waits(stream_tail(s));
  return result(sticky_error(stream_device(s)));
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  device_call call("cudaStreamQuery");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = resolve_stream(stream, call.device, "cudaStreamQuery");
  if (!s) return result(cudaErrorInvalidResourceHandle);
  if (!host_queries(stream_tail(s))) return result(cudaErrorNotReady);
  return result(sticky_error(stream_device(s)));
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  device_call call("cudaStreamWaitEvent");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = nullptr;
  if (cudaError_t e = stream_for(stream, call.device, "cudaStreamWaitEvent", s); e != cudaSuccess)
    return result(e);
  CUevent_st* e = resolve_event(event, "cudaStreamWaitEvent");
  if (!e) return result(cudaErrorInvalidResourceHandle);
  if (flags != 0) return result(cudaErrorInvalidValue);
  return result(enqueue_event_wait(s, e)); // events of another device may be waited on
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user) {
  device_call call("cudaLaunchHostFunc");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = nullptr;
  if (cudaError_t e = stream_for(stream, call.device, "cudaLaunchHostFunc", s); e != cudaSuccess)
    return result(e);
  if (!fn) return result(cudaErrorInvalidValue);
  return result(enqueue_host_function(s, fn, user));
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode) {
  device_call call("cudaStreamBeginCapture");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = resolve_stream(stream, call.device, "cudaStreamBeginCapture");
  if (!s || !stream) return result(cudaErrorInvalidResourceHandle);
  return result(begin_capture(s) ? cudaSuccess : cudaErrorIllegalState);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  device_call call("cudaStreamIsCapturing");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = resolve_stream(stream, call.device, "cudaStreamIsCapturing");
  if (!s || !status) return result(cudaErrorInvalidValue);
  *status = capturing(s) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  device_call call("cudaStreamEndCapture");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = resolve_stream(stream, call.device, "cudaStreamEndCapture");
  if (!s || !graph) return result(cudaErrorInvalidValue);
  *graph = nullptr;
  // The double captures nothing: an empty capture would be a graph; it answers as CUDA does
  // for the only use it sees, a capture invalidated by a forbidden call.
  return result(end_capture(s) ? cudaErrorNotSupported : cudaErrorStreamCaptureInvalidated);
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  return graph ? cudaErrorNotSupported : cudaErrorInvalidValue;
}

// --- events ------------------------------------------------------------------------------------
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* out, unsigned int flags) {
  device_call call("cudaEventCreateWithFlags");
  if (call.error != cudaSuccess) return result(call.error);
  if (!out || (flags & ~unsigned(cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess)))
    return result(cudaErrorInvalidValue);
  return result(create_event(out, call.device, flags));
}
cudaError_t cudaEventCreate(cudaEvent_t* out) { return cudaEventCreateWithFlags(out, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (cudaError_t e = enter("cudaEventDestroy"); e != cudaSuccess) return result(e);
  CUevent_st* e = resolve_event(event, "cudaEventDestroy");
  if (!e) return result(cudaErrorInvalidResourceHandle);
  return result(destroy_event(e));
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  device_call call("cudaEventRecord");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = nullptr;
  if (cudaError_t e = stream_for(stream, call.device, "cudaEventRecord", s); e != cudaSuccess)
    return result(e);
  CUevent_st* e = resolve_event(event, "cudaEventRecord");
  if (!e || event_device(e) != stream_device(s)) return result(cudaErrorInvalidResourceHandle);
  return result(record_event(e, s));
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (cudaError_t e = enter("cudaEventQuery"); e != cudaSuccess) return result(e);
  CUevent_st* e = resolve_event(event, "cudaEventQuery");
  if (!e) return result(cudaErrorInvalidResourceHandle);
  if (const cudaError_t sticky = sticky_error(event_device(e)); sticky != cudaSuccess) return result(sticky);
  // Not ready is recorded as the last error too (stricter: callers must take it back).
  return result(host_queries(event_record(e)) ? sticky_error(event_device(e)) : cudaErrorNotReady);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (cudaError_t e = enter("cudaEventSynchronize"); e != cudaSuccess) return result(e);
  CUevent_st* e = resolve_event(event, "cudaEventSynchronize");
  if (!e) return result(cudaErrorInvalidResourceHandle);
  host_waits(event_record(e));
  return result(sticky_error(event_device(e)));
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (cudaError_t e = enter("cudaEventElapsedTime"); e != cudaSuccess) return result(e);
  CUevent_st* a = resolve_event(start, "cudaEventElapsedTime");
  CUevent_st* b = resolve_event(end, "cudaEventElapsedTime");
  if (!ms || !a || !b) return result(cudaErrorInvalidResourceHandle);
  if ((event_flags(a) | event_flags(b)) & cudaEventDisableTiming)
    return result(cudaErrorInvalidResourceHandle);
  const auto ra = event_record(a), rb = event_record(b);
  if (!ra || !rb) return result(cudaErrorInvalidResourceHandle);
  if (!host_queries(ra) || !host_queries(rb)) return result(cudaErrorNotReady);
  *ms = float(double(completion_time_ns(rb) - completion_time_ns(ra)) / 1e6);
  return cudaSuccess;
}

} // extern "C"

namespace cuda_double {

cudaError_t launch(cudaStream_t stream, const char* name, std::vector<buffer_use> uses,
                   std::function<void()> body, std::uint64_t duration_ns, double flops) {
  device_call call("cudaLaunchKernel");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = nullptr;
  if (cudaError_t e = stream_for(stream, call.device, name, s); e != cudaSuccess) return result(e);
  work w;
  w.api = name;
  for (const auto& u : uses) {
    const memory_span span = classify(u.data, u.bytes);
    if (span.kind == memory_kind::pageable || !span.inside) return result(cudaErrorInvalidValue);
    w.accesses.push_back(range_of(u.data, u.bytes, u.write));
  }
  w.body = std::move(body);
  const double rate = detail::config().device_flops_per_ns;
  w.modelled_ns = duration_ns + (rate > 0 ? std::uint64_t(flops / rate) : 0);
  w.fault = execution_fault("cudaLaunchKernel");
  enqueue(s, std::move(w));
  return cudaSuccess;
}

cudaError_t launch_fault(cudaStream_t stream, cudaError_t error) {
  device_call call("cudaLaunchKernel");
  if (call.error != cudaSuccess) return result(call.error);
  CUstream_st* s = nullptr;
  if (cudaError_t e = stream_for(stream, call.device, "faulting kernel", s); e != cudaSuccess)
    return result(e);
  work w;
  w.api = "faulting kernel";
  w.fault = error;
  enqueue(s, std::move(w));
  return cudaSuccess;
}

} // namespace cuda_double
