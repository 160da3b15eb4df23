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
#include "toy_model_device.hpp"

namespace example {

namespace {

class double_toy_model final : public device_toy_model {
public:
  using device_toy_model::device_toy_model;

  void forward_backward(hostopt::device_stream s, const std::uint16_t* params, float* grads,
                        int mb) override {
    const float offset = offset_of(mb);
    device_scope scope(device_);
    const std::size_t n = n_;
    const float* target = target_;
    double* loss = loss_sum_;
    const std::vector<cuda_double::buffer_use> uses = {
        {params, n * 2, false}, {target, n * 4, false}, {grads, n * 4, true}, {loss, 8, true}};
    if (work_us_ > 0) {
      // A modelled forward/backward: its time and its memory uses, no arithmetic, so that
      // the CPU is left to the optimizer as it would be with a real device.
      check_cuda(cuda_double::launch(static_cast<cudaStream_t>(s.handle),
                                     "forward_backward_kernel (modelled)", uses, nullptr,
                                     1000ull * unsigned(work_us_)),
                 "launching forward_backward_kernel (modelled)");
      return;
    }
    // Modelled device time: ~10 flops per element.
    check_cuda(cuda_double::launch(
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
};

} // namespace

std::unique_ptr<toy_model> make_cuda_toy_model(hostopt::copy_engine& engine, std::size_t n, int work_us) {
  if (engine.name() != "cuda")
    throw std::invalid_argument("make_cuda_toy_model: needs the cuda engine, got '" +
                                std::string(engine.name()) + "'");
  return std::make_unique<double_toy_model>(engine, n, work_us);
}

} // namespace example
