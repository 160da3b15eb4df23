#include "kernel_registry.hpp"

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cpu_features.hpp"
#include "hostopt/kernels.hpp"

namespace hostopt::detail {
namespace {

constexpr registry_entry entries[] = {
#if defined(HOSTOPT_HAVE_AVX512)
    {&kernel_set_avx512, &cpu_has_avx512},
#endif
#if defined(HOSTOPT_HAVE_AVX2)
    {&kernel_set_avx2, &cpu_has_avx2},
#endif
#if defined(HOSTOPT_HAVE_SSE2)
    {&kernel_set_sse2, &cpu_has_sse2},
#endif
#if defined(HOSTOPT_HAVE_NEON)
    {&kernel_set_neon, &cpu_has_neon},
#endif
    {&kernel_set_scalar, [] () noexcept { return true; }},
};

std::string known_names() {
  std::string s;
  for (const auto& e : entries) {
    if (!s.empty()) s += ", ";
    s += e.kernels->name();
  }
  return s;
}

const kernel_set& choose_default() {
  const char* forced = std::getenv("HOSTOPT_FORCE_ARCH");
  if (forced && *forced) {
    try {
      return kernel_set_by_name(forced);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("HOSTOPT_FORCE_ARCH: ") + e.what());
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(std::string("HOSTOPT_FORCE_ARCH: ") + e.what());
    }
  }
  for (const auto& e : entries)
    if (e.supported()) return *e.kernels;
  return kernel_set_scalar;
}

} // namespace

std::span<const registry_entry> kernel_registry() { return entries; }

const kernel_set& kernel_set_by_name(std::string_view name) {
  if (name.empty()) return active_kernel_set();
  for (const auto& e : entries) {
    if (name != e.kernels->name()) continue;
    if (!e.supported())
      throw std::runtime_error("kernel '" + std::string(name) +
                               "' is compiled in but this CPU or OS cannot run it");
    return *e.kernels;
  }
  throw std::invalid_argument("kernel: unknown name '" + std::string(name) + "', expected one of: " +
                              known_names());
}

const kernel_set& active_kernel_set() {
  // Decided on first use, not at static initialisation; a failure is rethrown each call.
  static const kernel_set* chosen = &choose_default();
  return *chosen;
}

} // namespace hostopt::detail

namespace hostopt {

std::vector<kernel_info> kernels() {
  std::vector<kernel_info> out;
  for (const auto& e : detail::kernel_registry())
    out.push_back({e.kernels->name(), e.supported(), e.kernels->description(), e.kernels->required_instruction_sets()});
  return out;
}

std::string active_kernel() { return detail::active_kernel_set().name(); }

} // namespace hostopt
