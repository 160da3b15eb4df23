// libFuzzer target: arbitrary bytes as a checkpoint file. load_checkpoint must either load
// or throw std::runtime_error — never crash, read out of bounds, or allocate from an
// unchecked size — and must leave the optimizer unchanged when it throws.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

#include "hostopt/hostopt.hpp"

namespace {
hostopt::optimizer& target() {
  static hostopt::optimizer opt({{hostopt::adam_config{}, {{"w", {3, 5}}, {"b", {5}}}},
                                 {hostopt::adam_config{}, {{"s", {}}}}},
                                {1, ""});
  return opt;
}
const std::string& path() {
  static const std::string p = "/tmp/hostopt_fuzz_ckpt_" + std::to_string(::getpid()) + ".safetensors";
  return p;
}
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FILE* f = std::fopen(path().c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  hostopt::optimizer& opt = target();
  const std::vector<float> before(opt.params().begin(), opt.params().end());
  try {
    hostopt::load_checkpoint(opt, path());
  } catch (const std::runtime_error&) {
    if (std::memcmp(before.data(), opt.params().data(), before.size() * 4) != 0) __builtin_trap();
  }
  return 0;
}
