#pragma once
// hostopt's CUDA runtime double: the test-only side of it. The double is a library with
// libcudart's ABI (built against the toolkit's own headers) that the `cuda-double` preset
// links instead of libcudart, so the CUDA engine and everything above it run unchanged on
// a machine without a GPU. It is stricter than CUDA: every stream runs in order on its own
// worker with a seeded random delay before each operation, device memory faults when the
// host touches it, transfers that race are reported with both call sites, and CUDA's rules
// (no CUDA call from a host function, event waits bound at enqueue, cuStreamWaitValue32's
// wrap-around >=, sticky errors) are enforced. Never part of a user build: `.ci/gpu` is the
// proof on hardware.
//
// What a test needs beyond the CUDA API: device work (the double's stand-in for a kernel,
// which the double cannot run), fault injection, and the violations the checker found.
//
// Environment: HOSTOPT_CUDA_DOUBLE_SEED (the delays' seed; printed with every violation),
// HOSTOPT_CUDA_DOUBLE_DEVICES (default 2), HOSTOPT_CUDA_DOUBLE_MAX_DELAY_US (default 200;
// 0 = no delays), HOSTOPT_CUDA_DOUBLE_FAULTS (fault specs, see inject_faults), and
// HOSTOPT_CUDA_DOUBLE_MODEL ("link_gbps=25,device_tflops=100,move_data=0": copies take
// at least the time the named link would, one at a time per direction per device as a
// GPU's copy engines do; launches' flops the time the named device would; move_data=0
// makes copies move nothing, for timing runs on a machine whose cores the optimizer needs).
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

namespace cuda_double {

/// A range of device or page-locked memory that device work reads or writes.
struct buffer_use {
  const void* data;
  std::size_t bytes;
  bool write;
};

/// Enqueues device work on `stream`, as a kernel launch would: `body` runs on the stream's
/// worker in stream order (after the seeded delay, then `duration_ns` of modelled device
/// time) and may touch only the memory it names in `uses` (checked by the race detector),
/// through device_view. `flops`, when given, adds the modelled device's time for them.
/// Returns the launch's error (also the thread's last error), as a kernel launch does.
cudaError_t launch(cudaStream_t stream, const char* name, std::vector<buffer_use> uses,
                   std::function<void()> body, std::uint64_t duration_ns = 0, double flops = 0);

/// Inside device work: the address at which the double's worker reads and writes device
/// or page-locked memory `p` (an alias: the host's own address of page-locked memory may
/// be guarded while a copy of it runs); other memory is returned as it is.
void* device_view(const void* p);
template <class T> T* device_view(T* p) { return static_cast<T*>(device_view(static_cast<const void*>(p))); }

/// A launch CUDA refuses (cudaErrorInvalidConfiguration, ...): the thread's last error,
/// nothing enqueued.
void refuse_launch(cudaError_t error);

/// Device work that faults (cudaErrorIllegalAddress by default): from then on the error is
/// sticky for the device, as a real fault is.
cudaError_t launch_fault(cudaStream_t stream, cudaError_t error = cudaErrorIllegalAddress);

/// Fault injection, ';'-separated: "API#N=ERROR" makes the Nth call of API (counted from
/// now) return ERROR; "exec:API#N=ERROR" makes the Nth operation API enqueues fail when
/// it executes (a sticky device error). ERROR is a cudaError_t or CUresult name, API a
/// runtime or driver function name (cudaMemcpyAsync, cuStreamWaitValue32, ...).
/// Throws std::invalid_argument on a malformed spec.
void inject_faults(const std::string& spec);
/// Drops every fault not yet triggered.
void clear_faults();

/// Violations (races, rule breaks) end the process by default, after printing them with
/// the seed. A test of the checker itself records them instead.
void record_violations(bool record);
std::vector<std::string> take_violations();

/// The seed of this process's delays.
std::uint64_t seed();

} // namespace cuda_double
