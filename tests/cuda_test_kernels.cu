// Kernels of test_cuda: a timed spin (a stand-in for a forward/backward), late or
// host-gated gradients, the trainer loop's model gradient, a deliberate illegal address and
// a deliberately refused launch. Launch errors throw std::runtime_error (but the refused one's).
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "cuda_test_kernels.hpp"

namespace hostopt_test {

namespace {

__device__ std::uint64_t global_timer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(std::uint64_t ns) {
  const std::uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < ns) __nanosleep(1000);
}

__global__ void gradient_kernel(float* g, std::size_t n, int seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    g[i] = test_gradient(i, seed);
}

__global__ void fault_kernel(int* bad) { *reinterpret_cast<volatile int*>(bad) = 1; }

__global__ void wait_word_kernel(const std::uint32_t* word, std::uint64_t timeout_ns) {
  const std::uint64_t start = global_timer_ns();
  while (*reinterpret_cast<const volatile std::uint32_t*>(word) == 0 &&
         global_timer_ns() - start < timeout_ns)
    __nanosleep(2000);
}

__global__ void model_gradient_kernel(const std::uint16_t* w, const float* target, float* g, std::size_t n,
                                      float offset) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const float wi = __uint_as_float(std::uint32_t(w[i]) << 16);
    g[i] = __fadd_rn(__fsub_rn(wi, target[i]), offset); // no contraction, round to nearest
  }
}

__global__ void empty_kernel() {}

unsigned grid_for(std::size_t n) { return unsigned(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096); }

void check_launch(const char* what) {
  const cudaError_t rc = cudaGetLastError();
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string("test kernels: launching ") + what +
                             " failed: " + cudaGetErrorString(rc));
}

} // namespace

void launch_spin(void* stream, std::uint64_t ns) {
  spin_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(ns);
  check_launch("spin_kernel");
}

void launch_late_gradients(void* stream, float* g, std::size_t n, int seed, std::uint64_t delay_ns) {
  launch_spin(stream, delay_ns);
  const unsigned blocks = unsigned(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096);
  gradient_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(g, n, seed);
  check_launch("gradient_kernel");
}

void launch_wait_word(void* stream, const std::uint32_t* word, std::uint64_t timeout_ns) {
  wait_word_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(word, timeout_ns);
  check_launch("wait_word_kernel");
}

void launch_gated_gradients(void* stream, const std::uint32_t* word, float* g, std::size_t n, int seed,
                            std::uint64_t timeout_ns) {
  launch_wait_word(stream, word, timeout_ns);
  gradient_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(g, n, seed);
  check_launch("gradient_kernel");
}

void launch_model_gradient(void* stream, const std::uint16_t* w, const float* target, float* g, std::size_t n,
                           float offset) {
  model_gradient_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(w, target, g, n, offset);
  check_launch("model_gradient_kernel");
}

void launch_bad_configuration(void* stream) {
  empty_kernel<<<1, 4096, 0, static_cast<cudaStream_t>(stream)>>>();
}

void begin_planted_races() {}
int end_planted_races() { return -1; } // no checker on the device

void launch_fault(void* stream) {
  fault_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(reinterpret_cast<int*>(std::uintptr_t(8)));
  check_launch("fault_kernel");
}

} // namespace hostopt_test
