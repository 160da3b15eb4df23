// The CUDA double's process state: settings from the environment, primary contexts and
// each thread's current one, last and sticky errors, injected faults, violations and the
// call sites they name.
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <map>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

#include "double_internal.hpp"

namespace cuda_double::detail {

namespace {

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const unsigned long long x = std::strtoull(v, &end, 0);
  if (*end) {
    std::fprintf(stderr, "cuda double: %s='%s' is not a number\n", name, v);
    std::abort();
  }
  return x;
}

settings read_settings() {
  settings s;
  const auto clock_seed = std::uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                          std::uint64_t(getpid()) << 32;
  s.seed = env_u64("HOSTOPT_CUDA_DOUBLE_SEED", clock_seed);
  s.devices = int(env_u64("HOSTOPT_CUDA_DOUBLE_DEVICES", 2));
  s.max_delay_ns = env_u64("HOSTOPT_CUDA_DOUBLE_MAX_DELAY_US", 200) * 1000;
  if (const char* m = std::getenv("HOSTOPT_CUDA_DOUBLE_MODEL")) {
    // "link_gbps=25,device_tflops=100,move_data=0"
    std::string spec = m;
    std::size_t at = 0;
    while (at < spec.size()) {
      const std::size_t comma = spec.find(',', at);
      const std::string item = spec.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
      const std::size_t eq = item.find('=');
      const std::string key = item.substr(0, eq);
      const double value = eq == std::string::npos ? 0 : std::atof(item.c_str() + eq + 1);
      if (key == "link_gbps" && value > 0)
        s.link_bytes_per_ns = value; // GB/s = bytes per ns
      else if (key == "device_tflops" && value > 0)
        s.device_flops_per_ns = value * 1e3;
      else if (key == "move_data" && eq != std::string::npos &&
               (item.substr(eq + 1) == "0" || item.substr(eq + 1) == "1"))
        s.move_data = item.substr(eq + 1) == "1";
      else {
        std::fprintf(stderr,
                     "cuda double: HOSTOPT_CUDA_DOUBLE_MODEL item '%s' (expected link_gbps=X, "
                     "device_tflops=X or move_data=0|1)\n",
                     item.c_str());
        std::abort();
      }
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
  }
  return s;
}

struct fault_rule {
  std::string api;
  int countdown;
  int error;
  bool driver; // error is a CUresult (else a cudaError_t)
  bool at_execution;
};

struct process_state {
  settings config = read_settings();
  std::vector<context> contexts = std::vector<context>(std::size_t(std::max(config.devices, 0)));
  std::vector<std::atomic<int>> sticky = std::vector<std::atomic<int>>(contexts.size());
  std::mutex mu; // faults and recorded violations
  std::vector<fault_rule> faults;
  bool recording = false;
  std::vector<std::string> violations;
};

std::vector<fault_rule> parse_faults(const std::string& spec);

process_state& state() {
  static process_state* s = [] {
    auto* p = new process_state; // never destroyed: stream workers may outlive main's statics
    for (std::size_t d = 0; d < p->contexts.size(); ++d) p->contexts[d].device = int(d);
    if (const char* f = std::getenv("HOSTOPT_CUDA_DOUBLE_FAULTS")) p->faults = parse_faults(f);
    return p;
  }();
  return *s;
}

std::string resolve_frame(void* pc) {
  Dl_info info{};
  if (!dladdr(pc, &info) || !info.dli_fname) return "?";
  const auto offset =
      reinterpret_cast<std::uintptr_t>(pc) - reinterpret_cast<std::uintptr_t>(info.dli_fbase) - 1;
  // addr2line names static and anonymous-namespace functions too (dladdr sees exports only).
  char cmd[1024];
  std::snprintf(cmd, sizeof cmd, "addr2line -C -f -e '%s' 0x%" PRIxPTR " 2>/dev/null", info.dli_fname,
                std::uintptr_t(offset));
  std::string function, where;
  if (FILE* p = popen(cmd, "r")) {
    char line[1024];
    if (std::fgets(line, sizeof line, p)) function = line;
    if (std::fgets(line, sizeof line, p)) where = line;
    pclose(p);
  }
  while (!function.empty() && function.back() == '\n') function.pop_back();
  while (!where.empty() && where.back() == '\n') where.pop_back();
  if (function.empty() || function == "??") {
    int status = 0;
    char* demangled =
        info.dli_sname ? abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status) : nullptr;
    function = demangled ? demangled : info.dli_sname ? info.dli_sname : "?";
    std::free(demangled);
  }
  if (where.empty() || where.rfind("??", 0) == 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "+0x%" PRIxPTR, std::uintptr_t(offset));
    where = std::string(info.dli_fname) + buf;
  }
  return function + " (" + where + ")";
}

} // namespace

const settings& config() { return state().config; }

void violation(const std::string& text) {
  auto& s = state();
  const std::string line = "cuda double: VIOLATION: " + text + " [seed " + std::to_string(s.config.seed) +
                           ": rerun with HOSTOPT_CUDA_DOUBLE_SEED=" + std::to_string(s.config.seed) + "]";
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.recording) {
      s.violations.push_back(line);
      return;
    }
  }
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  std::abort();
}

call_site capture_call_site() {
  call_site site;
  site.depth = backtrace(site.frames, int(std::size(site.frames)));
  return site;
}

