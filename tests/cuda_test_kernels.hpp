#pragma once
// Device work for test_cuda (cuda_test_kernels.cu, built when a CUDA compiler is found):
// a kernel that takes a given time, a "backward" that writes known gradients late or when
// the host lets it, the trainer loop's model gradient, a kernel that faults and a launch
// that is refused. Streams are cudaStream_t passed as void*, as device_stream holds them.
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define HOSTOPT_TEST_HOST_DEVICE __host__ __device__
#else
#define HOSTOPT_TEST_HOST_DEVICE
#endif

namespace hostopt_test {

/// Gradient i of test step `seed`: integers scaled once, so host and device agree exactly.
HOSTOPT_TEST_HOST_DEVICE inline float test_gradient(std::size_t i, int seed) {
  const std::uint32_t h = std::uint32_t(i) * 2654435761u + std::uint32_t(seed) * 40503u;
  return float(int(h % 2001u) - 1000) * 1e-3f;
}

/// Enqueues one thread that spins for `ns` nanoseconds of the device's global timer.
void launch_spin(void* stream, std::uint64_t ns);
/// Enqueues a spin of `delay_ns`, then g[i] = test_gradient(i, seed) for i < n.
void launch_late_gradients(void* stream, float* g, std::size_t n, int seed, std::uint64_t delay_ns);
/// Enqueues a store to an unmapped address: cudaErrorIllegalAddress, sticky for the process.
void launch_fault(void* stream);

/// Enqueues one thread that waits until the host-written word `*word` (page-locked host
/// memory, which every device with unified addressing reads directly) is nonzero, or
/// `timeout_ns` passed (so a failing test cannot leave the device spinning forever).
void launch_wait_word(void* stream, const std::uint32_t* word, std::uint64_t timeout_ns);
/// A "backward" held back by the host: launch_wait_word, then g[i] = test_gradient(i, seed).
void launch_gated_gradients(void* stream, const std::uint32_t* word, float* g, std::size_t n, int seed,
                            std::uint64_t timeout_ns);
/// The trainer-loop model: g[i] = (bf16_to_float(w[i]) - target[i]) + offset. Two
/// additions, nothing to contract: the host's same expression gives the same bits.
void launch_model_gradient(void* stream, const std::uint16_t* w, const float* target, float* g, std::size_t n,
                           float offset);
/// Around a section that races on purpose (a misplaced dependency): the CUDA double, whose
/// race detector ends the process by default, records the races instead, and
/// end_planted_races returns how many it reported; a GPU has no checker and returns -1.
void begin_planted_races();
int end_planted_races();
/// Launches a kernel with 4096 threads per block: refused with cudaErrorInvalidConfiguration,
/// a non-sticky error left pending as the thread's last error (not read here).
void launch_bad_configuration(void* stream);

} // namespace hostopt_test
