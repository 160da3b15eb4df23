#pragma once
// Runs the test program itself again in a fresh process: for faults that end a CUDA context
// or the process (a device fault, a sticky error, the host touching device memory).
#include <unistd.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

namespace hostopt_test {

/// Runs this program again with `flag` and returns its exit status (as pclose reports it;
/// 124 << 8 after 120 s) and its output, stdout and stderr together.
inline std::pair<int, std::string> run_child(const char* flag) {
  // Resolved here: inside popen's shell, /proc/self/exe names the shell.
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) throw std::runtime_error("run_child: cannot read /proc/self/exe");
  self[len] = '\0';
  // A child that hangs (a teardown waiting forever) fails the test instead of holding CI.
  const std::string cmd = "timeout 120 '" + std::string(self) + "' " + flag + " 2>&1";
  FILE* child = popen(cmd.c_str(), "r");
  if (!child) throw std::runtime_error("run_child: popen failed for " + cmd);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, child)) out += buf;
  return {pclose(child), out};
}

} // namespace hostopt_test
