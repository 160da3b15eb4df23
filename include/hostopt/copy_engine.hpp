#pragma once
/// \file copy_engine.hpp
/// Asynchronous copies between device and host memory behind one interface: `cuda`
/// (copy streams per direction, CUDA events) and `host` (device memory simulated by host
/// memory, one copy thread per direction, optional bandwidth cap to mimic PCIe).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

namespace hostopt {

/// Direction of a copy: each direction is one in-order stream.
enum class copy_direction : std::uint8_t {
  to_host = 0,   ///< device -> host (gradients in)
  to_device = 1, ///< host -> device (parameters out)
};

/// Completion marker of an enqueued copy; copies of one direction complete in order.
struct copy_ticket {
  std::uint64_t sequence = 0; ///< 1-based position in its direction's stream; 0 = none
  copy_direction direction = copy_direction::to_host;
};

/// When a completed copy ran, in nanoseconds of std::chrono::steady_clock.
struct copy_timing {
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;
};

/// A host allocation for copies (page-locked where possible).
struct pinned_allocation {
  void* data = nullptr;
  bool locked = false; ///< page-locked (cudaHostAlloc or mlock succeeded)
};

/// The copy-engine interface. Not thread-safe except where noted: one producer enqueues.
class copy_engine {
public:
  virtual ~copy_engine() = default;
  /// "cuda" or "host".
  virtual std::string_view name() const = 0;
  /// Device memory of `bytes` (host memory for the host engine); throws std::runtime_error
  /// naming the size and the reason on failure. Released with free_device.
  virtual void* allocate_device(std::size_t bytes) = 0;
  virtual void free_device(void* p) noexcept = 0;
  /// Host memory the engine copies fastest from and to (see pinned_buffer).
  virtual pinned_allocation allocate_pinned(std::size_t bytes) = 0;
  virtual void free_pinned(pinned_allocation a, std::size_t bytes) noexcept = 0;
  /// Enqueues a copy of `bytes` on the stream of `dir` and returns at once. A copy that
  /// fails is reported by wait() on its ticket (later copies still run).
  virtual copy_ticket copy_async(copy_direction dir, void* dst, const void* src, std::size_t bytes) = 0;
  /// Blocks until the ticket's copy is done; throws std::runtime_error if it failed.
  virtual void wait(const copy_ticket& t) = 0;
  /// Timing of a completed copy (valid for the most recent 4096 copies per direction).
  virtual copy_timing timing(const copy_ticket& t) const = 0;
  /// Makes later copies of `dir` wait for a device event (cudaEvent_t passed as void*),
  /// e.g. "gradients ready" recorded on the trainer's stream. The host engine ignores it.
  virtual void wait_device_event(copy_direction dir, void* event) { (void)dir, (void)event; }
  /// Records an event after all copies enqueued so far on `dir`, which a device stream
  /// can wait on (cudaEvent_t as void*, owned by the engine, reused after 64 calls);
  /// nullptr on the host engine.
  virtual void* record_device_event(copy_direction dir) { return (void)dir, nullptr; }
};

/// Options of the host engine.
struct host_engine_options {
  /// Cap per direction in GB/s (1e9 bytes/s), to mimic PCIe; 0 = as fast as memcpy.
  double bandwidth_gbps = 0;
  /// Test hook called on the copy thread before each copy with its direction and
  /// sequence number; an exception it throws fails that copy.
  std::function<void(copy_direction, std::uint64_t)> before_copy;
};

/// The host engine: copies run on one thread per direction, in order.
std::unique_ptr<copy_engine> make_host_copy_engine(host_engine_options options = {});

/// Whether this build has the CUDA engine and a CUDA device is present.
bool cuda_device_available() noexcept;

/// The CUDA engine on `device`; throws std::runtime_error when this build has no CUDA
/// support or no such device exists (with cudaGetErrorString's text).
std::unique_ptr<copy_engine> make_cuda_copy_engine(int device = 0);

/// The CUDA engine when a device is present, else the host engine.
std::unique_ptr<copy_engine> make_default_copy_engine();

/// Owning RAII handle for memory from copy_engine::allocate_pinned.
class pinned_buffer {
public:
  pinned_buffer() = default;
  /// Throws std::runtime_error naming `bytes` and the reason when allocation fails.
  pinned_buffer(copy_engine& engine, std::size_t bytes);
  ~pinned_buffer();
  pinned_buffer(pinned_buffer&& o) noexcept;
  pinned_buffer& operator=(pinned_buffer&& o) noexcept;
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  void* data() const noexcept { return alloc_.data; }
  std::size_t size() const noexcept { return bytes_; }
  /// Page-locked: DMA-able without a staging copy.
  bool locked() const noexcept { return alloc_.locked; }

private:
  copy_engine* engine_ = nullptr;
  pinned_allocation alloc_{};
  std::size_t bytes_ = 0;
};

} // namespace hostopt
