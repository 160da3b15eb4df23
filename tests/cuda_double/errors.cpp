// The CUDA double's error names and texts, runtime and driver, and the lookup by name that
// fault specs use. Only the codes a hostopt build can meet; any other prints as unknown.
#include <cstring>
#include <string>

#include "double_internal.hpp"

namespace cuda_double::detail {

namespace {

struct runtime_entry {
  cudaError_t code;
  const char* name;
  const char* text;
};
#define HOSTOPT_RT(c, t)                                                                                     \
  { c, #c, t }
constexpr runtime_entry runtime_errors[] = {
    HOSTOPT_RT(cudaSuccess, "no error"),
    HOSTOPT_RT(cudaErrorInvalidValue, "invalid argument"),
    HOSTOPT_RT(cudaErrorMemoryAllocation, "out of memory"),
    HOSTOPT_RT(cudaErrorInitializationError, "initialization error"),
    HOSTOPT_RT(cudaErrorInvalidConfiguration, "invalid configuration argument"),
    HOSTOPT_RT(cudaErrorInvalidDevicePointer, "invalid device pointer"),
    HOSTOPT_RT(cudaErrorInvalidMemcpyDirection, "invalid copy direction for memcpy"),
    HOSTOPT_RT(cudaErrorNoDevice, "no CUDA-capable device is detected"),
    HOSTOPT_RT(cudaErrorInvalidDevice, "invalid device ordinal"),
    HOSTOPT_RT(cudaErrorInvalidResourceHandle, "invalid resource handle"),
    HOSTOPT_RT(cudaErrorNotReady, "device not ready"),
    HOSTOPT_RT(cudaErrorIllegalAddress, "an illegal memory access was encountered"),
    HOSTOPT_RT(cudaErrorLaunchFailure, "unspecified launch failure"),
    HOSTOPT_RT(cudaErrorNotPermitted, "operation not permitted"),
    HOSTOPT_RT(cudaErrorNotSupported, "operation not supported"),
    HOSTOPT_RT(cudaErrorStreamCaptureUnsupported, "operation not permitted when stream is capturing"),
    HOSTOPT_RT(cudaErrorStreamCaptureInvalidated, "operation failed due to a previous error during capture"),
    HOSTOPT_RT(cudaErrorIllegalState, "the operation cannot be performed in the present state"),
    HOSTOPT_RT(cudaErrorSymbolNotFound, "named symbol not found"),
    HOSTOPT_RT(cudaErrorHostMemoryAlreadyRegistered,
               "part or all of the requested memory range is already mapped"),
    HOSTOPT_RT(cudaErrorUnknown, "unknown error"),
};
#undef HOSTOPT_RT

struct driver_entry {
  CUresult code;
  const char* name;
  const char* text;
};
#define HOSTOPT_DRV(c, t)                                                                                    \
  { c, #c, t }
constexpr driver_entry driver_errors[] = {
    HOSTOPT_DRV(CUDA_SUCCESS, "no error"),
    HOSTOPT_DRV(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
    HOSTOPT_DRV(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
    HOSTOPT_DRV(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
    HOSTOPT_DRV(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
    HOSTOPT_DRV(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
    HOSTOPT_DRV(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
    HOSTOPT_DRV(CUDA_ERROR_NOT_READY, "device not ready"),
    HOSTOPT_DRV(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
    HOSTOPT_DRV(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure"),
    HOSTOPT_DRV(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
    HOSTOPT_DRV(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
    HOSTOPT_DRV(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing"),
    HOSTOPT_DRV(CUDA_ERROR_UNKNOWN, "unknown error"),
};
#undef HOSTOPT_DRV

} // namespace

const char* runtime_error_name(cudaError_t e) {
  for (const auto& r : runtime_errors)
    if (r.code == e) return r.name;
  return "cudaErrorUnknown";
}
const char* runtime_error_string(cudaError_t e) {
  for (const auto& r : runtime_errors)
    if (r.code == e) return r.text;
  return "unrecognized error code";
}
const char* driver_error_name(CUresult e) {
  for (const auto& r : driver_errors)
    if (r.code == e) return r.name;
  return nullptr;
}
const char* driver_error_string(CUresult e) {
  for (const auto& r : driver_errors)
    if (r.code == e) return r.text;
  return nullptr;
}

bool error_by_name(const std::string& name, int& value, bool& driver) {
  for (const auto& r : runtime_errors)
    if (name == r.name) {
      value = int(r.code);
      driver = false;
      return true;
    }
  for (const auto& r : driver_errors)
    if (name == r.name) {
      value = int(r.code);
      driver = true;
      return true;
    }
  return false;
}

CUresult to_driver(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return CUDA_SUCCESS;
  case cudaErrorInvalidValue: return CUDA_ERROR_INVALID_VALUE;
  case cudaErrorMemoryAllocation: return CUDA_ERROR_OUT_OF_MEMORY;
  case cudaErrorInvalidResourceHandle: return CUDA_ERROR_INVALID_HANDLE;
  case cudaErrorNotReady: return CUDA_ERROR_NOT_READY;
  case cudaErrorIllegalAddress: return CUDA_ERROR_ILLEGAL_ADDRESS;
  case cudaErrorLaunchFailure: return CUDA_ERROR_LAUNCH_FAILED;
  case cudaErrorNotPermitted: return CUDA_ERROR_NOT_PERMITTED;
  case cudaErrorStreamCaptureUnsupported: return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  default: return CUDA_ERROR_UNKNOWN;
  }
}

cudaError_t from_driver(CUresult e) {
  for (const auto& r : runtime_errors)
    if (to_driver(r.code) == e) return r.code;
  return cudaErrorUnknown;
}

} // namespace cuda_double::detail
