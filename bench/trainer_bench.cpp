// `hostopt-bench trainer`: what a GPU trainer's step would be with this machine's CPU
// stepping its optimizer. The trainer loop of examples/offload_trainer.cpp (synchronous or
// delayed parameter update, micro-batches accumulated on the host, two gradient buffers in
// turn) runs on the host engine with the device modelled: copies take a link's time and move
// nothing (a GPU's DMA costs no core), and each forward/backward takes 6 x parameters x
// tokens flops at the device rate the user names. The CPU update is real: this machine's
// cores, hostopt's kernels, the model's tensors. A projection, not a GPU measurement
// (hostopt-gpu-bench on a GPU is that); bench/simulated_trainer.sh runs the same loop through
// the CUDA engine on the test-only CUDA runtime double, and the two agree (docs/pipeline.md).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include "bench_common.hpp"
#include "hostopt/offload_pipeline.hpp"
#include "hostopt/optimizer.hpp"
#include "model_presets.hpp"
#include "subcommands.hpp"

namespace bench {

namespace {

struct link_model {
  std::string name;
  double gbps;
};

// Sustained host<->device rates per direction, not the links' signalling rates.
link_model parse_link(const std::string& text) {
  if (text == "pcie4") return {"PCIe 4 x16", 25};
  if (text == "pcie5") return {"PCIe 5 x16", 50};
  if (text == "nvlink-c2c") return {"NVLink-C2C", 450};
  char* end = nullptr;
  const double gbps = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !(gbps >= 0.1) || gbps > 1e5)
    throw std::invalid_argument("--link '" + text +
                                "': expected pcie4, pcie5, nvlink-c2c or GB/s per direction (0.1 to 100000)");
  return {text + " GB/s", gbps};
}

struct schedule {
  bool dpu = false;     // the forward of step k+1 reads step k-1's parameters
  bool overlap = false; // each chunk's gradients are ready as the backward produces them
};

schedule parse_mode(const std::string& text) {
  if (text == "sync") return {false, false};
  if (text == "dpu") return {true, false};
  if (text == "sync-overlap") return {false, true};
  if (text == "dpu-overlap") return {true, true};
  throw std::invalid_argument("--modes '" + text + "': expected sync, dpu, sync-overlap or dpu-overlap");
}

struct run_result {
  double step_ms = 0, busy = 0, update_ms = 0;
};

using steady = std::chrono::steady_clock;

// The modelled device: a forward/backward is stream work that takes its time (sleeping on
// the stream's thread, no core busy). With `chunk_events`, the backward is cut in one piece
// per chunk, each recording that chunk's event as it ends: gradients produced in arena order
// (a model whose tensors the arena lays out in backward order). Deadlines are absolute from
// the forward's start, so sleeping's overshoot does not add up over the pieces.
void modelled_forward_backward(hostopt::copy_engine& e, hostopt::device_stream s, double us,
                               const std::vector<hostopt::device_event>& chunk_events) {
  auto start = std::make_shared<steady::time_point>();
  const auto at = [start](double from_start_us) {
    return *start + std::chrono::nanoseconds(std::int64_t(from_start_us * 1e3));
  };
  if (chunk_events.empty()) {
    e.launch_host_function(s, [start, at, us] {
      *start = steady::now();
      std::this_thread::sleep_until(at(us));
    });
    return;
  }
  const double forward = us / 3, piece = (us - forward) / double(chunk_events.size());
  e.launch_host_function(s, [start, at, forward] {
    *start = steady::now();
    std::this_thread::sleep_until(at(forward));
  });
  for (std::size_t k = 0; k < chunk_events.size(); ++k) {
    const double end = forward + piece * double(k + 1);
    e.launch_host_function(s, [at, end] { std::this_thread::sleep_until(at(end)); });
    e.record_event(chunk_events[k], s);
  }
}

// One trainer run: `steps` steps of `micro` micro-batches, the loop of
// examples/offload_trainer.cpp with a modelled forward/backward of `us` microseconds.
run_result run_trainer(hostopt::copy_engine& engine, hostopt::offload_pipeline& pipe, std::size_t n,
                       hostopt::dtype grad_type, hostopt::dtype param_type, void* const grad_buffers[2],
                       void* const param_buffers[2], schedule mode, int steps, int micro, double us) {
  const hostopt::device_stream compute = engine.create_stream();
  for (int b = 0; b < 2; ++b) pipe.push_params({param_buffers[b], n, param_type});
  std::vector<hostopt::device_event> chunk_events;
  if (mode.overlap)
    for (std::size_t k = 0; k < pipe.num_chunks(); ++k) chunk_events.push_back(engine.create_event());
  hostopt::device_order after_compute = hostopt::device_order::after(compute);
  after_compute.chunk_grads_ready = chunk_events;
  std::vector<hostopt::device_event> spans(2 * std::size_t(steps) * micro);
  for (auto& e : spans) e = engine.create_event();
  hostopt::pipeline_handle previous, before_previous, last_reader[2];
  for (int step = 0; step < steps; ++step) {
    const int buf = mode.dpu ? step % 2 : 0;
    const hostopt::pipeline_handle& producer = mode.dpu ? before_previous : previous;
    if (producer.params_ready()) engine.stream_wait_event(compute, producer.params_ready());
    for (int mb = 0; mb < micro; ++mb) {
      const int g = (step * micro + mb) % 2;
      if (last_reader[g].grads_consumed()) engine.stream_wait_event(compute, last_reader[g].grads_consumed());
      const std::size_t span = 2 * (std::size_t(step) * micro + mb);
      engine.record_event(spans[span], compute);
      modelled_forward_backward(engine, compute, us, chunk_events);
      engine.record_event(spans[span + 1], compute);
      const hostopt::const_view grads{grad_buffers[g], n, grad_type};
      if (mb + 1 < micro) last_reader[g] = pipe.accumulate_async(grads, after_compute);
      else
        last_reader[g] = pipe.step_async(grads, {param_buffers[buf], n, param_type}, after_compute, 1.0f / float(micro));
    }
    before_previous = previous;
    previous = last_reader[(step * micro + micro - 1) % 2];
  }
  previous.wait();
  engine.synchronize_stream(compute);
  // Steady state, as the example: from the first forward of step 2 to the first forward of
  // the last step (whose update nothing follows).
  const auto t = [&](hostopt::device_event e) { return double(engine.event_time_ns(e)) * 1e-6; };
  const int warm = 2;
  const std::size_t first = 2 * std::size_t(warm) * micro, last = 2 * std::size_t(steps - 1) * micro;
  double busy = 0;
  for (std::size_t i = first; i < last; i += 2) busy += t(spans[i + 1]) - t(spans[i]);
  const hostopt::pipeline_timeline tl = pipe.last_timeline();
  run_result r;
  r.step_ms = (t(spans[last]) - t(spans[first])) / (steps - 1 - warm);
  r.busy = busy / (t(spans[last]) - t(spans[first]));
  r.update_ms = tl.busy_seconds(hostopt::pipeline_stage::update) * 1e3;
  for (auto e : spans) engine.destroy_event(e);
  for (auto e : chunk_events) engine.destroy_event(e);
  engine.destroy_stream(compute);
  return r;
}

} // namespace

