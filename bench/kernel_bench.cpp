// `hostopt-bench kernel`: the optimizer step over one flat arena, interleaved with the
// roofline kernel (same loads and stores, no arithmetic) and optionally with the two-pass
// way (f32 step, then a separate cast pass), so machine noise hits all of them alike.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <optional>
#include <stdexcept>

#include "bench_common.hpp"
#include "state_steps.hpp"
#include "hostopt/kernels.hpp"
#include "kernel_registry.hpp"
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
  cmd->add_option("--state", o.states,
                  "Moment formats, timed interleaved: f32, bf16, 8bit (compressed rows report their speedup over "
                  "f32 when it is listed)")
      ->capture_default_str()->delimiter(',');
  cmd->add_option("--store", o.store, "A directory on a local drive: keep the state there (stored_optimizer) and "
                                     "time the streamed step against the drive's mixed bandwidth");
  cmd->add_option("--staging", o.staging, "With --store: RAM for staging buffers, suffixes K/M/G")->capture_default_str();
  cmd->add_option("--buffers", o.buffers, "With --store: staging buffers (chunks in flight: buffers - 2 read ahead, "
                                         "2 written back)")->capture_default_str()->check(CLI::Range(3u, 1024u));
  cmd->add_flag("--sync", o.store_sync, "With --store: make every step's commit durable (fdatasync)");
  cmd->add_option("--io", o.io, "With --store: auto, io_uring or threads")->capture_default_str();
  cmd->add_option("--baseline", o.baseline,
                  "Also time 'two-pass': the f32 step, then a separate cast pass to OUT (for mixes with a 16-bit OUT)")
      ->capture_default_str()->check(CLI::IsMember({"none", "two-pass"}));
}

namespace {

using hostopt::dtype;
using hostopt::moment_format;
using hostopt::detail::kernel_set;

} // namespace

report run_kernel_bench(const kernel_options& o, const common_options& c) {
  if (!o.store.empty()) return run_store_bench(o, c);
  std::vector<std::size_t> sizes;
  for (const auto& s : o.sizes) sizes.push_back(parse_size(s, "--size"));
  std::vector<dtype_mix> mixes;
  for (const auto& m : o.mixes) mixes.push_back(parse_mix(m));
  std::vector<moment_format> states;
  for (const auto& s : o.states) states.push_back(hostopt::parse_moment_format(s));
  if (states.empty()) throw std::invalid_argument("--state: expected at least one of f32, bf16, 8bit");
  const std::vector<int> threads = parse_threads(o.threads);
  const kernel_set& ks = hostopt::detail::kernel_set_by_name(o.kernel);
  const bool two_pass = o.baseline == "two-pass";
  auto has_two_pass = [two_pass](const dtype_mix& mix) {
    return two_pass && (mix.out == int(dtype::bf16) || mix.out == int(dtype::f16));
  };
  for (std::size_t n : sizes)
    for (const auto& mix : mixes) {
      double bytes = double(n) * (bytes_per_param(mix) + (has_two_pass(mix) ? 2 : 0));
      for (moment_format f : states)
        if (f != moment_format::f32) bytes += double(hostopt::moment_bytes(f, n));
      check_memory(std::size_t(bytes), "kernel benchmark of " + format_size(n) + " parameters (" + mix.name() + ")");
    }

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
          hostopt::adam_config cfg;
          cfg.mode = mode == "adam" ? hostopt::adam_mode::adam : hostopt::adam_mode::adamw;
          cfg.weight_decay = 0.01;
          state_steps steps(n, mix, states, t, ks, cfg, with_two_pass);
          // Per state: our step's times and its roofline twin's, interleaved state by state.
          std::vector<std::vector<double>> ours(states.size()), roofline(states.size());
          std::vector<double> twopass;
          std::int64_t step = 1;
          for (int it = 0; it < o.warmup + o.iterations; ++it) {
            for (std::size_t k = 0; k < states.size(); ++k) {
              const double ours_s = steps.step(k, step), roof_s = steps.roofline(k);
              if (it >= o.warmup) {
                ours[k].push_back(ours_s);
                roofline[k].push_back(roof_s);
              }
            }
            ++step;
            if (with_two_pass) {
              const double tp = steps.two_pass(step++);
              if (it >= o.warmup) twopass.push_back(tp);
            }
          }
          double f32_ms = -1;
          for (std::size_t k = 0; k < states.size(); ++k)
            if (states[k] == moment_format::f32) f32_ms = summarize(ours[k]).median * 1e3;
          for (std::size_t k = 0; k < states.size(); ++k) {
            const timing a = summarize(ours[k]), rf = summarize(roofline[k]);
            const double bytes = double(n) * bytes_per_param(mix, states[k]);
            nlohmann::ordered_json row;
            row["size"] = format_size(n);
            row["threads"] = t;
            row["mode"] = mode;
            row["grad"] = std::string(hostopt::dtype_name(dtype(mix.grad)));
            row["out"] = mix.out < 0 ? "none" : std::string(hostopt::dtype_name(dtype(mix.out)));
            row["state"] = std::string(hostopt::moment_format_name(states[k]));
            row["state_B/param"] = 4.0 + double(hostopt::moment_bytes(states[k], n)) / double(n);
            row["kernel"] = ks.name();
            row["ms"] = a.median * 1e3;
            row["ms_min"] = a.min * 1e3;
            row["Mparam/s"] = double(n) / a.median / 1e6;
            row["GB/s"] = bytes / a.median / 1e9;
            row["roofline_GB/s"] = bytes / rf.median / 1e9;
            row["%roofline"] = 100.0 * rf.median / a.median;
            if (states.size() > 1)
              row["speedup_vs_f32"] = f32_ms > 0 ? nlohmann::ordered_json(f32_ms / (a.median * 1e3)) : nullptr;
            if (two_pass) {
              const bool here = with_two_pass && states[k] == moment_format::f32;
              const timing tp = summarize(twopass);
              row["two_pass_ms"] = here ? nlohmann::ordered_json(tp.median * 1e3) : nullptr;
              row["fused_speedup"] = here ? nlohmann::ordered_json(tp.median / a.median) : nullptr;
            }
            r.add_row(row);
          }
        }
  prog.finish();
  r.add_note("GB/s counts the bytes each step must move: the master parameters read and written (8 B), both moments read "
             "and written (16 B in f32, 8 B in bf16, 4.125 B in 8bit with its block exponents), the gradient read and the "
             "copy-out written. %roofline = the state's roofline twin's time (same loads and stores, no arithmetic) / "
             "step time; speedup_vs_f32 = the f32-state step's time / this one's; medians of interleaved runs. "
             "state_B/param: bytes of optimizer state per parameter (f32 master included).");
  return r;
}

} // namespace bench
