// `hostopt-bench project`: what each moment format's step takes on any machine, and whether
// it beats f32 there. A step costs its arithmetic (measured here with the data in L2: the
// in-cache cost) and its memory traffic (the format's bytes per parameter at the memory
// bandwidth one core gets). On a loaded server every core steps and each gets a few GB/s,
// so compressed moments, which move fewer bytes for more arithmetic, win there even where a
// lightly loaded core (this VM's) makes them lose. The projection combines the two costs both
// ways they can (overlapped, serial); `--validate SIZE` measures where the steps lie at 1
// thread and at every thread here.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <regex>
#include <stdexcept>

#include "bench_common.hpp"
#include "kernel_registry.hpp"
#include "state_steps.hpp"
#include "subcommands.hpp"

namespace bench {

namespace {

using hostopt::moment_format;

// A loaded server's memory bandwidth per core with every core busy (docs/compressed-moments.md): sustained STREAM is ~75-80% of the channels' peak, e.g. 8 x DDR5-4800
// (307 GB/s) over a 56-core Xeon 8480+, 12 x DDR5-4800 (461 GB/s) over a 96-core EPYC 9654,
// 8 x DDR4-3200 (205 GB/s) over a 64-core EPYC 7763: 2.5-4.3 GB/s per core.
constexpr double loaded_server_gbps = 4.0;

// ns per parameter on one core, the arithmetic with its data in cache (c, ns) and the bytes
// at the core's bandwidth (b / B, GB/s = bytes per ns), in the two ways they can combine:
// overlapped (the longer hides the shorter: max) or serial (one after the other: the sum).
// A kernel hides its memory well when its loads run far ahead of its arithmetic (the f32
// step here: within 2% of overlapped), less when a block's arithmetic is one long chain (the
// 8-bit step: about halfway with avx512, at serial with avx2); --validate measures where this
// machine's steps lie.
double overlapped_ns(double c, double b, double gbps) { return std::max(c, b / gbps); }
double serial_ns(double c, double b, double gbps) { return c + b / gbps; }

// The bandwidth per core below which a format (c_f ns, b_f bytes) is faster than f32 (c, b).
// Serial: c_f + b_f / B < c + b / B  <=>  B < (b - b_f) / (c_f - c). Overlapped (f32 still
// waiting for memory there): max(c_f, b_f / B) < b / B  <=>  B < b / c_f. Infinite when the
// format costs no more even in cache.
double faster_below_serial(double c_f, double b_f, double c, double b) {
  return c_f <= c ? std::numeric_limits<double>::infinity() : (b - b_f) / (c_f - c);
}
double faster_below_overlapped(double c_f, double c, double b) {
  return c_f <= c ? std::numeric_limits<double>::infinity() : b / c_f;
}

struct bandwidth_choice {
  std::string name;
  double gbps; // per core; < 0: measured
};

std::vector<bandwidth_choice> parse_bandwidths(const std::vector<std::string>& texts) {
  std::vector<bandwidth_choice> out;
  for (const std::string& t : texts) {
    if (t == "measured") out.push_back({"this machine, every core busy", -1});
    else if (t == "loaded") out.push_back({"loaded server", loaded_server_gbps});
    else {
      // A decimal number of GB/s per core, from 0.01 (a core starved of memory) to 10^5.
      static const std::regex decimal(R"([0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|\.[0-9]+([eE][-+]?[0-9]+)?)");
      const double v = std::regex_match(t, decimal) ? std::strtod(t.c_str(), nullptr) : -1;
      if (!(v >= 0.01 && v <= 1e5))
        throw std::invalid_argument("--bandwidth '" + t + "': expected 'measured', 'loaded' or GB/s per core, a "
                                    "decimal number in [0.01, 100000]");
      out.push_back({"given", v});
    }
  }
  for (std::size_t i = 0; i < out.size(); ++i) // (each once)
    for (std::size_t j = i + 1; j < out.size();)
      if (out[j].name == out[i].name && out[j].gbps == out[i].gbps) out.erase(out.begin() + std::ptrdiff_t(j));
      else ++j;
  if (out.empty()) throw std::invalid_argument("--bandwidth: expected at least one of measured, loaded, GB/s");
  return out;
}

std::string format_percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f%%", 100.0 * fraction);
  return text;
}
std::string format_g(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}

hostopt::adam_config bench_config() {
  hostopt::adam_config cfg;
  cfg.mode = hostopt::adam_mode::adamw;
  cfg.weight_decay = 0.01;
  return cfg;
}

// Each format's in-cache cost in ns per parameter: the minimum over interleaved steps of
// n parameters (in L2) on one thread.
std::vector<double> in_cache_costs(std::size_t n, const dtype_mix& mix, const std::vector<moment_format>& states,
                                   const hostopt::detail::kernel_set& ks, int warmup, int iterations) {
  state_steps steps(n, mix, states, 1, ks, bench_config());
  std::vector<double> best(states.size(), std::numeric_limits<double>::infinity());
  std::int64_t t = 1;
  for (int it = 0; it < warmup + iterations; ++it, ++t)
    for (std::size_t k = 0; k < states.size(); ++k) {
      const double s = steps.step(k, t);
      if (it >= warmup) best[k] = std::min(best[k], s);
    }
  for (double& b : best) b = b * 1e9 / double(n);
  return best;
}

} // namespace