void add_trainer_command(CLI::App& app, trainer_options& o) {
  auto* cmd = app.add_subcommand(
      "trainer", "Project a GPU trainer's step, device busy share and CPU update time: this machine's CPU update, a "
                 "modelled device and link (no GPU needed)");
  cmd->add_option("-p,--preset", o.preset, "Model: gpt2-small, gpt2-medium, llama-7b")->capture_default_str();
  cmd->add_option("-n,--params", o.params, "A flat model of this many parameters instead of a preset (K/M/G)");
  cmd->add_option("--max-params", o.max_params, "Refuse a preset with more parameters than this")->capture_default_str();
  cmd->add_option("--tokens", o.tokens, "Tokens per micro-batch, one row each (K/M/G)")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("-m,--micro", o.micro, "Micro-batches per step (gradients accumulated on the host)")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  cmd->add_option("--tflops", o.tflops, "The device's achieved rate in TFLOPS (forward+backward = 6 x params x tokens flops)")
      ->capture_default_str()->check(CLI::Range(1e-3, 1e6));
  cmd->add_option("--link", o.links, "Links, one row each: pcie4 (25 GB/s), pcie5 (50), nvlink-c2c (450) or GB/s per direction")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("--modes", o.modes, "Schedules: sync, dpu (delayed parameter update), sync-overlap, dpu-overlap (chunks' "
                                      "gradients copied in as the backward produces them)")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("-t,--threads", o.threads, "Update threads: a list like 1,2, or 'all' (default: every hardware thread)");
  cmd->add_option("--state", o.state, "Moment format: f32, bf16, 8bit")->capture_default_str();
  cmd->add_option("--mix", o.mix, "Dtype mix GRAD:OUT of the device's gradients and parameters")->capture_default_str();
  cmd->add_option("-c,--chunk", o.chunk, "Pipeline chunk, elements (K/M/G)")->capture_default_str();
  cmd->add_option("-s,--steps", o.steps, "Steps per run; the first two are warm-up, the last's update is left out")
      ->capture_default_str()->check(CLI::Range(4, 1000));
}

