#pragma once
// The example trainer's model, as device work on a stream: for micro-batch `mb`, the
// gradient of 0.5 * |w - target - offset(mb)|^2 / n with w the bf16 parameters, written
// into an f32 gradient buffer, and the micro-batch's loss added to a device-side sum.
// Everything is enqueued on the given stream and returns at once, as a CUDA kernel launch
// does: on the CUDA engine these are CUDA kernels (toy_model_cuda.cu), on the host engine
// host functions on the stream (toy_model_host.cpp) that also take a configurable time,
// to stand in for a real forward/backward.
#include <cstddef>
#include <cstdint>
#include <memory>

#include <hostopt/copy_engine.hpp>

namespace example {

class toy_model {
public:
  virtual ~toy_model() = default;
  /// Enqueues forward + backward of micro-batch `mb` on `s`: reads `params` (n bf16),
  /// writes `grads` (n f32), adds the loss to the device-side sum.
  virtual void forward_backward(hostopt::device_stream s, const std::uint16_t* params, float* grads,
                                int mb) = 0;
  /// Enqueues a reset of the device-side loss sum on `s`.
  virtual void reset_loss(hostopt::device_stream s) = 0;
  /// Waits for `s`, then returns the device-side loss sum (mean over elements, summed
  /// over the micro-batches since reset_loss).
  virtual double read_loss(hostopt::device_stream s) = 0;
};

/// The host-function model on the host engine, the CUDA-kernel model on the CUDA engine.
/// `work_us` > 0 models a real forward/backward: each one holds the stream that long at
/// least (the host engine sleeps; the CUDA kernels add one that spins on the device's
/// timer; the test-only CUDA double models the time and skips the arithmetic, leaving the
/// CPU to the optimizer, so only the timing of such a run means anything there).
std::unique_ptr<toy_model> make_toy_model(hostopt::copy_engine& engine, std::size_t n, int work_us = 0);

#if defined(HOSTOPT_EXAMPLE_HAVE_CUDA)
std::unique_ptr<toy_model> make_cuda_toy_model(hostopt::copy_engine& engine, std::size_t n, int work_us = 0);
#endif

} // namespace example
