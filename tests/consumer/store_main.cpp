// Uses the installed hostopt::store through its public header only: a store in the directory
// named by argv[1], stepped, reopened, and compared with the in-RAM optimizer's bits.
#include <cstdio>
#include <cstring>
#include <vector>

#include <hostopt/stored_optimizer.hpp>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer_store DIR (an empty directory on a local drive)\n");
    return 2;
  }
  const std::vector<hostopt::param_group> groups{{hostopt::adam_config{}, {{"w", {1000}}}}};
  hostopt::state_store_options options;
  options.dirs = {argv[1]};
  options.sync_every_step = false;
  hostopt::optimizer ram(groups);
  const std::size_t n = ram.arena_size();
  std::vector<float> grad(n, 0.25f), out(n);
  {
    auto stored = hostopt::stored_optimizer::create(groups, options);
    stored.step({grad.data(), n, hostopt::dtype::f32});
  }
  auto reopened = hostopt::stored_optimizer::open(groups, options);
  reopened.step({grad.data(), n, hostopt::dtype::f32}, {out.data(), n, hostopt::dtype::f32});
  for (int s = 0; s < 2; ++s) ram.step(hostopt::const_view{grad.data(), n, hostopt::dtype::f32});
  const bool same = std::memcmp(out.data(), ram.params().data(), n * 4) == 0;
  std::printf("stored optimizer: step %lld, %s the in-RAM bits\n", static_cast<long long>(reopened.step_count()),
              same ? "equal to" : "NOT equal to");
  return same && reopened.step_count() == 2 ? 0 : 1;
}