std::string describe(const call_site& site) {
  std::string out;
  int shown = 0;
  for (int i = 0; i < site.depth && shown < 3; ++i) {
    const std::string frame = resolve_frame(site.frames[i]);
    // The double's own frames say nothing; its stand-in kernels are call sites worth naming.
    const bool own = frame.find("tests/cuda_double/") != std::string::npos &&
                     frame.find("_kernels.cpp") == std::string::npos;
    const bool own_unresolved = frame.find("cuda_double::detail::") != std::string::npos;
    if (own || own_unresolved) continue;
    if (!out.empty()) out += " <- ";
    out += frame;
    ++shown;
  }
  return out.empty() ? "(no call site)" : out;
}

context* primary_context(int device) {
  auto& s = state();
  if (device < 0 || device >= int(s.contexts.size())) return nullptr;
  return &s.contexts[std::size_t(device)];
}

bool is_context(const void* c) {
  auto& s = state();
  for (const auto& x : s.contexts)
    if (&x == c) return true;
  return false;
}

context*& current_context() {
  thread_local context* current = nullptr;
  return current;
}

int& runtime_device() {
  thread_local int device = 0;
  return device;
}

int device_for_runtime_call() {
  context*& current = current_context();
  if (!current) {
    current = primary_context(runtime_device());
    if (!current) return -1;
    current->runtime_active = true;
  }
  return current->device;
}

cudaError_t& last_error() {
  thread_local cudaError_t e = cudaSuccess;
  return e;
}

cudaError_t sticky_error(int device) {
  auto& s = state();
  if (device < 0 || device >= int(s.sticky.size())) return cudaSuccess;
  return cudaError_t(s.sticky[std::size_t(device)].load(std::memory_order_acquire));
}

void set_sticky_error(int device, cudaError_t e) {
  auto& s = state();
  if (device < 0 || device >= int(s.sticky.size())) return;
  int expected = cudaSuccess;
  s.sticky[std::size_t(device)].compare_exchange_strong(expected, int(e));
}

bool& in_host_function() {
  thread_local bool inside = false;
  return inside;
}

namespace {
struct fault {
  int error = 0;
  bool driver = false;
};

fault take_fault(const char* api, bool at_execution) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto it = s.faults.begin(); it != s.faults.end(); ++it)
    if (it->at_execution == at_execution && it->api == api && --it->countdown == 0) {
      const fault f{it->error, it->driver};
      s.faults.erase(it);
      return f;
    }
  return {};
}

cudaError_t as_runtime(fault f) { return f.driver ? from_driver(CUresult(f.error)) : cudaError_t(f.error); }

bool refused_in_host_function(const char* api) {
  if (!in_host_function()) return false;
  violation(std::string(api) +
            " called from inside a host function (cudaLaunchHostFunc): CUDA forbids "
            "any CUDA call there; called from " +
            describe(capture_call_site()));
  return true;
}
} // namespace

cudaError_t enter(const char* api) {
  if (refused_in_host_function(api)) return cudaErrorNotPermitted;
  return as_runtime(take_fault(api, false));
}

CUresult enter_driver(const char* api) {
  if (refused_in_host_function(api)) return CUDA_ERROR_NOT_PERMITTED;
  const fault f = take_fault(api, false);
  return f.driver ? CUresult(f.error) : to_driver(cudaError_t(f.error));
}

cudaError_t result(cudaError_t e) {
  if (e != cudaSuccess) last_error() = e;
  return e;
}

cudaError_t execution_fault(const char* api) { return as_runtime(take_fault(api, true)); }

} // namespace cuda_double::detail

namespace cuda_double {

namespace detail {
namespace {
std::vector<fault_rule> parse_faults(const std::string& spec) {
  std::vector<fault_rule> rules;
  std::size_t at = 0;
  while (at <= spec.size()) {
    const std::size_t semi = spec.find(';', at);
    std::string item = spec.substr(at, semi == std::string::npos ? std::string::npos : semi - at);
    at = semi == std::string::npos ? spec.size() + 1 : semi + 1;
    if (item.empty()) continue;
    fault_rule r{};
    if (item.rfind("exec:", 0) == 0) {
      r.at_execution = true;
      item = item.substr(5);
    }
    const std::size_t hash = item.find('#'), eq = item.find('=');
    if (hash == std::string::npos || eq == std::string::npos || eq < hash)
      throw std::invalid_argument("cuda double: fault '" + item + "': expected API#N=ERROR");
    r.api = item.substr(0, hash);
    r.countdown = std::atoi(item.substr(hash + 1, eq - hash - 1).c_str());
    if (r.countdown < 1 || !error_by_name(item.substr(eq + 1), r.error, r.driver))
      throw std::invalid_argument("cuda double: fault '" + item +
                                  "': N must be >= 1 and ERROR a known error name");
    rules.push_back(r);
  }
  return rules;
}
} // namespace
} // namespace detail

void inject_faults(const std::string& spec) {
  using namespace detail;
  const std::vector<fault_rule> rules = parse_faults(spec);
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.faults.insert(s.faults.end(), rules.begin(), rules.end());
}

void clear_faults() {
  auto& s = detail::state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.faults.clear();
}

void record_violations(bool record) {
  auto& s = detail::state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.recording = record;
}

std::vector<std::string> take_violations() {
  auto& s = detail::state();
  std::lock_guard<std::mutex> lock(s.mu);
  return std::exchange(s.violations, {});
}

std::uint64_t seed() { return detail::config().seed; }

void refuse_launch(cudaError_t error) { detail::last_error() = error; }

} // namespace cuda_double
