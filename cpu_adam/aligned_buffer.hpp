#pragma once
// Owning buffer of floats at a 64-byte (or, when large, 2 MiB huge-page) aligned address.
// Memory is not touched here, so the threads that update it can first-touch it.

#include <cstddef>

namespace hostopt::detail {

class aligned_floats {
public:
  aligned_floats() = default;
  /// Throws std::runtime_error naming the bytes asked for when the allocation fails.
  explicit aligned_floats(std::size_t count);
  ~aligned_floats();
  aligned_floats(aligned_floats&& o) noexcept : data_(o.data_), size_(o.size_) {
    o.data_ = nullptr;
    o.size_ = 0;
  }
  aligned_floats& operator=(aligned_floats&& o) noexcept;
  aligned_floats(const aligned_floats&) = delete;
  aligned_floats& operator=(const aligned_floats&) = delete;

  float* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

private:
  float* data_ = nullptr;
  std::size_t size_ = 0;
};

} // namespace hostopt::detail
