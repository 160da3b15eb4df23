#include "hostopt/gradient_checks.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "buffer_checks.hpp"
#include "kernel_registry.hpp"
#include "parallel.hpp"

namespace hostopt {

using namespace detail;

grad_stats gradient_stats(std::span<const const_view> grads, const execution_options& exec) {
  check_threads(exec.threads);
  const kernel_set& ks = kernel_set_by_name(exec.kernel);
  // Blocks of each buffer, numbered in order; block b of the whole set starts at
  // first_block[i] for buffer i.
  std::vector<std::size_t> first_block(grads.size() + 1, 0);
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    if (!(g.data == nullptr && g.size == 0))
      check_view("grads[" + std::to_string(i) + "]", g.data, g.size, g.type, g.size);
    first_block[i + 1] = first_block[i] + (g.size + stats_block - 1) / stats_block;
  }
  const std::size_t blocks = first_block.back();
  std::vector<double> sums(blocks);
  auto body = [&](int tid, int nt) {
    const std::size_t lo = blocks * std::size_t(tid) / std::size_t(nt);
    const std::size_t hi = blocks * std::size_t(tid + 1) / std::size_t(nt);
    std::size_t buf = std::size_t(std::upper_bound(first_block.begin(), first_block.end(), lo) - first_block.begin()) - 1;
    for (std::size_t b = lo; b < hi; ++b) {
      while (b >= first_block[buf + 1]) ++buf;
      const const_view& g = grads[buf];
      const std::size_t start = (b - first_block[buf]) * stats_block;
      const std::size_t n = std::min(stats_block, g.size - start);
      sums[b] = ks.sumsq(g.type)(static_cast<const char*>(g.data) + start * dtype_size(g.type), n);
    }
  };
  run_parallel(blocks < 64 ? 1 : exec.threads, body);
  double total = 0;
  for (double s : sums) total += s; // block order: the same for any thread count
  return {total, std::sqrt(total), std::isfinite(total)};
}

grad_stats gradient_stats(const_view grad, const execution_options& exec) {
  return gradient_stats(std::span<const const_view>(&grad, 1), exec);
}

double clip_coefficient(double norm, double max_norm) {
  if (!(max_norm > 0) || std::isinf(max_norm))
    throw std::invalid_argument("max_norm = " + std::to_string(max_norm) + ": expected a finite value > 0");
  if (norm < 0) throw std::invalid_argument("norm = " + std::to_string(norm) + ": expected >= 0");
  return norm < max_norm ? 1.0 : max_norm / norm;
}

dynamic_loss_scaler::dynamic_loss_scaler(double init_scale, double growth_factor, double backoff_factor,
                                         std::int64_t growth_interval)
    : scale_(float(init_scale)), growth_(growth_factor), backoff_(backoff_factor), interval_(growth_interval) {
  if (!(init_scale > 0) || !std::isfinite(float(init_scale)))
    throw std::invalid_argument("init_scale = " + std::to_string(init_scale) + ": expected a finite value > 0");
  if (!(growth_factor > 1.0) || !std::isfinite(growth_factor))
    throw std::invalid_argument("growth_factor = " + std::to_string(growth_factor) + ": expected a value > 1");
  if (!(backoff_factor > 0.0 && backoff_factor < 1.0))
    throw std::invalid_argument("backoff_factor = " + std::to_string(backoff_factor) + ": expected a value in (0, 1)");
  if (growth_interval < 1)
    throw std::invalid_argument("growth_interval = " + std::to_string(growth_interval) + ": expected >= 1");
}

void dynamic_loss_scaler::update(bool found_nonfinite) {
  if (found_nonfinite) {
    scale_ = float(double(scale_) * backoff_);
    tracker_ = 0;
    return;
  }
  if (++tracker_ == interval_) {
    const float grown = float(double(scale_) * growth_);
    if (std::isfinite(grown)) scale_ = grown;
    tracker_ = 0;
  }
}

} // namespace hostopt
