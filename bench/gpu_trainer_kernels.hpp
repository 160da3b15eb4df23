#pragma once
// The device side of hostopt-gpu-bench (gpu_trainer_kernels.cu): the "backward" that
// writes the gradients after the GEMMs. C++17 and CUDA-free, so both compilers read it;
// streams are cudaStream_t passed as void*, as device_stream holds them.
#include <cstddef>
#include <cstdint>

namespace gpu_bench {

/// Enqueues g[i] = 1e-3 * w[i] + a small term of (i, step) on `stream`: reads every bf16
/// parameter and writes every f32 gradient, as a backward pass would. Throws
/// std::runtime_error when the launch fails.
void launch_gradients(void* stream, const std::uint16_t* params, float* grads, std::size_t n, int step);

} // namespace gpu_bench
