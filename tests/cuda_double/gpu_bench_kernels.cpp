// bench/gpu_trainer_kernels.cu on the CUDA double: the same gradients, as device work.
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda_double.hpp"
#include "gpu_trainer_kernels.hpp"

namespace gpu_bench {

void launch_gradients(void* stream, const std::uint16_t* params, float* grads, std::size_t n, int step) {
  const cudaError_t rc = cuda_double::launch(
      static_cast<cudaStream_t>(stream), "gradient_kernel", {{params, n * 2, false}, {grads, n * 4, true}},
      [=] {
        const std::uint16_t* w = cuda_double::device_view(params);
        float* g = cuda_double::device_view(grads);
        for (std::size_t i = 0; i < n; ++i) {
          const std::uint32_t bits = std::uint32_t(w[i]) << 16;
          float wi;
          std::memcpy(&wi, &bits, 4);
          const std::uint32_t h = std::uint32_t(i) * 2654435761u + std::uint32_t(step) * 40503u;
          g[i] = 1e-3f * wi + float(int(h % 2001u) - 1000) * 1e-6f;
        }
      },
      0, 3.0 * double(n));
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string("gpu bench: launching gradient_kernel failed: ") +
                             cudaGetErrorString(rc));
}

} // namespace gpu_bench
