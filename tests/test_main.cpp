// Catch2's main, compiled once for every test program. Built with
// HOSTOPT_TEST_EVERY_KERNEL (the optimizer, pipeline, sharding, ... suites), a run without
// HOSTOPT_FORCE_ARCH runs itself again once per kernel this CPU supports, with
// HOSTOPT_FORCE_ARCH set, so every test that steps with the default kernel covers them
// all (Highway's way); it fails if any of those runs fails.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#if defined(HOSTOPT_TEST_EVERY_KERNEL)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

#include "hostopt/kernels.hpp"

namespace {

bool only_listing(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--list", 6) == 0 || std::strcmp(argv[i], "-l") == 0 || std::strcmp(argv[i], "-?") == 0 ||
        std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0)
      return true;
  return false;
}

int run_on_every_kernel(int argc, char** argv) {
  int failed = 0;
  std::string ran;
  for (const auto& k : hostopt::kernels()) {
    if (!k.supported) continue;
    std::fflush(stdout);
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    if (pid == 0) {
      ::setenv("HOSTOPT_FORCE_ARCH", k.name.c_str(), 1);
      ::execv(argv[0], argv);
      std::perror("execv");
      ::_exit(127);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    ran += " " + k.name + (ok ? "" : " (FAILED)");
    failed += !ok;
  }
  (void)argc;
  std::printf("every-kernel run:%s\n", ran.c_str());
  return failed;
}

} // namespace
#endif

int main(int argc, char** argv) {
#if defined(HOSTOPT_TEST_EVERY_KERNEL)
  if (!std::getenv("HOSTOPT_FORCE_ARCH") && !only_listing(argc, argv)) return run_on_every_kernel(argc, argv);
  if (const char* forced = std::getenv("HOSTOPT_FORCE_ARCH")) {
    if (hostopt::active_kernel() != forced) {
      std::printf("HOSTOPT_FORCE_ARCH=%s but the active kernel is %s\n", forced, hostopt::active_kernel().c_str());
      return 1;
    }
    std::printf("kernel: %s\n", forced);
  }
#endif
  return Catch::Session().run(argc, argv);
}
