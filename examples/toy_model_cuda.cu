// The toy model as CUDA kernels, for the CUDA engine. Micro-batch `mb` of the toy loss
//   L_mb(w) = 1/n * sum_i 0.5 * d_i^2,   d_i = (w_i - target_i) + 0.01 * ((mb mod 3) - 1),
//   target_i = sinf(0.001 * i),  dL/dw_i written as g_i = d_i,
// with w the bf16 parameters. The gradients are bit-identical to toy_model_host.cpp's: the
// targets are computed once on the host (the host's sinf, not the device's) and uploaded,
// the offset is computed on the host, and d_i is two correctly rounded float operations
// (__fsub_rn/__fadd_rn, which the compiler may not fuse). The loss is only printed: each
// block sums in double and adds its sum with atomicAdd, so its last bits vary run to run.
#include <algorithm>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "toy_model_device.hpp"

namespace example {

namespace {

constexpr int block_size = 256;

__global__ void forward_backward_kernel(const std::uint16_t* __restrict__ w, const float* __restrict__ target,
                                        float* __restrict__ g, std::size_t n, float offset,
                                        double* loss_sum) {
  __shared__ double partial[block_size];
  double local = 0.0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const float wi = __uint_as_float(std::uint32_t(w[i]) << 16); // bf16 -> f32 is exact
    const float d = __fadd_rn(__fsub_rn(wi, target[i]), offset);
    g[i] = d;
    local += 0.5 * double(d) * double(d);
  }
  partial[threadIdx.x] = local;
  __syncthreads();
  for (int stride = block_size / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(loss_sum, partial[0]);
}

// Holds the stream for `ns` nanoseconds of the device's global timer: the rest of a real
// forward/backward, when the trainer models one (work_us).
__global__ void busy_kernel(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

class cuda_toy_model final : public device_toy_model {
public:
  cuda_toy_model(hostopt::copy_engine& engine, std::size_t n, int work_us)
      : device_toy_model(engine, n, work_us) {
    int sms = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_),
               "cudaDeviceGetAttribute");
    max_blocks_ = std::max(1, sms) * 8;
  }

  void forward_backward(hostopt::device_stream s, const std::uint16_t* params, float* grads,
                        int mb) override {
    const auto blocks =
        unsigned(std::min<std::size_t>((n_ + block_size - 1) / block_size, std::size_t(max_blocks_)));
    device_scope scope(device_);
    forward_backward_kernel<<<blocks, block_size, 0, static_cast<cudaStream_t>(s.handle)>>>(
        params, target_, grads, n_, offset_of(mb), loss_sum_);
    check_cuda(cudaGetLastError(), "launching forward_backward_kernel");
    if (work_us_ > 0) {
      busy_kernel<<<1, 1, 0, static_cast<cudaStream_t>(s.handle)>>>(1000ull * unsigned(work_us_));
      check_cuda(cudaGetLastError(), "launching busy_kernel");
    }
  }

private:
  int max_blocks_ = 1;
};

} // namespace

std::unique_ptr<toy_model> make_cuda_toy_model(hostopt::copy_engine& engine, std::size_t n, int work_us) {
  if (engine.name() != "cuda")
    throw std::invalid_argument("make_cuda_toy_model: needs the cuda engine, got '" +
                                std::string(engine.name()) + "'");
  return std::make_unique<cuda_toy_model>(engine, n, work_us);
}

} // namespace example
