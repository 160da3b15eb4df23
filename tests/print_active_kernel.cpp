// Prints the kernel hostopt chooses (or the error for a bad HOSTOPT_FORCE_ARCH), and runs a
// step with it so the forced kernel is shown to really run.
#include <cstdio>
#include <exception>
#include <vector>

#include "hostopt/hostopt.hpp"

int main() {
  try {
    std::vector<float> p(33, 1.0f), m(33), v(33), g(33, 0.5f);
    hostopt::adam_step(p.data(), m.data(), v.data(), 33, {g.data(), 33, hostopt::dtype::f32}, {}, {}, 1);
    std::printf("active kernel: %s\n", hostopt::active_kernel().c_str());
    return p[32] < 1.0f ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
}