void add_project_command(CLI::App& app, project_options& o) {
  auto* cmd = app.add_subcommand(
      "project", "Project each moment format's step time and speedup over f32 at any memory bandwidth per core");
  cmd->add_option("--state", o.states, "Moment formats: f32, bf16, 8bit (f32 is always measured: the reference)")
      ->capture_default_str()->delimiter(',');
  cmd->add_option("-k,--kernel", o.kernels, "Kernels to project (default: the active one; see `hostopt-bench kernels`)")
      ->delimiter(',');
  cmd->add_option("--mix", o.mix, "Dtype mix GRAD:OUT")->capture_default_str();
  cmd->add_option("--bandwidth", o.bandwidths,
                  "Memory bandwidth per core, GB/s: 'measured' (this machine's, every core busy), 'loaded' (a loaded "
                  "server's, 4) or numbers")
      ->capture_default_str()->delimiter(',');
  cmd->add_option("--cache-size", o.cache_size, "Parameters of the in-cache measurement (its state must fit in L2)")
      ->capture_default_str();
  cmd->add_option("--stream-size", o.stream_size, "Parameters of the bandwidth measurement (far beyond the caches)")
      ->capture_default_str();
  cmd->add_option("-i,--iterations", o.iterations, "In-cache steps per format (the minimum is taken)")
      ->capture_default_str()->check(CLI::Range(1, 1000000));
  cmd->add_option("--validate", o.validate,
                  "Also measure the steps at this size (e.g. 256M) at 1 thread and every thread, against the projection "
                  "from the bandwidth measured there");
  cmd->add_option("--validate-iterations", o.validate_iterations, "Timed steps per format with --validate")
      ->capture_default_str()->check(CLI::Range(1, 1000));
}

