// examples/toy_model_cuda.cu on the CUDA double: the same model, its "kernel" device work
// (cuda_double::launch) that reads the bf16 parameters and the uploaded targets and writes
// the gradients, bit-identical to the host model (two correctly rounded float operations).
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda_double.hpp"
#include "toy_model.hpp"

namespace example {

namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string("toy model (cuda double): ") + what +
                             " failed: " + cudaGetErrorName(rc) + ": " + cudaGetErrorString(rc));
}

/// The engine's device current for a launch, the caller's back afterwards (as the .cu does).
class device_scope {
public:
  explicit device_scope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      check(cudaSetDevice(device), "cudaSetDevice");
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

class double_toy_model final : public toy_model {
public:
  double_toy_model(hostopt::copy_engine& engine, std::size_t n, int work_us)
      : engine_(engine), n_(n), work_us_(work_us), host_loss_(engine, sizeof(double)) {
    if (n == 0) throw std::invalid_argument("toy model (cuda double): n must be > 0");
    target_ = static_cast<float*>(engine.allocate_device(n * sizeof(float)));
    loss_sum_ = static_cast<double*>(engine.allocate_device(sizeof(double)));
    cudaPointerAttributes attr{};
    check(cudaPointerGetAttributes(&attr, target_), "cudaPointerGetAttributes");
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
  ~double_toy_model() override {
    engine_.free_device(target_);
    engine_.free_device(loss_sum_);
  }

  void forward_backward(hostopt::device_stream s, const std::uint16_t* params, float* grads,
                        int mb) override {
    const float offset = 0.01f * float(mb % 3 - 1);
    device_scope scope(device_);
    const std::size_t n = n_;
    const float* target = target_;
    double* loss = loss_sum_;
    const std::vector<cuda_double::buffer_use> uses = {
        {params, n * 2, false}, {target, n * 4, false}, {grads, n * 4, true}, {loss, 8, true}};
    if (work_us_ > 0) {
      // A modelled forward/backward: its time and its memory uses, no arithmetic, so that
      // the CPU is left to the optimizer as it would be with a real device.
      check(cuda_double::launch(static_cast<cudaStream_t>(s.handle), "forward_backward_kernel (modelled)",
                                uses, nullptr, 1000ull * unsigned(work_us_)),
            "launching forward_backward_kernel (modelled)");
      return;
    }
    // Modelled device time: ~10 flops per element.
    check(cuda_double::launch(
              static_cast<cudaStream_t>(s.handle), "forward_backward_kernel", uses,
              [=] {
                const std::uint16_t* w = cuda_double::device_view(params);
                const float* t = cuda_double::device_view(target);
                float* g = cuda_double::device_view(grads);
                double sum = 0;
                for (std::size_t i = 0; i < n; ++i) {
                  const std::uint32_t bits = std::uint32_t(w[i]) << 16;
                  float wi;
                  std::memcpy(&wi, &bits, 4);
                  const float d = (wi - t[i]) + offset;
                  g[i] = d;
                  sum += 0.5 * double(d) * double(d);
                }
                *cuda_double::device_view(loss) += sum;
              },
              0, 10.0 * double(n)),
          "launching forward_backward_kernel");
  }

  void reset_loss(hostopt::device_stream s) override {
    device_scope scope(device_);
    check(cudaMemsetAsync(loss_sum_, 0, sizeof(double), static_cast<cudaStream_t>(s.handle)),
          "cudaMemsetAsync");
  }

  double read_loss(hostopt::device_stream s) override {
    engine_.copy_async(s, hostopt::copy_direction::to_host, host_loss_.data(), loss_sum_, sizeof(double));
    engine_.synchronize_stream(s);
    return *static_cast<const double*>(host_loss_.data()) / double(n_);
  }

private:
  hostopt::copy_engine& engine_;
  std::size_t n_;
  int work_us_;
  hostopt::pinned_buffer host_loss_;
  float* target_ = nullptr;
  double* loss_sum_ = nullptr;
  int device_ = 0;
};

} // namespace

std::unique_ptr<toy_model> make_cuda_toy_model(hostopt::copy_engine& engine, std::size_t n, int work_us) {
  if (engine.name() != "cuda")
    throw std::invalid_argument("make_cuda_toy_model: needs the cuda engine, got '" +
                                std::string(engine.name()) + "'");
  return std::make_unique<double_toy_model>(engine, n, work_us);
}

} // namespace example
