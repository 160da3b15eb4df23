// The CUDA double's driver side: the cu* functions the runtime's driver entry point hands
// out (cudaGetDriverEntryPoint / ByVersion), in the ABI versions hostopt asks for. A symbol
// the double lacks is answered "not found", as an older driver would, and named on stderr
// so that a new call in hostopt shows up here first.
#include <cstdio>
#include <cstring>
#include <string>

#include "double_internal.hpp"

using namespace cuda_double::detail;

namespace {

CUresult driver_enter(const char* api) { return enter_driver(api); }

CUresult CUDAAPI get_error_name(CUresult e, const char** out) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = driver_error_name(e);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult CUDAAPI get_error_string(CUresult e, const char** out) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = driver_error_string(e);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI ctx_get_current(CUcontext* out) {
  if (CUresult r = driver_enter("cuCtxGetCurrent"); r != CUDA_SUCCESS) return r;
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = reinterpret_cast<CUcontext>(current_context());
  return CUDA_SUCCESS;
}
CUresult CUDAAPI ctx_set_current(CUcontext c) {
  if (CUresult r = driver_enter("cuCtxSetCurrent"); r != CUDA_SUCCESS) return r;
  if (c && !is_context(c)) return CUDA_ERROR_INVALID_CONTEXT;
  auto* ctx = reinterpret_cast<context*>(c);
  if (ctx && ctx->retains == 0 && !ctx->runtime_active) return CUDA_ERROR_INVALID_CONTEXT; // released
  current_context() = ctx;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI device_get(CUdevice* out, int ordinal) {
  if (CUresult r = driver_enter("cuDeviceGet"); r != CUDA_SUCCESS) return r;
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  if (!primary_context(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *out = ordinal;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI primary_ctx_retain(CUcontext* out, CUdevice d) {
  if (CUresult r = driver_enter("cuDevicePrimaryCtxRetain"); r != CUDA_SUCCESS) return r;
  context* c = primary_context(d);
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  if (!c) return CUDA_ERROR_INVALID_DEVICE;
  ++c->retains; // retained, not made current
  *out = reinterpret_cast<CUcontext>(c);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI primary_ctx_release(CUdevice d) {
  if (CUresult r = driver_enter("cuDevicePrimaryCtxRelease"); r != CUDA_SUCCESS) return r;
  context* c = primary_context(d);
  if (!c) return CUDA_ERROR_INVALID_DEVICE;
  int held = c->retains.load();
  do {
    if (held == 0) {
      violation("cuDevicePrimaryCtxRelease of device " + std::to_string(d) +
                " more often than it was retained");
      return CUDA_ERROR_INVALID_CONTEXT;
    }
  } while (!c->retains.compare_exchange_weak(held, held - 1));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI primary_ctx_get_state(CUdevice d, unsigned* flags, int* active) {
  if (CUresult r = driver_enter("cuDevicePrimaryCtxGetState"); r != CUDA_SUCCESS) return r;
  context* c = primary_context(d);
  if (!c) return CUDA_ERROR_INVALID_DEVICE;
  if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
  *flags = 0;
  *active = (c->retains > 0 || c->runtime_active) ? 1 : 0;
  return CUDA_SUCCESS;
}

// cuStreamWaitValue32 (v2): the stream waits on a word of device-visible memory (mapped
// page-locked here). Like the runtime's stream calls, it works in the current context.
CUresult CUDAAPI stream_wait_value32(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                     unsigned int flags) {
  if (CUresult r = driver_enter("cuStreamWaitValue32"); r != CUDA_SUCCESS) return r;
  context* c = current_context();
  if (!c) return CUDA_ERROR_INVALID_CONTEXT;
  if (const cudaError_t sticky = sticky_error(c->device); sticky != cudaSuccess) return to_driver(sticky);
  if ((flags & ~unsigned(0x3 | CU_STREAM_WAIT_VALUE_FLUSH)) != 0) return CUDA_ERROR_INVALID_VALUE;
  if (addr % 4 != 0) return CUDA_ERROR_INVALID_VALUE; // 32-bit aligned, as the driver requires
  const auto* word = reinterpret_cast<const std::uint32_t*>(addr);
  unsigned alloc_flags = 0;
  if (!pinned_flags(word, alloc_flags) || !(alloc_flags & cudaHostAllocMapped))
    return CUDA_ERROR_INVALID_VALUE; // the double's device sees mapped page-locked words only
  CUstream_st* s = resolve_stream(reinterpret_cast<cudaStream_t>(stream), c->device, "cuStreamWaitValue32");
  if (!s || stream_device(s) != c->device) return CUDA_ERROR_INVALID_HANDLE;
  return to_driver(enqueue_wait_value(s, word, value, flags & 0x3));
}

struct entry {
  const char* symbol;
  unsigned min_version; // the ABI version hostopt's typedefs name
  void* fn;
};
const entry entries[] = {
    {"cuGetErrorName", 6000, reinterpret_cast<void*>(&get_error_name)},
    {"cuGetErrorString", 6000, reinterpret_cast<void*>(&get_error_string)},
    {"cuCtxGetCurrent", 4000, reinterpret_cast<void*>(&ctx_get_current)},
    {"cuCtxSetCurrent", 4000, reinterpret_cast<void*>(&ctx_set_current)},
    {"cuDeviceGet", 2000, reinterpret_cast<void*>(&device_get)},
    {"cuDevicePrimaryCtxRetain", 7000, reinterpret_cast<void*>(&primary_ctx_retain)},
    {"cuDevicePrimaryCtxRelease", 11000, reinterpret_cast<void*>(&primary_ctx_release)},
    {"cuDevicePrimaryCtxGetState", 7000, reinterpret_cast<void*>(&primary_ctx_get_state)},
    {"cuStreamWaitValue32", 11070, reinterpret_cast<void*>(&stream_wait_value32)},
};

cudaError_t lookup(const char* symbol, void** fn, unsigned version, cudaDriverEntryPointQueryResult* status) {
  if (!symbol || !fn) return result(cudaErrorInvalidValue);
  *fn = nullptr;
  for (const auto& e : entries)
    if (std::strcmp(e.symbol, symbol) == 0) {
      if (version < e.min_version) {
        // An older ABI than the double implements: refuse rather than hand out a mismatch.
        if (status) *status = cudaDriverEntryPointVersionNotSufficent;
        return cudaSuccess;
      }
      *fn = e.fn;
      if (status) *status = cudaDriverEntryPointSuccess;
      return cudaSuccess;
    }
  std::fprintf(stderr, "cuda double: driver entry point '%s' is not implemented (answered: not found)\n",
               symbol);
  if (status) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

} // namespace

extern "C" {

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int version,
                                             unsigned long long flags,
                                             cudaDriverEntryPointQueryResult* status) {
  if (cudaError_t e = enter("cudaGetDriverEntryPointByVersion"); e != cudaSuccess) return result(e);
  (void)flags;
  return lookup(symbol, fn, version, status);
}

cudaError_t cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long flags,
                                    cudaDriverEntryPointQueryResult* status) {
  if (cudaError_t e = enter("cudaGetDriverEntryPoint"); e != cudaSuccess) return result(e);
  (void)flags;
  return lookup(symbol, fn, CUDART_VERSION, status);
}

} // extern "C"
