#pragma once
// Shared pieces of the benchmark subcommands: sizes with suffixes, the memory check,
// buffers first-touched by the threads that use them, timing statistics, progress.

#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "hostopt/dtype.hpp"

namespace bench {

/// Parses "1000", "64M", "1G", "2.5K" (K/M/G = 2^10/2^20/2^30) into a count >= 1; throws
/// std::invalid_argument naming `flag`, the text and the accepted forms otherwise (0 too:
/// a size of 0 has nothing to time).
std::size_t parse_size(const std::string& text, const std::string& flag);
/// "64M", "1.5G", "1000".
std::string format_size(std::size_t n);

/// Bytes the OS reports available (MemAvailable), or 0 when unknown.
std::size_t available_memory_bytes();
/// Throws std::runtime_error when `bytes` exceed 90% of available memory, saying how
/// much was asked, how much there is, and what to lower.
void check_memory(std::size_t bytes, const std::string& what);

/// A directory of the run's own inside a directory the user named (`what`.<pid>: a store's, a
/// scratch file's), removed however the run ends.
struct scratch_dir {
  std::filesystem::path path;
  scratch_dir(const std::string& dir, const std::string& what)
      : path(std::filesystem::path(dir) / (what + "." + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path);
  }
  ~scratch_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
};

/// Floats at a 64-byte aligned address, first-touched (zeroed) by `threads` workers
/// with the library's partition, so pages land where the step will use them.
struct float_buffer {
  float* data = nullptr;
  std::size_t size = 0;
  float_buffer() = default;
  float_buffer(std::size_t n, int threads);
  ~float_buffer();
  float_buffer(float_buffer&& o) noexcept;
  float_buffer& operator=(float_buffer&& o) noexcept;
};

/// Bytes of a buffer of n elements of dtype t (as raw storage in a float_buffer).
float_buffer typed_buffer(std::size_t n, hostopt::dtype t, int threads);

/// Fills with small normal-ish values (p, grads) or small positives (v), in parallel.
void fill_random(float* x, std::size_t n, float scale, bool positive, int threads);
void fill_random_half(std::uint16_t* x, std::size_t n, hostopt::dtype t, int threads);

/// Median and minimum of a set of timings, in seconds.
struct timing {
  double median = 0, min = 0;
};
timing summarize(std::vector<double> seconds);

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// A progress line on stderr, shown once a run has lasted a few seconds.
class progress {
public:
  explicit progress(std::size_t total, bool enabled = true);
  void update(std::size_t done, const std::string& what);
  void finish();

private:
  std::size_t total_;
  bool enabled_, tty_, shown_ = false;
  double start_, last_ = 0;
};

/// Thread counts "1,2,4" or "all" (1..hardware threads, powers of two plus the maximum).
std::vector<int> parse_threads(const std::string& text);

/// Number of hardware threads the threading runtime uses by default.
int hardware_threads();

} // namespace bench