report run_project_bench(const project_options& o, const common_options& c) {
  const dtype_mix mix = parse_mix(o.mix);
  std::vector<moment_format> states{moment_format::f32};
  for (const auto& s : o.states) {
    const moment_format f = hostopt::parse_moment_format(s);
    if (std::find(states.begin(), states.end(), f) == states.end()) states.push_back(f);
  }
  const std::vector<bandwidth_choice> bandwidths = parse_bandwidths(o.bandwidths);
  const std::size_t cache_n = parse_size(o.cache_size, "--cache-size");
  const std::size_t stream_n = parse_size(o.stream_size, "--stream-size");
  const std::size_t validate_n = o.validate.empty() ? 0 : parse_size(o.validate, "--validate");
  std::vector<const hostopt::detail::kernel_set*> kernel_sets;
  for (const auto& k : o.kernels.empty() ? std::vector<std::string>{""} : o.kernels) {
    const auto* ks = &hostopt::detail::kernel_set_by_name(k);
    if (std::find(kernel_sets.begin(), kernel_sets.end(), ks) == kernel_sets.end()) kernel_sets.push_back(ks);
  }
  const bool measure_stream = std::any_of(bandwidths.begin(), bandwidths.end(), [](auto& b) { return b.gbps < 0; });
  if (measure_stream)
    check_memory(std::size_t(state_steps::allocated_bytes(stream_n, mix, {moment_format::f32})),
                 "the bandwidth measurement (--stream-size " + o.stream_size + ")");
  if (validate_n)
    check_memory(std::size_t(state_steps::allocated_bytes(validate_n, mix, states)),
                 "the validation (--validate " + o.validate + ")");

  report r("project");
  add_machine_context(r);
  r.set_context("mix", mix.name());
  r.set_context("in-cache size", format_size(cache_n));
  const int all = hardware_threads();
  const std::vector<int> validate_threads = all > 1 ? std::vector<int>{1, all} : std::vector<int>{1};
  progress prog(kernel_sets.size() * (1 + validate_threads.size() * (validate_n ? 1 : 0)) + (measure_stream ? 1 : 0),
                c.progress);
  std::size_t done = 0;
  // This machine's bandwidth per core with every core busy: the f32 step's roofline twin
  // (its loads and stores, no arithmetic) on every thread, far beyond the caches.
  double measured_gbps = 0;
  if (measure_stream) {
    prog.update(done++, "bandwidth: " + format_size(stream_n) + " on " + std::to_string(all) + " threads");
    state_steps steps(stream_n, mix, {moment_format::f32}, all, hostopt::detail::active_kernel_set(), bench_config());
    std::vector<double> times;
    for (int it = 0; it < 6; ++it) {
      const double s = steps.roofline(0);
      if (it) times.push_back(s);
    }
    measured_gbps = double(stream_n) * bytes_per_param(mix) / summarize(times).median / 1e9 / all;
    r.set_context("measured GB/s per core (every core busy)", measured_gbps);
  }
  for (const auto* ks : kernel_sets) {
    prog.update(done++, std::string("in-cache costs, kernel ") + ks->name());
    const std::vector<double> cost = in_cache_costs(cache_n, mix, states, *ks, std::max(10, o.iterations / 10),
                                                    o.iterations);
    auto add_rows = [&](const std::string& where, double gbps, const std::vector<double>* measured_ns) {
      const double b32 = bytes_per_param(mix);
      const double f32_overlapped = overlapped_ns(cost[0], b32, gbps), f32_serial = serial_ns(cost[0], b32, gbps);
      auto gbps_or_any = [](double x) {
        return std::isinf(x) ? nlohmann::ordered_json("any") : nlohmann::ordered_json(x);
      };
      for (std::size_t k = 0; k < states.size(); ++k) {
        const double b = bytes_per_param(mix, states[k]);
        const double lo = overlapped_ns(cost[k], b, gbps), hi = serial_ns(cost[k], b, gbps);
        nlohmann::ordered_json row;
        row["kernel"] = ks->name();
        row["bandwidth"] = where;
        row["GB/s/core"] = gbps;
        row["state"] = std::string(hostopt::moment_format_name(states[k]));
        row["B/param"] = b;
        row["in_cache_ns"] = cost[k];
        row["ns_overlapped"] = lo;
        row["ns_serial"] = hi;
        row["speedup_overlapped"] = f32_overlapped / lo;
        row["speedup_serial"] = f32_serial / hi;
        row["faster_below_GB/s_serial"] = k == 0 ? nullptr : gbps_or_any(faster_below_serial(cost[k], b, cost[0], b32));
        row["faster_below_GB/s_overlapped"] = k == 0 ? nullptr : gbps_or_any(faster_below_overlapped(cost[k], cost[0], b32));
        if (measured_ns) {
          const double m = (*measured_ns)[k];
          row["measured_ns"] = m;
          row["measured_speedup"] = (*measured_ns)[0] / m;
          // Where the measurement lies: between the two projections, or how far outside.
          row["measured_vs_projected"] = m < lo   ? "-" + format_percent(1 - m / lo) + " below"
                                         : m > hi ? "+" + format_percent(m / hi - 1) + " above"
                                                  : std::string("between");
        } else {
          row["measured_ns"] = nullptr;
          row["measured_speedup"] = nullptr;
          row["measured_vs_projected"] = nullptr;
        }
        r.add_row(row);
      }
    };
    for (const bandwidth_choice& b : bandwidths) add_rows(b.name, b.gbps < 0 ? measured_gbps : b.gbps, nullptr);
    // Validation: the steps at validate_n on t threads, and the bandwidth per core measured
    // there by the roofline twin (interleaved with them), in the same units.
    for (int t : validate_n ? validate_threads : std::vector<int>{}) {
      prog.update(done++, "validation: " + format_size(validate_n) + " on " + std::to_string(t) + " thread(s)");
      state_steps steps(validate_n, mix, states, t, *ks, bench_config());
      std::vector<std::vector<double>> times(states.size());
      std::vector<double> roof;
      std::int64_t step = 1;
      for (int it = 0; it < 1 + o.validate_iterations; ++it, ++step) {
        for (std::size_t k = 0; k < states.size(); ++k) {
          const double s = steps.step(k, step);
          if (it) times[k].push_back(s);
        }
        const double s = steps.roofline(0, &hostopt::detail::active_kernel_set()); // the memory, whatever the kernel
        if (it) roof.push_back(s);
      }
      const double per_param = 1e9 * double(t) / double(validate_n); // seconds -> ns per parameter per core
      std::vector<double> measured;
      for (const auto& ts : times) measured.push_back(summarize(ts).median * per_param);
      const double gbps = bytes_per_param(mix) / (summarize(roof).median * per_param);
      add_rows(format_size(validate_n) + " on " + std::to_string(t) + " thread" + (t > 1 ? "s" : "") + ", measured",
               gbps, &measured);
    }
  }
  prog.finish();
  r.add_note("One core's time per parameter: its arithmetic, in_cache_ns (the step's minimum over " +
             std::to_string(o.iterations) + " steps of " + format_size(cache_n) + " parameters in L2 on one thread), "
             "and its bytes B/param (f32 master read and written, both moments read and written, gradient, copy-out) at "
             "its memory bandwidth GB/s/core, overlapped (the longer hides the other: max) or serial (their sum); a "
             "kernel's real step lies between, near overlapped when its loads run ahead of its arithmetic. speedup_*: "
             "the f32 state's time / the format's, both the same way. faster_below_GB/s_*: the bandwidth per core "
             "below which the format beats f32 ('any': it costs no more even in cache). 'loaded server': " +
             format_g(loaded_server_gbps) + " GB/s per core (docs/compressed-moments.md). "
             "Validation rows (--validate) time the steps at that size (medians), their GB/s/core the f32 roofline "
             "twin measured beside them; measured_vs_projected: between the two projections, or how far outside.");
  return r;
}

} // namespace bench
