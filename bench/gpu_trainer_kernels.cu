// The gradient kernel of hostopt-gpu-bench: a grid-stride pass over the arena that reads
// the bf16 parameters and writes f32 gradients (memory-bound, a few ms for 64M parameters
// on an H100/H200: small next to the GEMMs).
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "gpu_trainer_kernels.hpp"

namespace gpu_bench {

namespace {

__global__ void gradient_kernel(const std::uint16_t* __restrict__ w, float* __restrict__ g, std::size_t n,
                                int step) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const float wi = __uint_as_float(std::uint32_t(w[i]) << 16);
    const std::uint32_t h = std::uint32_t(i) * 2654435761u + std::uint32_t(step) * 40503u;
    g[i] = 1e-3f * wi + float(int(h % 2001u) - 1000) * 1e-6f;
  }
}

} // namespace

void launch_gradients(void* stream, const std::uint16_t* params, float* grads, std::size_t n, int step) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const std::size_t want = (n + 255) / 256, cap = std::size_t(sms > 0 ? sms : 1) * 16;
  gradient_kernel<<<unsigned(want < cap ? want : cap), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      params, grads, n, step);
  const cudaError_t rc = cudaGetLastError();
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string("gpu bench: launching gradient_kernel failed: ") +
                             cudaGetErrorString(rc));
}

} // namespace gpu_bench
