#pragma once
/// \file copy_engine.hpp
/// The device behind the offload pipeline, as the CUDA stream model: streams (FIFO queues
/// of device work), events, cross-stream waits, host-written flags that streams wait on
/// (stream memory operations), asynchronous copies and host functions. Two engines:
/// `cuda` (the CUDA runtime; handles are cudaStream_t / cudaEvent_t) and `host` (device
/// memory is host memory and every stream is a thread that executes its queue in order:
/// a faithful model of the same semantics, so a missing dependency shows up in tests on a
/// machine without a GPU).
///
/// Errors are sticky, as CUDA's: once a device operation fails, sticky_error() names it and
/// every later call on the engine throws std::runtime_error with that text.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace hostopt {

/// Direction of a copy; each direction has its own copy hardware (one DMA engine each).
enum class copy_direction : std::uint8_t {
  to_host = 0,   ///< device -> host (gradients in)
  to_device = 1, ///< host -> device (parameters out)
};

/// A stream: device work runs in the order it was enqueued. On the CUDA engine `handle`
/// is a cudaStream_t, so a trainer may pass its own streams. A null handle means "no
/// stream": CUDA's legacy default stream (torch's default, whose cuda_stream is 0) is
/// cuda_legacy_default() (cudaStreamLegacy).
struct device_stream {
  void* handle = nullptr;
  explicit operator bool() const noexcept { return handle != nullptr; }
  static device_stream cuda_legacy_default() noexcept { return {reinterpret_cast<void*>(std::uintptr_t(1))}; }
};

/// An event: marks a point in a stream. As in CUDA, a wait (by a stream or the host) is
/// for the most recent record made before the wait was enqueued; waiting on an event never
/// recorded returns at once. On the CUDA engine `handle` is a cudaEvent_t, so a trainer
/// may pass its own events.
struct device_event {
  void* handle = nullptr;
  explicit operator bool() const noexcept { return handle != nullptr; }
};

/// A 32-bit flag in page-locked memory that the device can read and write and the host
/// writes (write_flag); streams wait for it to reach a value.
struct device_flag {
  void* handle = nullptr;
  explicit operator bool() const noexcept { return handle != nullptr; }
};

/// A host allocation for copies (page-locked where possible).
struct pinned_allocation {
  void* data = nullptr;
  bool locked = false; ///< page-locked (cudaHostAlloc or mlock succeeded)
};

/// The device interface. Enqueueing calls may be made from any thread; work enqueued on one
/// stream from several threads runs in the order the calls were made.
class copy_engine {
public:
  /// Destroying an engine lets its flag waits go and waits for its streams, and for the host
  /// functions it enqueued on streams it does not own (a trainer's) to have run.
  virtual ~copy_engine() = default;
  /// "cuda" or "host".
  virtual std::string_view name() const = 0;

  // --- memory ---------------------------------------------------------------------------
  /// Device memory of `bytes` (host memory for the host engine); throws std::runtime_error
  /// naming the size and the reason on failure. Released with free_device.
  virtual void* allocate_device(std::size_t bytes) = 0;
  virtual void free_device(void* p) noexcept = 0;
  /// Host memory the engine copies fastest from and to (see pinned_buffer).
  virtual pinned_allocation allocate_pinned(std::size_t bytes) = 0;
  virtual void free_pinned(pinned_allocation a, std::size_t bytes) noexcept = 0;

  // --- streams and events ---------------------------------------------------------------
  virtual device_stream create_stream() = 0;
  /// Waits for the stream's work, then releases it.
  virtual void destroy_stream(device_stream s) noexcept = 0;
  /// An event the host can wait on without spinning (cudaEventBlockingSync), with timing.
  virtual device_event create_event() = 0;
  virtual void destroy_event(device_event e) noexcept = 0;
  /// Marks the current end of stream `s` with `e` (cudaEventRecord).
  virtual void record_event(device_event e, device_stream s) = 0;
  /// Later work on `s` waits for `e`'s most recent record (cudaStreamWaitEvent).
  virtual void stream_wait_event(device_stream s, device_event e) = 0;
  /// Blocks the calling thread until `e`'s most recent record completed; throws the
  /// sticky error if the device failed.
  virtual void synchronize_event(device_event e) = 0;
  /// Whether `e`'s most recent record completed; never blocks.
  virtual bool event_done(device_event e) = 0;
  /// When a completed event's record ran, in nanoseconds of std::chrono::steady_clock (the
  /// clock of the pipeline's host-side spans).
  virtual std::int64_t event_time_ns(device_event e) = 0;
  /// Blocks until all work enqueued on `s` so far is done.
  virtual void synchronize_stream(device_stream s) = 0;

