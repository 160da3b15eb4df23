// Uses the installed library through its public headers only.
#include <cstdio>
#include <vector>

#include <hostopt/hostopt.hpp>

int main() {
  hostopt::adam_config config;
  config.lr = 0.1;
  hostopt::optimizer opt({{config, {{"w", {4}}}}});
  const std::vector<float> w{1, 2, 3, 4}, g{1, -1, 1, -1};
  opt.set_params("w", {w.data(), w.size(), hostopt::dtype::f32});
  opt.step(std::vector<hostopt::const_view>{{g.data(), g.size(), hostopt::dtype::f32}});
  const auto p = opt.params("w");
  std::printf("hostopt %s, kernel %s: w = %g %g %g %g\n", hostopt::library_version(),
              hostopt::active_kernel().c_str(), p[0], p[1], p[2], p[3]);
  // Adam's first step moves each weight by lr against the gradient's sign.
  const bool ok = p[0] < 0.91f && p[0] > 0.89f && p[1] > 2.09f && p[1] < 2.11f;
  return ok ? 0 : 1;
}
