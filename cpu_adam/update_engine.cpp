#include "update_engine.hpp"

#include <algorithm>

#include "parallel.hpp"

namespace hostopt::detail {

int out_column(bool has_out, int out_dtype) { return has_out ? 1 + out_dtype : 0; }

namespace {

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
    const std::size_t skip = a - it->offset;
    const group_kernel& g = job.groups[it->group];
    const void* grad = static_cast<const char*>(it->grad) + skip * job.grad_elem_bytes;
    void* out = it->out ? static_cast<char*>(it->out) + skip * job.out_elem_bytes : nullptr;
    g.fn(g.scalars, job.params + a, job.exp_avg + a, job.exp_avg_sq + a, grad, out, b - a);
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
