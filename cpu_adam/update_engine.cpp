#include "update_engine.hpp"

#include <algorithm>

#include "parallel.hpp"

namespace hostopt::detail {

namespace {

// Elements per accumulator block: 16 KiB of f32, well inside L1/L2.
constexpr std::size_t accumulate_block = 4096;

// Runs the kernel over [a, b) of one piece, adding the accumulator first when present.
void run_range(const update_job& job, const group_kernel& g, std::size_t a, std::size_t b, const void* grad,
               void* out) noexcept {
  if (!job.flat_accumulator) {
    g.fn(g.scalars, job.params + a, job.exp_avg + a, job.exp_avg_sq + a, grad, out, b - a);
    return;
  }
  alignas(64) float sum[accumulate_block];
  for (std::size_t lo = a; lo < b; lo += accumulate_block) {
    const std::size_t n = std::min(accumulate_block, b - lo);
    const std::size_t skip = lo - a;
    job.add_grad(sum, job.flat_accumulator + (lo - job.flat_origin),
                 static_cast<const char*>(grad) + skip * job.grad_elem_bytes, n);
    g.fn(g.scalars, job.params + lo, job.exp_avg + lo, job.exp_avg_sq + lo, sum,
         out ? static_cast<char*>(out) + skip * job.out_elem_bytes : nullptr, n);
  }
}

void run_slice(const update_job& job, std::size_t lo, std::size_t hi) noexcept {
  const update_piece* first = job.pieces;
  const update_piece* last = job.pieces + job.num_pieces;
  // First piece that ends after lo.
  const update_piece* it = std::upper_bound(
      first, last, lo, [](std::size_t x, const update_piece& p) { return x < p.offset + p.size; });
  for (; it != last && it->offset < hi; ++it) {
    const std::size_t a = std::max(lo, it->offset);
    const std::size_t b = std::min(hi, it->offset + it->size);
    if (a >= b) continue;
    const void* grad;
    void* out;
    if (job.flat_grad) {
      if (it->no_grad) continue; // a tensor without a gradient this step (chunked step)
      grad = static_cast<const char*>(job.flat_grad) + (a - job.flat_origin) * job.grad_elem_bytes;
      out = job.flat_out ? static_cast<char*>(job.flat_out) + (a - job.flat_origin) * job.out_elem_bytes : nullptr;
    } else {
      if (!it->grad) continue; // a tensor without a gradient this step
      const std::size_t skip = a - it->offset;
      grad = static_cast<const char*>(it->grad) + skip * job.grad_elem_bytes;
      out = it->out ? static_cast<char*>(it->out) + skip * job.out_elem_bytes : nullptr;
    }
    run_range(job, job.groups[it->group], a, b, grad, out);
  }
}

} // namespace

void run_update(const update_job& job, int threads) {
  if (job.begin >= job.end || job.num_pieces == 0) return;
  auto body = [&job](int tid, int n) {
    const auto [lo, hi] = partition(job.begin, job.end, tid, n);
    if (lo < hi) run_slice(job, lo, hi);
  };
  run_parallel(threads, body);
}

} // namespace hostopt::detail