report run_trainer_bench(const trainer_options& o, const common_options& c) {
  const std::size_t max_params = parse_size(o.max_params, "--max-params");
  const auto tensors = o.params.empty() ? preset_tensors_within(o.preset, o.max_params, max_params)
                                        : std::vector<hostopt::tensor_spec>{{"flat", {std::int64_t(parse_size(o.params, "--params"))}}};
  std::vector<std::size_t> tokens;
  for (const auto& t : o.tokens) tokens.push_back(parse_size(t, "--tokens"));
  if (tokens.empty()) throw std::invalid_argument("--tokens: expected at least one count");
  std::vector<link_model> links;
  for (const auto& l : o.links) links.push_back(parse_link(l));
  if (links.empty()) throw std::invalid_argument("--link: expected at least one link");
  std::vector<std::pair<std::string, schedule>> modes;
  for (const auto& m : o.modes) modes.push_back({m, parse_mode(m)});
  if (modes.empty()) throw std::invalid_argument("--modes: expected at least one schedule");
  const std::vector<int> threads = o.threads.empty() ? std::vector<int>{hardware_threads()} : parse_threads(o.threads);
  const hostopt::moment_format state = hostopt::parse_moment_format(o.state);
  const dtype_mix mix = parse_mix(o.mix);
  if (mix.out < 0) throw std::invalid_argument("dtype mix '" + o.mix + "': the trainer copies parameters out, so OUT cannot be none");
  const std::size_t chunk = parse_size(o.chunk, "--chunk");
  const std::size_t n_params = count_params(tensors);
  const auto gt = hostopt::dtype(mix.grad), pt = hostopt::dtype(mix.out);
  const auto device_us = [&](std::size_t tok) { return 6.0 * double(n_params) * double(tok) / (o.tflops * 1e12) * 1e6; };
  // The runs sleep through the modelled time: refuse one that would take hours (or
  // overflow a clock) before anything is allocated.
  double modelled_s = 0;
  for (const link_model& link : links)
    for (std::size_t tok : tokens) {
      const double copies_s = double(n_params) * double(o.micro * hostopt::dtype_size(gt) + hostopt::dtype_size(pt)) /
                              (link.gbps * 1e9);
      modelled_s += double(modes.size() * threads.size()) * o.steps * (o.micro * device_us(tok) * 1e-6 + copies_s);
    }
  if (!(modelled_s <= 3600)) {
    char text[64];
    std::snprintf(text, sizeof text, "%.3g hours", modelled_s / 3600);
    throw std::invalid_argument(std::string("the runs asked for would take ") + text +
                                " of modelled device and link time (more than an hour): fewer or smaller --tokens, "
                                "fewer --steps, --micro or --modes, a faster --tflops or --link");
  }
  // Master weights and moments (f32 at most), the accumulator, the pinned rings (a chunk is
  // at most the model). The "device" buffers are never touched: copies move nothing.
  check_memory(n_params * 16 + 8 * std::min(chunk, n_params) * (hostopt::dtype_size(gt) + 4),
               "trainer projection of " + format_size(n_params) + " parameters");

  report r("trainer");
  add_machine_context(r);
  r.set_context("model", o.params.empty() ? o.preset : "flat " + o.params);
  r.set_context("parameters", n_params);
  r.set_context("micro_batches", o.micro);
  r.set_context("device_TFLOPS", o.tflops);
  r.set_context("state", std::string(hostopt::moment_format_name(state)));
  r.set_context("mix", mix.name());
  r.set_context("kernel", hostopt::active_kernel());
  progress prog(threads.size() * links.size() * tokens.size() * modes.size(), c.progress);
  std::size_t done = 0;
  hostopt::adam_config cfg;
  cfg.weight_decay = 0.01;
  for (int th : threads) {
    hostopt::optimizer opt({{cfg, tensors, state}}, {th, ""});
    fill_random(opt.params().data(), opt.arena_size(), 1.0f, false, th);
    const std::size_t n = opt.arena_size();
    for (const link_model& link : links) {
      hostopt::host_engine_options eo;
      eo.bandwidth_gbps = link.gbps;
      eo.move_bytes = false;
      auto engine = hostopt::make_host_copy_engine(eo);
      hostopt::pipeline_options po;
      po.chunk_elems = chunk;
      po.grad_type = gt;
      po.param_type = pt;
      hostopt::offload_pipeline pipe(opt, *engine, po);
      struct device_buffers {
        hostopt::copy_engine& e;
        void* grads[2];
        void* params[2];
        ~device_buffers() {
          for (void* p : grads) e.free_device(p);
          for (void* p : params) e.free_device(p);
        }
      } dev{*engine, {}, {}};
      for (int b = 0; b < 2; ++b) {
        dev.grads[b] = engine->allocate_device(n * hostopt::dtype_size(gt));
        dev.params[b] = engine->allocate_device(n * hostopt::dtype_size(pt));
      }
      for (std::size_t tok : tokens)
        for (const auto& [mode_name, mode] : modes) {
          prog.update(done++, "trainer " + link.name + " tokens=" + std::to_string(tok) + " " + mode_name);
          const double us = device_us(tok);
          const run_result res = run_trainer(*engine, pipe, n, gt, pt, dev.grads, dev.params, mode, o.steps, o.micro, us);
          nlohmann::ordered_json row;
          row["link"] = link.name;
          row["tokens/micro"] = tok;
          row["mode"] = mode_name;
          row["threads"] = th;
          row["device_ms"] = us * o.micro / 1e3;
          row["step_ms"] = res.step_ms;
          row["device_busy_%"] = 100 * res.busy;
          row["update_ms"] = res.update_ms;
          row["update_%step"] = 100 * res.update_ms / res.step_ms;
          row["Ktokens/s"] = double(tok) * o.micro / res.step_ms;
          r.add_row(row);
        }
    }
  }
  prog.finish();
  r.add_note("A projection: the CPU update is measured (this machine, hostopt's kernels), the device is modelled: each "
             "forward+backward takes 6 x parameters x tokens / --tflops (device_ms: per step; attention's flops are not "
             "counted, ~15% more for gpt2-small at 1024 tokens of context), copies take bytes / link rate, one at a time "
             "per direction, and move nothing (their memory traffic is not charged to the update). Every micro-batch's "
             "gradients go to the host (accumulated there), as the example trainer does.");
  r.add_note("device_busy_% is measured from the modelled work's own timing (sleeps on the engine's threads): where a "
             "micro-batch's device time is under ~1 ms, their wake-up latency inflates it.");
  r.add_note("step_ms and device_busy_% over the steady state (steps 2..N-2); update_ms: the last step's CPU "
             "update (summed over its chunks; the accumulation passes not included). DPU: the forward reads parameters "
             "one step old, so the update hides behind the next step's device work.");
  r.add_note("-overlap: each chunk's gradients are copied in (and updated) as soon as the backward has produced them, as "
             "backward hooks recording the pipeline's chunk_grads_ready events would.");
  return r;
}

} // namespace bench
