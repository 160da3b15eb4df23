// Choosing a copy engine, and the CUDA entry points of a build without CUDA.
#include <stdexcept>

#include "hostopt/copy_engine.hpp"

namespace hostopt {

std::unique_ptr<copy_engine> make_default_copy_engine() {
  if (cuda_device_available()) return make_cuda_copy_engine(0);
  return make_host_copy_engine();
}

#if !defined(HOSTOPT_HAVE_CUDA)
bool cuda_device_available() noexcept { return false; }

std::unique_ptr<copy_engine> make_cuda_copy_engine(int device) {
  throw std::runtime_error("cuda copy engine (device " + std::to_string(device) +
                           "): this hostopt was built without CUDA (configure with the CUDA toolkit and "
                           "HOSTOPT_WITH_CUDA=AUTO or ON)");
}
#endif

} // namespace hostopt
