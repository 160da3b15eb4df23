// `hostopt-bench kernel`: the optimizer step over one flat arena, interleaved with the
// roofline kernel (same loads and stores, no arithmetic) and optionally with the two-pass
// way (f32 step, then a separate cast pass), so machine noise hits all of them alike.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <optional>
#include <stdexcept>

#include "bench_common.hpp"
#include "hostopt/kernels.hpp"
#include "kernel_registry.hpp"
#include "parallel.hpp"
#include "subcommands.hpp"

namespace bench {

std::string dtype_mix::name() const {
  return std::string(hostopt::dtype_name(hostopt::dtype(grad))) + ":" +
         (out < 0 ? std::string("none") : std::string(hostopt::dtype_name(hostopt::dtype(out))));
}

dtype_mix parse_mix(const std::string& text) {
  const auto colon = text.find(':');
  const std::string expected = "expected GRAD:OUT like f32:none, bf16:bf16 or f16:f32 (GRAD in f32, bf16, f16; OUT "
                               "in none, f32, bf16, f16)";
  if (colon == std::string::npos) throw std::invalid_argument("dtype mix '" + text + "': " + expected);
  try {
    const int g = int(hostopt::parse_dtype(text.substr(0, colon)));
    const std::string out = text.substr(colon + 1);
    const int o = out == "none" ? -1 : int(hostopt::parse_dtype(out));
    return {g, o};
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("dtype mix '" + text + "': " + expected);
  }
}

void add_kernel_command(CLI::App& app, kernel_options& o) {
  auto* cmd = app.add_subcommand("kernel", "Time the fused step over a flat arena against the roofline kernel");
  cmd->add_option("-s,--size", o.sizes, "Parameter counts, suffixes K/M/G (2^10/2^20/2^30)")
      ->capture_default_str()->delimiter(',');
  cmd->add_option("-t,--threads", o.threads, "Thread counts: a list like 1,2,4, or 'all'")->capture_default_str();
  cmd->add_option("--mode", o.modes, "Update modes: adam, adamw")->capture_default_str()->delimiter(',')
      ->check(CLI::IsMember({"adam", "adamw"}));
  cmd->add_option("--mix", o.mixes, "Dtype mixes GRAD:OUT (GRAD f32/bf16/f16, OUT none/f32/bf16/f16)")
      ->capture_default_str()->delimiter(',');
  cmd->add_option("-i,--iterations", o.iterations, "Timed iterations per configuration")->capture_default_str()
      ->check(CLI::Range(1, 100000));
  cmd->add_option("-w,--warmup", o.warmup, "Untimed warm-up iterations")->capture_default_str()->check(CLI::Range(0, 1000));
  cmd->add_option("-k,--kernel", o.kernel, "Kernel to run (default: the active one; see `hostopt-bench kernels`)");
  cmd->add_option("--baseline", o.baseline,
                  "Also time 'two-pass': the f32 step, then a separate cast pass to OUT (for mixes with a 16-bit OUT)")
      ->capture_default_str()->check(CLI::IsMember({"none", "two-pass"}));
}

namespace {

using hostopt::dtype;
using hostopt::detail::kernel_set;

// Runs fn(lo, hi) over [0, n) with the library's partition on `threads` workers.
template <class F>
void parallel_over(std::size_t n, int threads, F&& fn) {
  auto body = [&](int tid, int nt) {
    const auto [lo, hi] = hostopt::detail::partition(0, n, tid, nt);
    if (lo < hi) fn(lo, hi);
  };
  hostopt::detail::run_parallel(threads, body);
}

struct arena_buffers {
  float_buffer p, m, v, grad, out, cast_out;
  arena_buffers(std::size_t n, const dtype_mix& mix, bool two_pass, int threads)
      : p(n, threads), m(n, threads), v(n, threads), grad(typed_buffer(n, dtype(mix.grad), threads)),
        out(mix.out < 0 ? float_buffer() : typed_buffer(n, dtype(mix.out), threads)),
        cast_out(two_pass ? typed_buffer(n, dtype(mix.out), threads) : float_buffer()) {
    fill_random(p.data, n, 1.0f, false, threads);
    fill_random(m.data, n, 0.01f, false, threads);
    fill_random(v.data, n, 1e-4f, true, threads);
    if (mix.grad == int(dtype::f32)) fill_random(grad.data, n, 0.01f, false, threads);
    else fill_random_half(reinterpret_cast<std::uint16_t*>(grad.data), n, dtype(mix.grad), threads);
  }
};

std::size_t bytes_per_param(const dtype_mix& mix) {
  return 24 + hostopt::dtype_size(dtype(mix.grad)) + (mix.out < 0 ? 0 : hostopt::dtype_size(dtype(mix.out)));
}

} // namespace

report run_kernel_bench(const kernel_options& o, const common_options& c) {
  std::vector<std::size_t> sizes;
  for (const auto& s : o.sizes) sizes.push_back(parse_size(s));
  std::vector<dtype_mix> mixes;
  for (const auto& m : o.mixes) mixes.push_back(parse_mix(m));
  const std::vector<int> threads = parse_threads(o.threads);
  const kernel_set& ks = hostopt::detail::kernel_set_by_name(o.kernel);
  const bool two_pass = o.baseline == "two-pass";
  auto has_two_pass = [two_pass](const dtype_mix& mix) {
    return two_pass && (mix.out == int(dtype::bf16) || mix.out == int(dtype::f16));
  };
  for (std::size_t n : sizes)
    for (const auto& mix : mixes)
      check_memory(n * (bytes_per_param(mix) + (has_two_pass(mix) ? 2 : 0)),
                   "kernel benchmark of " + format_size(n) + " parameters (" + mix.name() + ")");

  report r("kernel");
  add_machine_context(r);
  r.set_context("kernel", ks.name());
  r.set_context("iterations", o.iterations);
  const std::size_t total = sizes.size() * mixes.size() * o.modes.size() * threads.size();
  progress prog(total, c.progress);
  std::size_t done = 0;
  for (std::size_t n : sizes)
    for (const auto& mix : mixes)
      for (const auto& mode : o.modes)
        for (int t : threads) {
          prog.update(done++, "kernel " + format_size(n) + " " + mix.name() + " " + mode + " threads=" + std::to_string(t));
          const bool with_two_pass = has_two_pass(mix);
          arena_buffers b(n, mix, with_two_pass, t);
          hostopt::adam_config cfg;
          cfg.mode = mode == "adam" ? hostopt::adam_mode::adam : hostopt::adam_mode::adamw;
          cfg.weight_decay = 0.01;
          const hostopt::execution_options exec{t, ks.name()};
          const hostopt::const_view grad{b.grad.data, n, dtype(mix.grad)};
          const hostopt::mut_view out = mix.out < 0 ? hostopt::mut_view{} : hostopt::mut_view{b.out.data, n, dtype(mix.out)};
          const std::optional<dtype> out_type = mix.out < 0 ? std::nullopt : std::optional<dtype>(dtype(mix.out));
          const auto roof = ks.roofline(dtype(mix.grad), out_type);
          const std::size_t gsz = hostopt::dtype_size(dtype(mix.grad));
          const std::size_t osz = mix.out < 0 ? 0 : hostopt::dtype_size(dtype(mix.out));
          std::vector<double> ours, roofline, twopass;
          std::int64_t step = 1;
          for (int it = 0; it < o.warmup + o.iterations; ++it) {
            double t0 = now_seconds();
            hostopt::adam_step(b.p.data, b.m.data, b.v.data, n, grad, out, cfg, step++, 1.0f, exec);
            double t1 = now_seconds();
            parallel_over(n, t, [&](std::size_t lo, std::size_t hi) {
              roof(b.p.data + lo, b.m.data + lo, b.v.data + lo, reinterpret_cast<const char*>(b.grad.data) + lo * gsz,
                   osz ? reinterpret_cast<char*>(b.out.data) + lo * osz : nullptr, hi - lo);
            });
            double t2 = now_seconds();
            if (it >= o.warmup) {
              ours.push_back(t1 - t0);
              roofline.push_back(t2 - t1);
            }
            if (with_two_pass) {
              const double t3 = now_seconds();
              hostopt::adam_step(b.p.data, b.m.data, b.v.data, n, grad, {}, cfg, step++, 1.0f, exec);
              const auto cast = ks.cast(*out_type);
              parallel_over(n, t, [&](std::size_t lo, std::size_t hi) {
                cast(b.p.data + lo, reinterpret_cast<char*>(b.cast_out.data) + lo * osz, hi - lo);
              });
              if (it >= o.warmup) twopass.push_back(now_seconds() - t3);
            }
          }
          const timing a = summarize(ours), rf = summarize(roofline);
          const double bytes = double(n) * double(bytes_per_param(mix));
          nlohmann::ordered_json row;
          row["size"] = format_size(n);
          row["threads"] = t;
          row["mode"] = mode;
          row["grad"] = std::string(hostopt::dtype_name(dtype(mix.grad)));
          row["out"] = mix.out < 0 ? "none" : std::string(hostopt::dtype_name(dtype(mix.out)));
          row["kernel"] = ks.name();
          row["ms"] = a.median * 1e3;
          row["ms_min"] = a.min * 1e3;
          row["Mparam/s"] = double(n) / a.median / 1e6;
          row["GB/s"] = bytes / a.median / 1e9;
          row["roofline_GB/s"] = bytes / rf.median / 1e9;
          row["%roofline"] = 100.0 * rf.median / a.median;
          if (two_pass) {
            const timing tp = summarize(twopass);
            row["two_pass_ms"] = with_two_pass ? nlohmann::ordered_json(tp.median * 1e3) : nullptr;
            row["fused_speedup"] = with_two_pass ? nlohmann::ordered_json(tp.median / a.median) : nullptr;
          }
          r.add_row(row);
        }
  prog.finish();
  r.add_note("GB/s counts the bytes each step must move: params, exp_avg, exp_avg_sq read and written (24 B), the gradient "
             "read and the copy-out written. %roofline = roofline time / step time, both medians of interleaved runs.");
  return r;
}

} // namespace bench
