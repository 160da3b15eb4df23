// `hostopt-bench model`: the optimizer's step over a realistic tensor list (hundreds of
// tensors), interleaved with the same parameter count as one flat tensor.
#include <CLI/CLI.hpp>


#include "bench_common.hpp"
#include "hostopt/optimizer.hpp"
#include "model_presets.hpp"
#include "subcommands.hpp"

namespace bench {

void add_model_command(CLI::App& app, model_options& o) {
  auto* cmd = app.add_subcommand("model", "Time the step over a model's tensor list against one flat tensor");
  cmd->add_option("-p,--preset", o.preset, "Tensor list: gpt2-small, gpt2-medium, llama-7b")->capture_default_str();
  cmd->add_option("-f,--shapes", o.shapes_file, "File of lines 'name d0 d1 ...' (instead of a preset)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--max-params", o.max_params,
                  "Refuse a preset with more parameters than this (presets are never cut: the message says what to pass)")
      ->capture_default_str();
  cmd->add_option("-t,--threads", o.threads, "Thread counts: a list like 1,2,4, or 'all'")->capture_default_str();
  cmd->add_option("--mix", o.mix, "Dtype mix GRAD:OUT")->capture_default_str();
  cmd->add_option("--state", o.states,
                  "Moment formats, one row each: a list of f32, bf16, 8bit (every tensor in that format)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--drive-gbps", o.drive_gbps,
                  "Project the state on a drive (StoredOptimizer) with this mixed bandwidth in GB/s "
                  "(`hostopt-bench disk` measures it): its bytes and its step's I/O time")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--gpu-step-ms", o.gpu_step_ms,
                  "With --drive-gbps: whether the drive keeps up with a GPU step of this many ms")
      ->check(CLI::PositiveNumber);
  cmd->add_option("-i,--iterations", o.iterations, "Timed iterations")->capture_default_str()->check(CLI::Range(1, 100000));
  cmd->add_option("-w,--warmup", o.warmup, "Untimed warm-up iterations")->capture_default_str()->check(CLI::Range(0, 1000));
}

