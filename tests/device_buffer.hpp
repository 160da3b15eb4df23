#pragma once
// A device buffer of a copy engine (host memory on the host engine), zeroed, freed with the
// object.
#include <cstddef>
#include <cstring>

#include "hostopt/copy_engine.hpp"

namespace hostopt_test {

struct device_buffer {
  hostopt::copy_engine& engine;
  void* data;
  std::size_t bytes;
  device_buffer(hostopt::copy_engine& e, std::size_t n) : engine(e), data(e.allocate_device(n)), bytes(n) {
    if (data) std::memset(data, 0, n);
  }
  ~device_buffer() { engine.free_device(data); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
};

} // namespace hostopt_test
