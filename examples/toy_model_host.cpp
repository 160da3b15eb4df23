// The example model on the host engine: its "kernels" are host functions on the stream,
// which is what the host engine runs for a GPU's kernels. On the CUDA engine the same
// interface is served by CUDA kernels (toy_model_cuda.cu).
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "toy_model.hpp"

namespace example {

namespace {

float bf16_to_float(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

class host_toy_model final : public toy_model {
public:
  host_toy_model(hostopt::copy_engine& e, std::size_t n, int work_us)
      : engine_(e), n_(n), work_us_(work_us), target_(n), loss_(e, sizeof(double)) {
    for (std::size_t i = 0; i < n; ++i) target_[i] = std::sin(0.001f * float(i));
    device_loss_ = static_cast<double*>(e.allocate_device(sizeof(double)));
    *device_loss_ = 0;
  }
  ~host_toy_model() override { engine_.free_device(device_loss_); }

  void forward_backward(hostopt::device_stream s, const std::uint16_t* params, float* grads,
                        int mb) override {
    engine_.launch_host_function(s, [this, params, grads, mb] {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(work_us_);
      double loss = 0;
      for (std::size_t i = 0; i < n_; ++i) {
        const float diff = bf16_to_float(params[i]) - target_[i] + 0.01f * float(mb % 3 - 1);
        grads[i] = diff;
        loss += 0.5 * double(diff) * diff;
      }
      *device_loss_ += loss / double(n_);
      std::this_thread::sleep_until(until); // the rest of a real forward/backward's time
    });
  }
  void reset_loss(hostopt::device_stream s) override {
    engine_.launch_host_function(s, [this] { *device_loss_ = 0; });
  }
  double read_loss(hostopt::device_stream s) override {
    engine_.copy_async(s, hostopt::copy_direction::to_host, loss_.data(), device_loss_, sizeof(double));
    engine_.synchronize_stream(s);
    double v;
    std::memcpy(&v, loss_.data(), sizeof v);
    return v;
  }

private:
  hostopt::copy_engine& engine_;
  std::size_t n_;
  int work_us_;
  std::vector<float> target_;
  hostopt::pinned_buffer loss_;
  double* device_loss_ = nullptr;
};

} // namespace

std::unique_ptr<toy_model> make_toy_model(hostopt::copy_engine& engine, std::size_t n, int work_us) {
  if (engine.name() == "cuda") {
#if defined(HOSTOPT_EXAMPLE_HAVE_CUDA)
    return make_cuda_toy_model(engine, n, work_us);
#else
    throw std::runtime_error(
        "this example was built without a CUDA compiler: its model kernels (toy_model_cuda.cu) "
        "are missing, so it cannot run on the CUDA engine");
#endif
  }
  return std::make_unique<host_toy_model>(engine, n, work_us);
}

} // namespace example