report run_model_bench(const model_options& o, const common_options& c) {
  const std::size_t max_params = parse_size(o.max_params, "--max-params");
  const auto tensors = o.shapes_file.empty() ? preset_tensors_within(o.preset, o.max_params, max_params)
                                             : read_shapes_file(o.shapes_file);
  const dtype_mix mix = parse_mix(o.mix);
  const std::vector<int> threads = parse_threads(o.threads);
  std::vector<hostopt::moment_format> states;
  for (const auto& s : o.states) states.push_back(hostopt::parse_moment_format(s));
  if (states.empty()) throw std::invalid_argument("--state: expected at least one of f32, bf16, 8bit");
  if (o.gpu_step_ms > 0 && !(o.drive_gbps > 0))
    throw std::invalid_argument("--gpu-step-ms needs --drive-gbps (the drive's mixed bandwidth)");
  const std::size_t n = count_params(tensors);
  const std::size_t per_param = 12 + hostopt::dtype_size(hostopt::dtype(mix.grad)) +
                                (mix.out < 0 ? 0 : hostopt::dtype_size(hostopt::dtype(mix.out)));
  // Two optimizers (model and flat) with their gradient and copy-out buffers, plus padding.
  check_memory(2 * (n + 16 * tensors.size()) * per_param, "model benchmark of " + format_size(n) + " parameters");

  report r("model");
  add_machine_context(r);
  r.set_context("model", o.shapes_file.empty() ? o.preset : o.shapes_file);
  r.set_context("tensors", tensors.size());
  r.set_context("parameters", n);
  r.set_context("kernel", hostopt::active_kernel());
  progress prog(threads.size() * states.size(), c.progress);
  std::size_t done = 0;
  hostopt::adam_config cfg;
  cfg.weight_decay = 0.01;
  for (int t : threads)
  for (const hostopt::moment_format state : states) {
    const std::string state_name(hostopt::moment_format_name(state));
    prog.update(done++, "model threads=" + std::to_string(t) + " state=" + state_name);
    hostopt::optimizer model({{cfg, tensors, state}}, {t, ""});
    hostopt::optimizer flat({{cfg, {{"flat", {std::int64_t(n)}}}, state}}, {t, ""});
    const hostopt::dtype gt = hostopt::dtype(mix.grad);
    float_buffer grad = typed_buffer(model.arena_size(), gt, t);
    float_buffer out = mix.out < 0 ? float_buffer() : typed_buffer(model.arena_size(), hostopt::dtype(mix.out), t);
    if (gt == hostopt::dtype::f32) fill_random(grad.data, model.arena_size(), 0.01f, false, t);
    else fill_random_half(reinterpret_cast<std::uint16_t*>(grad.data), model.arena_size(), gt, t);
    fill_random(model.params().data(), model.arena_size(), 1.0f, false, t);
    fill_random(flat.params().data(), flat.arena_size(), 1.0f, false, t);
    // Per-tensor views, as a framework hands over its tensors' gradients.
    std::vector<hostopt::const_view> grads;
    std::vector<hostopt::mut_view> outs;
    const std::size_t gsz = hostopt::dtype_size(gt);
    const std::size_t osz = mix.out < 0 ? 0 : hostopt::dtype_size(hostopt::dtype(mix.out));
    for (const auto& s : model.segments()) {
      grads.push_back({reinterpret_cast<const char*>(grad.data) + s.offset * gsz, s.size, gt});
      if (osz) outs.push_back({reinterpret_cast<char*>(out.data) + s.offset * osz, s.size, hostopt::dtype(mix.out)});
    }
    const hostopt::const_view flat_grad{grad.data, flat.arena_size(), gt};
    const hostopt::mut_view flat_out = osz ? hostopt::mut_view{out.data, flat.arena_size(), hostopt::dtype(mix.out)}
                                           : hostopt::mut_view{};
    std::vector<double> tm, tf;
    for (int it = 0; it < o.warmup + o.iterations; ++it) {
      const double t0 = now_seconds();
      model.step(grads, outs);
      const double t1 = now_seconds();
      flat.step(flat_grad, flat_out);
      const double t2 = now_seconds();
      if (it >= o.warmup) {
        tm.push_back(t1 - t0);
        tf.push_back(t2 - t1);
      }
    }
    const timing a = summarize(tm), b = summarize(tf);
    nlohmann::ordered_json row;
    row["model"] = o.shapes_file.empty() ? o.preset : "file";
    row["tensors"] = tensors.size();
    row["params"] = n;
    row["threads"] = t;
    row["mix"] = mix.name();
    row["state"] = state_name;
    // Memory of the state, from the optimizer's own layout (alignment padding included).
    row["state_MiB"] = double(model.state_bytes()) / (1 << 20);
    row["state_B/param"] = double(model.state_bytes()) / double(n);
    row["ms"] = a.median * 1e3;
    row["flat_ms"] = b.median * 1e3;
    row["Mparam/s"] = double(n) / a.median / 1e6;
    row["flat_Mparam/s"] = double(n) / b.median / 1e6;
    row["%flat"] = 100.0 * b.median / a.median;
    if (o.drive_gbps > 0) { // the state on a drive: two slots of it there, all of it read and written per step
      const double io = 2.0 * double(model.state_bytes());
      row["drive_B/param"] = io / double(n);
      row["drive_step_ms"] = io / (o.drive_gbps * 1e9) * 1e3;
      if (o.gpu_step_ms > 0) row["drive_keeps_up"] = io / (o.drive_gbps * 1e9) * 1e3 <= o.gpu_step_ms ? "yes" : "no";
    }
    r.add_row(row);
  }
  prog.finish();
  r.add_note("%flat = flat-tensor time / model time (medians of interleaved runs): the cost of many tensors.");
  if (o.drive_gbps > 0)
    r.add_note("With the state on a drive (StoredOptimizer): drive_B/param = its bytes there (two slots of the state), "
               "which is also what each step reads plus writes; drive_step_ms = those bytes at --drive-gbps, the "
               "roofline of its streamed step (measured at 0.83-1.18x of it: docs/drive.md); RAM = the staging budget "
               "(default 256 MB) plus the copy-out, whatever the model." +
               std::string(o.gpu_step_ms > 0 ? " drive_keeps_up: whether that time fits in the GPU step given, as it "
                                               "must for the step to hide behind the GPU's next one (a delayed "
                                               "update); the stored step does not yet overlap a GPU's (issue 35)."
                                             : ""));
  r.add_note("state_B/param = the optimizer's bytes (f32 master + moments in the row's format, block exponents and "
             "alignment padding included) / parameters.");
  return r;
}

} // namespace bench