  // --- work -------------------------------------------------------------------------------
  /// Enqueues a copy of `bytes` on `s` and returns at once (cudaMemcpyAsync). `dir` says
  /// which side is the device's.
  virtual void copy_async(device_stream s, copy_direction dir, void* dst, const void* src, std::size_t bytes) = 0;
  /// Enqueues a host function that runs when the stream reaches it (cudaLaunchHostFunc);
  /// it must not call the engine. On the host engine this is how tests write "kernels".
  virtual void launch_host_function(device_stream s, std::function<void()> fn) = 0;

  // --- flags (stream memory operations) ---------------------------------------------------
  /// A flag holding 0. Released with free_flag.
  virtual device_flag allocate_flag() = 0;
  /// Waits on `f` still pending are let go (the work behind them runs, ungated), and the
  /// flag's memory is freed once no stream reads it any more.
  virtual void free_flag(device_flag f) noexcept = 0;
  /// Later work on `s` waits until the flag reaches `value`: (int32_t)(flag - value) >= 0,
  /// so a counter may wrap (cuStreamWaitValue32 with CU_STREAM_WAIT_VALUE_GEQ).
  virtual void stream_wait_flag(device_stream s, device_flag f, std::uint32_t value) = 0;
  /// The host stores `value` into the flag (release order: writes before it are visible
  /// to the device work it lets go).
  virtual void write_flag(device_flag f, std::uint32_t value) = 0;
  /// "stream memory operations" when the device runs flag waits itself; otherwise how the
  /// engine emulates them (e.g. a host function that blocks the stream until the flag).
  virtual std::string flag_mechanism() const = 0;

  // --- errors -------------------------------------------------------------------------------
  /// Empty while the device is healthy; else the first device error's text. Sticky.
  virtual std::string sticky_error() const = 0;
};

/// One completed operation of a host-engine stream, for tests and timelines.
struct device_op_record {
  const void* stream = nullptr; ///< device_stream::handle
  const char* kind = "";        ///< "copy to host", "copy to device", "record", "wait event", "wait flag", "host function"
  const void* object = nullptr; ///< the event or flag handle of a record or wait
  std::int64_t enqueued_ns = 0; ///< when it was enqueued (steady_clock)
  std::int64_t start_ns = 0;    ///< when the stream reached it (steady_clock)
  std::int64_t end_ns = 0;      ///< when it was done: for a wait, when it was satisfied
};

/// Options of the host engine.
struct host_engine_options {
  /// Cap per direction in GB/s (1e9 bytes/s), to mimic PCIe; 0 = as fast as memcpy.
  double bandwidth_gbps = 0;
  /// Test hook called on the stream's thread before each copy with its direction and
  /// 1-based sequence number in that direction; an exception it throws fails the copy and,
  /// as a failed CUDA copy does, makes the error sticky.
  std::function<void(copy_direction, std::uint64_t)> before_copy;
  /// Called on the stream's thread after each operation (waits included); must not call
  /// the engine.
  std::function<void(const device_op_record&)> on_op;
  /// false: a copy moves nothing and only takes its time at bandwidth_gbps, as a GPU's DMA
  /// costs no core (for projections: `hostopt-bench trainer`); pinned memory then starts
  /// zeroed, so what the update reads from it is defined. (Last: brace-initialized options
  /// written before it keep their meaning.)
  bool move_bytes = true;
};

/// The host engine: a model of CUDA streams on threads ("device" memory is host memory).
std::unique_ptr<copy_engine> make_host_copy_engine(host_engine_options options = {});

/// Whether this build has the CUDA engine and a CUDA device is present.
bool cuda_device_available() noexcept;

/// The CUDA engine on `device`; throws std::runtime_error when this build has no CUDA
/// support or no such device exists (with cudaGetErrorString's text). Every call sets the
/// engine's device and restores the caller's current device before returning.
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
