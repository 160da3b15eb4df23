// Runs print_active_kernel (argv[1]) once per kernel compiled in, with HOSTOPT_FORCE_ARCH
// naming it: a kernel this CPU supports must be the one that runs, one it does not support
// must be refused. Prints "forced and ran: ..." only when every case held.
#include <cstdio>
#include <string>

#include "hostopt/kernels.hpp"

namespace {

// Output and exit status of `HOSTOPT_FORCE_ARCH=name program`.
std::pair<std::string, int> run_forced(const std::string& program, const std::string& name) {
  const std::string cmd = "HOSTOPT_FORCE_ARCH=" + name + " '" + program + "' 2>&1";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (!f) return {"popen failed", -1};
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, f)) out += buf;
  return {out, ::pclose(f)};
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::printf("usage: force_every_kernel PATH/TO/print_active_kernel\n");
    return 2;
  }
  std::string ran;
  int bad = 0;
  for (const auto& k : hostopt::kernels()) {
    const auto [out, status] = run_forced(argv[1], k.name);
    const bool ok = k.supported ? status == 0 && out.rfind("active kernel: " + k.name + "\n", 0) == 0
                                : status != 0 && out.find("HOSTOPT_FORCE_ARCH") != std::string::npos;
    std::printf("%s (%s): %s", k.name.c_str(), k.supported ? "supported" : "not supported", out.c_str());
    if (!ok) {
      std::printf("  ^ unexpected (exit status %d)\n", status);
      ++bad;
    } else if (k.supported) {
      ran += " " + k.name;
    }
  }
  if (bad) return 1;
  std::printf("forced and ran:%s\n", ran.c_str());
  return 0;
}
