#pragma once
// The toy model on a CUDA device, all but its kernel: shared by the CUDA kernels
// (toy_model_cuda.cu) and the test-only CUDA double's device work
// (tests/cuda_double/toy_model_kernels.cpp), which each add forward_backward. The targets
// are computed once with the host's sinf and uploaded, so every model agrees bit for bit;
// the loss is a device-side double sum.
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include <hostopt/copy_engine.hpp>

#include "toy_model.hpp"

namespace example {

inline void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string("toy model (cuda): ") + what + " failed: " + cudaGetErrorName(rc) +
                             ": " + cudaGetErrorString(rc));
}

/// The engine's device current for a launch, the caller's back afterwards (as the engine does).
class device_scope {
public:
  explicit device_scope(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      check_cuda(cudaSetDevice(device), "cudaSetDevice");
      restore_ = true;
    }
  }
  ~device_scope() {
    if (restore_) cudaSetDevice(previous_);
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

private:
  int previous_ = 0;
  bool restore_ = false;
};

class device_toy_model : public toy_model {
public:
  device_toy_model(hostopt::copy_engine& engine, std::size_t n, int work_us)
      : engine_(engine), n_(n), work_us_(work_us), host_loss_(engine, sizeof(double)) {
    if (n == 0) throw std::invalid_argument("toy model (cuda): n must be > 0");
    target_ = static_cast<float*>(engine.allocate_device(n * sizeof(float)));
    loss_sum_ = static_cast<double*>(engine.allocate_device(sizeof(double)));
    // The device the engine allocates on is the one its streams and our launches use.
    cudaPointerAttributes attr{};
    check_cuda(cudaPointerGetAttributes(&attr, target_), "cudaPointerGetAttributes");
    device_ = attr.device;
    hostopt::pinned_buffer staging(engine, n * sizeof(float));
    auto* t = static_cast<float*>(staging.data());
    for (std::size_t i = 0; i < n; ++i) t[i] = std::sin(0.001f * float(i));
    const hostopt::device_stream s = engine.create_stream();
    engine.copy_async(s, hostopt::copy_direction::to_device, target_, t, n * sizeof(float));
    reset_loss(s);
    engine.synchronize_stream(s);
    engine.destroy_stream(s);
  }
  ~device_toy_model() override {
    engine_.free_device(target_);
    engine_.free_device(loss_sum_);
  }
  device_toy_model(const device_toy_model&) = delete;
  device_toy_model& operator=(const device_toy_model&) = delete;

  void reset_loss(hostopt::device_stream s) final {
    device_scope scope(device_);
    check_cuda(cudaMemsetAsync(loss_sum_, 0, sizeof(double), static_cast<cudaStream_t>(s.handle)),
               "cudaMemsetAsync");
  }

  double read_loss(hostopt::device_stream s) final {
    engine_.copy_async(s, hostopt::copy_direction::to_host, host_loss_.data(), loss_sum_, sizeof(double));
    engine_.synchronize_stream(s);
    return *static_cast<const double*>(host_loss_.data()) / double(n_);
  }

protected:
  /// Micro-batch mb's offset, computed on the host: every model's gradients agree.
  static float offset_of(int mb) { return 0.01f * float(mb % 3 - 1); }

  hostopt::copy_engine& engine_;
  std::size_t n_;
  int work_us_;
  hostopt::pinned_buffer host_loss_;
  float* target_ = nullptr;
  double* loss_sum_ = nullptr;
  int device_ = 0;
};

} // namespace example
