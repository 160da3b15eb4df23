#pragma once
/// \file gradient_checks.hpp
/// Gradient statistics (deterministic global norm, non-finite detection), clipping by
/// global norm, and a dynamic loss scaler for fp16 training.

#include <cstdint>
#include <span>

#include "hostopt/dtype.hpp"
#include "hostopt/kernels.hpp"

namespace hostopt {

/// Statistics of a set of gradients.
struct grad_stats {
  double sum_squares = 0; ///< sum of g^2 in double (inf or NaN when any element is non-finite)
  double norm = 0;        ///< sqrt(sum_squares)
  bool finite = true;     ///< every element finite
};

/// Sum of squares in fixed blocks of 4096 elements (each summed in the same order on every
/// instruction set), block sums added in block order in double: bitwise identical for any
/// thread count and kernel. Throws std::invalid_argument for a bad view.
grad_stats gradient_stats(const_view grad, const execution_options& exec = {});
/// The same over several buffers (blocks never cross buffers; buffers in order). An empty
/// view is skipped.
grad_stats gradient_stats(std::span<const const_view> grads, const execution_options& exec = {});

/// optax.clip_by_global_norm's factor: 1 when norm < max_norm, else max_norm / norm.
/// Throws std::invalid_argument for max_norm <= 0 or NaN, or a negative norm.
double clip_coefficient(double norm, double max_norm);

/// Dynamic loss scaling with torch.cuda.amp.GradScaler's rules: on a non-finite gradient
/// the scale is multiplied by backoff_factor and the growth count resets; after
/// growth_interval good steps in a row it is multiplied by growth_factor (only if the
/// result stays finite).
class dynamic_loss_scaler {
public:
  /// Throws std::invalid_argument unless init_scale > 0 and finite, growth_factor > 1,
  /// 0 < backoff_factor < 1 and growth_interval >= 1 (torch's limits).
  explicit dynamic_loss_scaler(double init_scale = 65536.0, double growth_factor = 2.0,
                               double backoff_factor = 0.5, std::int64_t growth_interval = 2000);
  /// The current scale (multiply the loss by it).
  float scale() const { return scale_; }
  /// 1 / scale, the grad_scale to step with.
  float inverse_scale() const { return 1.0f / scale_; }
  /// Good steps since the last change.
  std::int64_t growth_tracker() const { return tracker_; }
  /// Records a step's outcome.
  void update(bool found_nonfinite);

private:
  float scale_;
  double growth_, backoff_;
  std::int64_t interval_, tracker_ = 0;
};

} // namespace hostopt
