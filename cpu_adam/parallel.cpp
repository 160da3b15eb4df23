#include "parallel.hpp"

#include "fp_environment.hpp"

#if defined(HOSTOPT_THREADING_THREADS)
#include <thread>
#include <vector>
#elif defined(HOSTOPT_THREADING_TBB)
#include <map>
#include <memory>
#include <mutex>

#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>
#else
#include <omp.h>
#endif

namespace hostopt::detail {

namespace {
// Every worker runs its part in the kernels' floating-point mode, whatever its thread had.
void run_body(void (*body)(void*, int, int) noexcept, void* ctx, int tid, int nthreads) noexcept {
  const ieee_float_mode mode;
  body(ctx, tid, nthreads);
}
} // namespace

#if defined(HOSTOPT_THREADING_THREADS)

// Plain std::threads, started per region: slower to start than a pool, but every
// synchronisation is visible to ThreadSanitizer (libgomp and libtbb are not instrumented),
// which is what the tsan preset builds it for.
int default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n ? int(n) : 1;
}
const char* threading_backend() { return "threads"; }

void run_parallel(int threads, void (*body)(void*, int, int) noexcept, void* ctx) {
  if (threads <= 0) threads = default_threads();
  std::vector<std::thread> workers;
  workers.reserve(std::size_t(threads - 1));
  for (int t = 1; t < threads; ++t) workers.emplace_back([=] { run_body(body, ctx, t, threads); });
  run_body(body, ctx, 0, threads);
  for (auto& w : workers) w.join();
}

#elif defined(HOSTOPT_THREADING_TBB)

int default_threads() { return tbb::info::default_concurrency(); }
const char* threading_backend() { return "tbb"; }

namespace {
// One arena per thread count, made on first use, so a step allocates nothing.
tbb::task_arena& arena_for(int threads) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<tbb::task_arena>> arenas;
  std::lock_guard<std::mutex> lock(mu);
  auto& a = arenas[threads];
  if (!a) a = std::make_unique<tbb::task_arena>(threads);
  return *a;
}
} // namespace

void run_parallel(int threads, void (*body)(void*, int, int) noexcept, void* ctx) {
  if (threads <= 0) threads = default_threads();
  if (threads == 1) {
    run_body(body, ctx, 0, 1);
    return;
  }
  arena_for(threads).execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<int>(0, threads, 1),
        [&](const tbb::blocked_range<int>& r) {
          for (int t = r.begin(); t < r.end(); ++t) run_body(body, ctx, t, threads);
        },
        tbb::static_partitioner());
  });
}

#else

int default_threads() { return omp_get_max_threads(); }
const char* threading_backend() { return "openmp"; }

void run_parallel(int threads, void (*body)(void*, int, int) noexcept, void* ctx) {
  if (threads <= 0) threads = default_threads();
  if (threads == 1) {
    run_body(body, ctx, 0, 1);
    return;
  }
#pragma omp parallel num_threads(threads)
  run_body(body, ctx, omp_get_thread_num(), omp_get_num_threads());
}

#endif

} // namespace hostopt::detail
