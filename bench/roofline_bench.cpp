// `hostopt-bench roofline`: this machine's memory bandwidth per thread count — STREAM-like
// copy and triad, and the Adam access pattern (4 streams read, 3 written) with no math —
// so a user sees the physical limit the step is measured against.
#include <CLI/CLI.hpp>

#include "bench_common.hpp"
#include "kernel_registry.hpp"
#include "parallel.hpp"
#include "subcommands.hpp"

namespace bench {

void add_roofline_command(CLI::App& app, roofline_options& o) {
  auto* cmd = app.add_subcommand("roofline", "Measure memory bandwidth: copy, triad and the Adam access pattern");
  cmd->add_option("-s,--size", o.size, "Elements per array, suffixes K/M/G")->capture_default_str();
  cmd->add_option("-t,--threads", o.threads, "Thread counts: a list like 1,2,4, or 'all'")->capture_default_str();
  cmd->add_option("-i,--iterations", o.iterations, "Timed iterations")->capture_default_str()->check(CLI::Range(1, 100000));
}

report run_roofline_bench(const roofline_options& o, const common_options& c) {
  const std::size_t n = parse_size(o.size, "--size");
  const std::vector<int> threads = parse_threads(o.threads);
  check_memory(4 * n * sizeof(float), "roofline benchmark of " + format_size(n) + " elements per array");
  const auto& ks = hostopt::detail::active_kernel_set();
  report r("roofline");
  add_machine_context(r);
  r.set_context("elements per array", format_size(n));
  progress prog(threads.size(), c.progress);
  std::size_t done = 0;
  for (int t : threads) {
    prog.update(done++, "roofline threads=" + std::to_string(t));
    float_buffer a(n, t), b(n, t), cc(n, t), d(n, t);
    fill_random(b.data, n, 1.0f, false, t);
    fill_random(cc.data, n, 1.0f, false, t);
    auto over = [&](auto&& fn) {
      auto body = [&](int tid, int nt) {
        const auto [lo, hi] = hostopt::detail::partition(0, n, tid, nt);
        if (lo < hi) fn(lo, hi);
      };
      const double t0 = now_seconds();
      hostopt::detail::run_parallel(t, body);
      return now_seconds() - t0;
    };
    std::vector<double> copy, triad, adam;
    for (int it = 0; it < o.iterations + 1; ++it) {
      const double tc = over([&](std::size_t lo, std::size_t hi) {
        for (std::size_t i = lo; i < hi; ++i) a.data[i] = b.data[i];
      });
      const double tt = over([&](std::size_t lo, std::size_t hi) {
        for (std::size_t i = lo; i < hi; ++i) a.data[i] = b.data[i] + 3.0f * cc.data[i];
      });
      const double ta = over([&](std::size_t lo, std::size_t hi) {
        ks.roofline(hostopt::dtype::f32, std::nullopt)(a.data + lo, b.data + lo, cc.data + lo, d.data + lo, nullptr, hi - lo);
      });
      if (it == 0) continue; // warm-up
      copy.push_back(tc);
      triad.push_back(tt);
      adam.push_back(ta);
    }
    const double bytes = double(n) * 4;
    nlohmann::ordered_json row;
    row["threads"] = t;
    row["copy_GB/s"] = 2 * bytes / summarize(copy).median / 1e9;
    row["triad_GB/s"] = 3 * bytes / summarize(triad).median / 1e9;
    row["adam_pattern_GB/s"] = 7 * bytes / summarize(adam).median / 1e9;
    row["adam_Mparam/s_limit"] = double(n) / summarize(adam).median / 1e6;
    r.add_row(row);
  }
  prog.finish();
  r.add_note("Bytes counted as the program reads and writes them (no write-allocate traffic). The Adam pattern is the f32 "
             "step's 4 reads and 3 writes per parameter with no arithmetic: no step can beat adam_Mparam/s_limit.");
  return r;
}

} // namespace bench
