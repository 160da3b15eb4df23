// tests/cuda_test_kernels.hpp on the CUDA double: each "kernel" is device work (a
// cuda_double::launch), so test_cuda runs its kernel paths unchanged. Same formulas and
// bits as cuda_test_kernels.cu.
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "../cuda_test_kernels.hpp"
#include "cuda_double.hpp"

namespace hostopt_test {

namespace {

cudaStream_t stream(void* s) { return static_cast<cudaStream_t>(s); }

float bf16_to_float(std::uint16_t b) {
  const std::uint32_t bits = std::uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A kernel launch's error is the caller's to read (cudaGetLastError); a test kernel that
// cannot be enqueued is a broken test.
void launched(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": launch failed: " + cudaGetErrorName(rc));
}

void wait_word(const std::uint32_t* word, std::uint64_t timeout_ns) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
  while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
}

} // namespace

void launch_spin(void* s, std::uint64_t ns) {
  launched(cuda_double::launch(stream(s), "spin kernel", {}, nullptr, ns), "launch_spin");
  (void)cudaGetLastError(); // as the .cu version: its launch checked, and so cleared
}

void launch_late_gradients(void* s, float* g, std::size_t n, int seed, std::uint64_t delay_ns) {
  launched(cuda_double::launch(
               stream(s), "late gradients kernel", {{g, n * 4, true}},
               [g, n, seed] {
                 float* out = cuda_double::device_view(g);
                 for (std::size_t i = 0; i < n; ++i) out[i] = test_gradient(i, seed);
               },
               delay_ns),
           "launch_late_gradients");
}

void launch_fault(void* s) { launched(cuda_double::launch_fault(stream(s)), "launch_fault"); }

void launch_wait_word(void* s, const std::uint32_t* word, std::uint64_t timeout_ns) {
  launched(cuda_double::launch(stream(s), "wait word kernel", {},
                               [word, timeout_ns] { wait_word(word, timeout_ns); }),
           "launch_wait_word");
}

void launch_gated_gradients(void* s, const std::uint32_t* word, float* g, std::size_t n, int seed,
                            std::uint64_t timeout_ns) {
  launched(cuda_double::launch(stream(s), "gated gradients kernel", {{g, n * 4, true}},
                               [word, g, n, seed, timeout_ns] {
                                 wait_word(word, timeout_ns);
                                 float* out = cuda_double::device_view(g);
                                 for (std::size_t i = 0; i < n; ++i) out[i] = test_gradient(i, seed);
                               }),
           "launch_gated_gradients");
}

void launch_model_gradient(void* s, const std::uint16_t* w, const float* target, float* g, std::size_t n,
                           float offset) {
  launched(cuda_double::launch(stream(s), "model gradient kernel",
                               {{w, n * 2, false}, {target, n * 4, false}, {g, n * 4, true}},
                               [w, target, g, n, offset] {
                                 const std::uint16_t* wv = cuda_double::device_view(w);
                                 const float* tv = cuda_double::device_view(target);
                                 float* gv = cuda_double::device_view(g);
                                 for (std::size_t i = 0; i < n; ++i)
                                   gv[i] = (bf16_to_float(wv[i]) - tv[i]) + offset;
                               }),
           "launch_model_gradient");
}

void begin_planted_races() { cuda_double::record_violations(true); }

int end_planted_races() {
  int races = 0;
  for (const std::string& v : cuda_double::take_violations()) {
    if (v.find("race: ") == std::string::npos)
      throw std::logic_error("a planted race section broke a rule: " + v);
    ++races;
  }
  cuda_double::record_violations(false);
  return races;
}

void launch_bad_configuration(void*) { cuda_double::refuse_launch(cudaErrorInvalidConfiguration); }

} // namespace hostopt_test
