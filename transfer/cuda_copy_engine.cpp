// The CUDA copy engine: one non-blocking stream per direction, cudaMemcpyAsync, CUDA
// events for completion and timing, pinned memory from cudaHostAlloc. Only the runtime
// API is used, so this file builds with the host compiler. Every CUDA call goes through
// check(), which turns an error into std::runtime_error with cudaGetErrorString's text.
#include <array>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "hostopt/copy_engine.hpp"
#include "steady_clock.hpp"

namespace hostopt {

namespace {

using detail::now_ns;

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string("cuda: ") + what + " failed: " + cudaGetErrorName(rc) + ": " +
                             cudaGetErrorString(rc));
}


constexpr std::size_t history = 4096;
constexpr std::size_t user_events = 64;

class cuda_copy_engine final : public copy_engine {
public:
  explicit cuda_copy_engine(int device) : device_(device) {
    int count = 0;
    check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    if (device < 0 || device >= count)
      throw std::runtime_error("cuda copy engine: device " + std::to_string(device) + " does not exist (" +
                               std::to_string(count) + " visible)");
    check(cudaSetDevice(device), "cudaSetDevice");
    for (auto& s : streams_) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    for (auto& dir : slots_)
      for (auto& slot : dir) {
        check(cudaEventCreate(&slot.start), "cudaEventCreate");
        check(cudaEventCreate(&slot.end), "cudaEventCreate");
      }
    for (auto& dir : user_events_)
      for (auto& e : dir) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    // The time base: an event and the host clock taken together.
    check(cudaEventCreate(&base_), "cudaEventCreate");
    check(cudaEventRecord(base_, streams_[0]), "cudaEventRecord");
    check(cudaEventSynchronize(base_), "cudaEventSynchronize");
    base_ns_ = now_ns();
  }

  ~cuda_copy_engine() override {
    cudaSetDevice(device_);
    for (auto s : streams_) cudaStreamSynchronize(s);
    for (auto& dir : slots_)
      for (auto& slot : dir) {
        cudaEventDestroy(slot.start);
        cudaEventDestroy(slot.end);
      }
    for (auto& dir : user_events_)
      for (auto e : dir) cudaEventDestroy(e);
    cudaEventDestroy(base_);
    for (auto s : streams_) cudaStreamDestroy(s);
  }

  std::string_view name() const override { return "cuda"; }

  void* allocate_device(std::size_t bytes) override {
    void* p = nullptr;
    if (bytes == 0) return nullptr;
    check(cudaSetDevice(device_), "cudaSetDevice");
    const cudaError_t rc = cudaMalloc(&p, bytes);
    if (rc != cudaSuccess)
      throw std::runtime_error("cuda: cudaMalloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(rc));
    return p;
  }
  void free_device(void* p) noexcept override { cudaFree(p); }

  pinned_allocation allocate_pinned(std::size_t bytes) override {
    void* p = nullptr;
    if (bytes == 0) return {};
    const cudaError_t rc = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (rc != cudaSuccess)
      throw std::runtime_error("pinned buffer: cudaHostAlloc of " + std::to_string(bytes) +
                               " bytes failed: " + cudaGetErrorString(rc));
    return {p, true};
  }
  void free_pinned(pinned_allocation a, std::size_t) noexcept override { cudaFreeHost(a.data); }

  copy_ticket copy_async(copy_direction dir, void* dst, const void* src, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    const int d = int(dir);
    const std::uint64_t seq = ++issued_[d];
    slot& s = slots_[d][seq % history];
    s.sequence = seq;
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaEventRecord(s.start, streams_[d]), "cudaEventRecord");
    check(cudaMemcpyAsync(dst, src, bytes, dir == copy_direction::to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                          streams_[d]),
          dir == copy_direction::to_host ? "cudaMemcpyAsync (device to host)" : "cudaMemcpyAsync (host to device)");
    check(cudaEventRecord(s.end, streams_[d]), "cudaEventRecord");
    return {seq, dir};
  }

  void wait(const copy_ticket& t) override {
    const slot& s = find(t);
    check(cudaEventSynchronize(s.end), ("copy #" + std::to_string(t.sequence)).c_str());
  }

  copy_timing timing(const copy_ticket& t) const override {
    const slot& s = find(t);
    float start_ms = 0, end_ms = 0;
    check(cudaEventElapsedTime(&start_ms, base_, s.start), "cudaEventElapsedTime");
    check(cudaEventElapsedTime(&end_ms, base_, s.end), "cudaEventElapsedTime");
    return {base_ns_ + std::int64_t(double(start_ms) * 1e6), base_ns_ + std::int64_t(double(end_ms) * 1e6)};
  }

  void wait_device_event(copy_direction dir, void* event) override {
    if (event) check(cudaStreamWaitEvent(streams_[int(dir)], static_cast<cudaEvent_t>(event), 0), "cudaStreamWaitEvent");
  }

  void* record_device_event(copy_direction dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    const int d = int(dir);
    cudaEvent_t e = user_events_[d][next_user_[d]++ % user_events];
    check(cudaEventRecord(e, streams_[d]), "cudaEventRecord");
    return e;
  }

private:
  struct slot {
    std::uint64_t sequence = 0;
    cudaEvent_t start = nullptr, end = nullptr;
  };

  const slot& find(const copy_ticket& t) const {
    const slot& s = slots_[int(t.direction)][t.sequence % history];
    if (t.sequence == 0 || s.sequence != t.sequence)
      throw std::invalid_argument("copy_engine: ticket " + std::to_string(t.sequence) +
                                  " is unknown or older than the last 4096 copies of its direction");
    return s;
  }

  int device_;
  std::mutex mu_;
  std::array<cudaStream_t, 2> streams_{};
  std::array<std::array<slot, history>, 2> slots_{};
  std::array<std::array<cudaEvent_t, user_events>, 2> user_events_{};
  std::array<std::uint64_t, 2> issued_{}, next_user_{};
  cudaEvent_t base_ = nullptr;
  std::int64_t base_ns_ = 0;
};

} // namespace

bool cuda_device_available() noexcept {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::unique_ptr<copy_engine> make_cuda_copy_engine(int device) { return std::make_unique<cuda_copy_engine>(device); }

} // namespace hostopt
