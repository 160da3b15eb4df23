// hostopt-gpu-bench: a trainer loop with real GPU work around the offload pipeline. Each
// step is --micro-batches micro-batches; each micro-batch's "forward + backward" is a run of
// cuBLAS SGEMMs on a compute stream followed by a kernel that reads the bf16 parameters and
// writes the f32 gradients. All micro-batches but the last go through accumulate_async, the
// last through step_async; gradient buffers alternate, and a micro-batch overwrites one
// only after the operation that read it last consumed it (grads_consumed). Sizing: a step's
// micro-batches together take --gpu-ratio times the CPU step (measured first with the
// synchronous optimizer step on the same arena), so one micro-batch takes gpu-ratio times
// the CPU time of its share of the chunks (chunks / micro-batches of them). Four modes:
//   none       GPU work only (the baseline: what a trainer with its optimizer on the GPU
//              would get if the update were free)
//   sync       offload, and the host waits for params_ready before the next forward
//   pipelined  offload, the compute stream waits for params_ready (cudaStreamWaitEvent);
//              the host never waits for the device
//   dpu        delayed parameter update: two parameter buffers, the forward of step k
//              reads the parameters of update k-2, so the update of step k-1 runs while
//              the GPU computes step k
// For each: step time, GPU busy fraction (events around each micro-batch's GPU work /
// wall), the pipeline's stage times and copy bandwidths (pipeline_timeline: an operation's
// wall runs from its first copy-in's start to its last copy-out's end), and a Chrome trace.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "gpu_trainer_kernels.hpp"
#include "hostopt/offload_pipeline.hpp"
#include "hostopt/optimizer.hpp"

namespace {

using namespace hostopt;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string("gpu bench: ") + what + " failed: " + cudaGetErrorName(rc) + ": " +
                             cudaGetErrorString(rc));
}

void check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("gpu bench: ") + what + " failed: cuBLAS status " +
                             std::to_string(int(st)));
}

std::size_t parse_count(const std::string& s) {
  std::size_t pos = 0;
  const double v = std::stod(s, &pos);
  std::size_t mult = 1;
  const std::string suffix = s.substr(pos);
  if (suffix == "K" || suffix == "k")
    mult = std::size_t(1) << 10;
  else if (suffix == "M" || suffix == "m")
    mult = std::size_t(1) << 20;
  else if (suffix == "G" || suffix == "g")
    mult = std::size_t(1) << 30;
  else if (!suffix.empty())
    throw std::invalid_argument("count '" + s + "': expected a number with K, M or G");
  if (v <= 0) throw std::invalid_argument("count '" + s + "': expected > 0");
  return std::size_t(v * double(mult));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct options {
  std::string size = "64M";
  std::string chunk = "4M";
  int depth = 2;
  int threads = 0; // 0: the optimizer's default (every core)
  int steps = 10;
  int warmup = 2;
  int gemm = 4096;
  double gpu_ratio = 1.25;
  int micro_batches = 2;
  std::vector<std::string> modes{"none", "sync", "pipelined", "dpu"};
  std::string trace_dir = ".";
  double max_seconds = 150;
};

struct device_memory {
  copy_engine& engine;
  void* p;
  device_memory(copy_engine& e, std::size_t bytes) : engine(e), p(e.allocate_device(bytes)) {}
  ~device_memory() { engine.free_device(p); }
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;
};

/// The stand-in for forward + backward: `count` SGEMMs of m x m, then the gradient kernel.
struct gpu_work {
  cublasHandle_t blas = nullptr;
  int m = 0, count = 1;
  float *a = nullptr, *b = nullptr, *c = nullptr;

  void gemms(device_stream s, int n) const {
    check(cublasSetStream(blas, static_cast<cudaStream_t>(s.handle)), "cublasSetStream");
    const float alpha = 1.0f, beta = 0.0f;
    for (int i = 0; i < n; ++i)
      check(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, &alpha, a, m, b, m, &beta, c, m),
            "cublasSgemm");
  }
  void forward_backward(device_stream s, const std::uint16_t* params, float* grads, std::size_t n,
                        int step) const {
    gemms(s, count);
    gpu_bench::launch_gradients(s.handle, params, grads, n, step);
  }
};

struct mode_result {
  std::string mode;
  int steps = 0;
  double step_ms = 0, gpu_busy = 0;
  int timelines = 0, step_timelines = 0;
  // Medians over the measured steps' timelines (the step operations, not the accumulations).
  double copy_in_ms = 0, update_ms = 0, copy_out_ms = 0, pipe_wall_ms = 0, slowest_ms = 0,
         wall_over_slowest = 0;
  int within_target = 0; // step operations whose wall <= 1.1 x their own slowest stage
  double accumulate_ms = 0, accumulate_wall_ms = 0; // medians over the accumulations' timelines
  double d2h_gbps = 0, h2d_gbps = 0;
  std::string trace;
};

struct bench_env {
  const options& o;
  copy_engine& engine;
  optimizer& opt;
  offload_pipeline& pipe;
  const gpu_work& work;
  std::size_t n;
  device_stream compute;
  std::uint16_t* params[2];
  float* grads[2];
  clock_type::time_point started;
};

/// One mode: warm-up steps, a drain, then the measured steps.
mode_result run_mode(bench_env& env, const std::string& mode) {
  const options& o = env.o;
  copy_engine& e = env.engine;
  const int total = o.warmup + o.steps, micro = o.micro_batches;
  // One pair of events around each micro-batch's GPU work.
  std::vector<device_event> start(std::size_t(total) * micro), end(std::size_t(total) * micro);
  for (std::size_t i = 0; i < start.size(); ++i) {
    start[i] = e.create_event();
    end[i] = e.create_event();
  }
  struct issued_op {
    int step;
    pipeline_handle handle;
  };
  std::deque<issued_op> in_flight;           // issue order
  std::vector<pipeline_handle> steps(total); // the step operation of each step
  pipeline_handle last_reader[2];            // the last operation that read each gradient buffer
  std::vector<pipeline_timeline> timelines;
  std::int64_t last_timeline_start = -1;
  bool measuring = false;
  // last_timeline() is the last completed operation's: read after each wait, it samples
  // the operations (one that completed while an older one was waited for is missed).
  auto collect = [&] {
    const pipeline_timeline tl = env.pipe.last_timeline();
    if (tl.start_ns == last_timeline_start || tl.spans.empty()) return;
    last_timeline_start = tl.start_ns;
    if (measuring) timelines.push_back(tl);
  };
  // Waits for every operation of steps <= `k`.
  auto wait_until = [&](int k) {
    while (!in_flight.empty() && in_flight.front().step <= k) {
      in_flight.front().handle.wait();
      in_flight.pop_front();
      collect();
    }
  };
  const bool dpu = mode == "dpu";
  if (mode != "none") {
    env.pipe.push_params({env.params[0], env.n, dtype::bf16});
    if (dpu) env.pipe.push_params({env.params[1], env.n, dtype::bf16});
  }

  auto step = [&](int k) {
    const int buf = dpu ? k % 2 : 0;
    if (mode == "sync" && k >= 1) {
      e.synchronize_event(steps[k - 1].params_ready()); // the host waits for the parameters
      wait_until(k - 1);
    } else if (mode == "pipelined" && k >= 1) {
      e.stream_wait_event(env.compute, steps[k - 1].params_ready());
      wait_until(k - 2); // the GPU waits for k-1 already; this only keeps the queue short
    } else if (dpu && k >= 2) {
      e.stream_wait_event(env.compute, steps[k - 2].params_ready());
      wait_until(k - 3);
    }
    for (int mb = 0; mb < micro; ++mb) {
      const std::size_t idx = std::size_t(k) * micro + mb;
      const int gbuf = int(idx % 2);
      if (last_reader[gbuf].grads_consumed())
        e.stream_wait_event(env.compute, last_reader[gbuf].grads_consumed());
      e.record_event(start[idx], env.compute);
      env.work.forward_backward(env.compute, env.params[buf], env.grads[gbuf], env.n, int(idx));
      e.record_event(end[idx], env.compute);
      if (mode == "none") continue;
      const const_view grads{env.grads[gbuf], env.n, dtype::f32};
      pipeline_handle h;
      if (mb + 1 < micro) {
        h = env.pipe.accumulate_async(grads, device_order::after(end[idx]));
      } else {
        h = env.pipe.step_async(grads, {env.params[buf], env.n, dtype::bf16}, device_order::after(end[idx]),
                                1.0f / float(micro));
        steps[k] = h;
      }
      last_reader[gbuf] = h;
      in_flight.push_back({k, h});
    }
  };
  auto drain = [&] {
    wait_until(total);
    e.synchronize_stream(env.compute);
  };

  for (int k = 0; k < o.warmup; ++k) step(k);
  drain();
  measuring = true;
  const auto t0 = clock_type::now();
  int done = o.warmup;
  for (; done < total; ++done) {
    step(done);
    if (seconds_since(env.started) > o.max_seconds) {
      ++done;
      break;
    }
  }
  drain();
  const double wall = seconds_since(t0);

  mode_result r;
  r.mode = mode;
  r.steps = done - o.warmup;
  r.step_ms = wall / r.steps * 1e3;
  double busy = 0;
  for (std::size_t i = std::size_t(o.warmup) * micro; i < std::size_t(done) * micro; ++i)
    busy += double(e.event_time_ns(end[i]) - e.event_time_ns(start[i])) * 1e-9;
  r.gpu_busy = busy / wall;
  r.timelines = int(timelines.size());
  std::vector<double> in, up, out, pw, slow, ratio, acc, acc_wall;
  for (const auto& tl : timelines) {
    const double d2h = tl.busy_seconds(pipeline_stage::copy_in),
                 h2d = tl.busy_seconds(pipeline_stage::copy_out);
    if (h2d <= 0) { // an accumulation: copy-in and the accumulate pass only
      acc.push_back(tl.busy_seconds(pipeline_stage::accumulate));
      acc_wall.push_back(tl.wall_seconds());
      continue;
    }
    const double update = tl.busy_seconds(pipeline_stage::update);
    const double slowest = std::max({d2h, update, h2d});
    in.push_back(d2h);
    up.push_back(update);
    out.push_back(h2d);
    pw.push_back(tl.wall_seconds()); // first copy-in start to last copy-out end
    slow.push_back(slowest);
    ratio.push_back(tl.wall_seconds() / slowest);
    r.within_target += tl.wall_seconds() <= 1.1 * slowest;
  }
  r.step_timelines = int(pw.size());
  r.copy_in_ms = median(in) * 1e3;
  r.update_ms = median(up) * 1e3;
  r.copy_out_ms = median(out) * 1e3;
  r.pipe_wall_ms = median(pw) * 1e3;
  r.slowest_ms = median(slow) * 1e3;
  r.wall_over_slowest = median(ratio);
  r.accumulate_ms = median(acc) * 1e3;
  r.accumulate_wall_ms = median(acc_wall) * 1e3;
  if (r.copy_in_ms > 0) r.d2h_gbps = double(env.n * 4) / (r.copy_in_ms * 1e-3) / 1e9;
  if (r.copy_out_ms > 0) r.h2d_gbps = double(env.n * 2) / (r.copy_out_ms * 1e-3) / 1e9;

  // The trace: every measured pipeline operation, and the compute stream's steps as a
  // second process, on one time axis.
  const std::size_t first = std::size_t(o.warmup) * micro, last = std::size_t(done) * micro;
  pipeline_timeline merged;
  merged.start_ns = e.event_time_ns(start[first]);
  merged.end_ns = e.event_time_ns(end[last - 1]);
  for (const auto& tl : timelines) {
    merged.spans.insert(merged.spans.end(), tl.spans.begin(), tl.spans.end());
    merged.start_ns = std::min(merged.start_ns, tl.start_ns);
    merged.end_ns = std::max(merged.end_ns, tl.end_ns);
  }
  std::string json = merged.chrome_trace_json();
  std::string gpu =
      ",{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":2,\"args\":{\"name\":\"GPU compute stream\"}}";
  char buf[256];
  for (std::size_t i = first; i < last; ++i) {
    const std::int64_t s = e.event_time_ns(start[i]), f = e.event_time_ns(end[i]);
    std::snprintf(buf, sizeof buf,
                  ",{\"name\":\"forward+backward %zu.%zu\",\"cat\":\"gpu\",\"ph\":\"X\",\"pid\":2,\"tid\":0,"
                  "\"ts\":%.3f,\"dur\":%.3f}",
                  i / std::size_t(micro), i % std::size_t(micro), double(s - merged.start_ns) * 1e-3,
                  double(f - s) * 1e-3);
    gpu += buf;
  }
  if (json.size() >= 3 && json.compare(json.size() - 2, 2, "]}") == 0 && json[json.size() - 3] != '[')
    json.insert(json.size() - 2, gpu);
  std::filesystem::create_directories(o.trace_dir);
  r.trace = (std::filesystem::path(o.trace_dir) / ("gpu_trainer_" + mode + ".json")).string();
  std::ofstream(r.trace) << json;

  for (std::size_t i = 0; i < start.size(); ++i) {
    e.destroy_event(start[i]);
    e.destroy_event(end[i]);
  }
  return r;
}

int run(const options& o) {
  const auto started = clock_type::now();
  if (!cuda_device_available()) {
    std::puts("hostopt-gpu-bench: no CUDA device");
    return 2;
  }
  const std::size_t n = parse_count(o.size), chunk = parse_count(o.chunk);
  check(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  auto engine = make_cuda_copy_engine(0);

  adam_config cfg;
  cfg.weight_decay = 0.01;
  optimizer opt({{cfg, {{"flat", {std::int64_t(n)}}}}}, {o.threads, ""});
  for (std::size_t i = 0; i < opt.arena_size(); ++i) opt.params()[i] = 0.01f * float(int(i % 201) - 100);

  // 1. The CPU step of the whole arena, synchronous, on host buffers (the best of 3).
  double cpu_s = 1e30;
  {
    std::vector<float> g(opt.arena_size(), 1e-3f);
    std::vector<std::uint16_t> out(opt.arena_size());
    for (int i = 0; i < 3; ++i) {
      const auto t = clock_type::now();
      opt.step(const_view{g.data(), g.size(), dtype::f32}, mut_view{out.data(), out.size(), dtype::bf16});
      cpu_s = std::min(cpu_s, seconds_since(t));
    }
  }

  // 2. GEMMs sized so that a step's micro-batches take gpu_ratio x the CPU step: one
  // micro-batch takes gpu_ratio x the CPU time of its share (1 / micro-batches) of the chunks.
  gpu_work work;
  work.m = o.gemm;
  const std::size_t mat = std::size_t(o.gemm) * std::size_t(o.gemm) * 4;
  device_memory a(*engine, mat), b(*engine, mat), c(*engine, mat);
  work.a = static_cast<float*>(a.p);
  work.b = static_cast<float*>(b.p);
  work.c = static_cast<float*>(c.p);
  check(cublasCreate(&work.blas), "cublasCreate");
  const device_stream compute = engine->create_stream();
  check(cudaMemsetAsync(a.p, 0x3c, mat, static_cast<cudaStream_t>(compute.handle)), "cudaMemsetAsync");
  check(cudaMemsetAsync(b.p, 0x3c, mat, static_cast<cudaStream_t>(compute.handle)), "cudaMemsetAsync");
  work.gemms(compute, 3); // warm-up (cuBLAS picks and loads its kernel)
  const device_event g0 = engine->create_event(), g1 = engine->create_event();
  engine->record_event(g0, compute);
  work.gemms(compute, 10);
  engine->record_event(g1, compute);
  engine->synchronize_event(g1);
  const double gemm_s = double(engine->event_time_ns(g1) - engine->event_time_ns(g0)) * 1e-9 / 10;
  const double micro_target_s = o.gpu_ratio * cpu_s / o.micro_batches;
  work.count = std::max(1, int(micro_target_s / gemm_s + 0.5));
  const double micro_s = work.count * gemm_s, step_gpu_s = micro_s * o.micro_batches;

  pipeline_options po;
  po.chunk_elems = chunk;
  po.depth = o.depth;
  po.grad_type = dtype::f32;
  po.param_type = dtype::bf16;
  offload_pipeline pipe(opt, *engine, po);
  device_memory p0(*engine, n * 2), p1(*engine, n * 2), gr0(*engine, n * 4), gr1(*engine, n * 4);

  std::printf("hostopt-gpu-bench on %s: %zu parameters (f32 gradients, bf16 parameters), %zu chunks of %zu, "
              "depth %d\n",
              prop.name, n, pipe.num_chunks(), chunk, o.depth);
  std::printf("  flag mechanism: %s\n", engine->flag_mechanism().c_str());
  std::printf("  CPU step (synchronous, whole arena): %.2f ms (%.3f ms per chunk)\n", cpu_s * 1e3,
              cpu_s * 1e3 / double(pipe.num_chunks()));
  std::printf(
      "  sizing: %d micro-batches per step (the first %d accumulated, the last stepped); one micro-batch\n"
      "    = gpu-ratio %.2f x the CPU time of its share of the chunks (CPU step / %d = %.2f ms) = %.2f ms,\n"
      "    so a step's GPU work is %.2f x its CPU step (the accumulate passes' CPU time not counted)\n",
      o.micro_batches, o.micro_batches - 1, o.gpu_ratio, o.micro_batches, cpu_s * 1e3 / o.micro_batches,
      micro_target_s * 1e3, o.gpu_ratio);
  std::printf("  SGEMM %dx%d: %.3f ms; %d per micro-batch: %.2f ms of GPU work; %.2f ms per step (%.2f x the "
              "CPU step)\n\n",
              o.gemm, o.gemm, gemm_s * 1e3, work.count, micro_s * 1e3, step_gpu_s * 1e3, step_gpu_s / cpu_s);

  bench_env env{o,
                *engine,
                opt,
                pipe,
                work,
                n,
                compute,
                {static_cast<std::uint16_t*>(p0.p), static_cast<std::uint16_t*>(p1.p)},
                {static_cast<float*>(gr0.p), static_cast<float*>(gr1.p)},
                started};
  std::vector<mode_result> results;
  for (const auto& mode : o.modes) {
    if (seconds_since(started) > o.max_seconds) {
      std::printf("  (time budget of %.0f s spent: mode %s skipped)\n", o.max_seconds, mode.c_str());
      continue;
    }
    results.push_back(run_mode(env, mode));
  }

  std::puts("(per step operation, medians: d2h/update/h2d are busy times, pipe_ms its wall from the first "
            "copy-in's start to the last copy-out's end; acc_ms the accumulate pass of an accumulation)");
  std::printf("%-10s %6s %9s %8s %9s %9s %9s %9s %8s %8s %10s %8s\n", "mode", "steps", "step_ms", "gpu_busy",
              "d2h_ms", "update_ms", "h2d_ms", "pipe_ms", "D2H_GB/s", "H2D_GB/s", "wall/slow", "acc_ms");
  for (const auto& r : results)
    std::printf("%-10s %6d %9.2f %7.1f%% %9.2f %9.2f %9.2f %9.2f %8.2f %8.2f %10.2f %8.2f\n", r.mode.c_str(),
                r.steps, r.step_ms, r.gpu_busy * 100, r.copy_in_ms, r.update_ms, r.copy_out_ms,
                r.pipe_wall_ms, r.d2h_gbps, r.h2d_gbps, r.wall_over_slowest, r.accumulate_ms);
  std::puts("\ntargets:");
  for (const auto& r : results) {
    if (r.mode == "pipelined") {
      if (r.step_timelines == 0) {
        std::puts("  pipelined: no step timeline was sampled: no target");
        continue;
      }
      // Per step operation: its wall (first copy-in start to last copy-out end) against its
      // own slowest stage; the medians of both, and of their ratio, are shown.
      std::printf(
          "  pipelined: step wall %.2f ms <= 1.1 x max(D2H %.2f, CPU update %.2f, H2D %.2f) = %.2f ms "
          "(medians; wall/slowest %.2f, %d of %d steps within): %s\n",
          r.pipe_wall_ms, r.copy_in_ms, r.update_ms, r.copy_out_ms, 1.1 * r.slowest_ms, r.wall_over_slowest,
          r.within_target, r.step_timelines, r.wall_over_slowest <= 1.1 ? "MET" : "MISSED");
    } else if (r.mode == "dpu") {
      if (cpu_s < step_gpu_s)
        std::printf(
            "  dpu: GPU busy %.1f%% >= 90%% (the CPU step %.2f ms is shorter than a step's GPU work %.2f "
            "ms): %s\n",
            r.gpu_busy * 100, cpu_s * 1e3, step_gpu_s * 1e3, r.gpu_busy >= 0.9 ? "MET" : "MISSED");
      else
        std::printf(
            "  dpu: GPU busy %.1f%%; no target (the CPU step %.2f ms is longer than a step's GPU work "
            "%.2f ms)\n",
            r.gpu_busy * 100, cpu_s * 1e3, step_gpu_s * 1e3);
    }
  }
  std::puts("\ntraces (chrome://tracing or ui.perfetto.dev):");
  for (const auto& r : results)
    std::printf("  %-10s %s (%d pipeline operations)\n", r.mode.c_str(), r.trace.c_str(), r.timelines);

  engine->destroy_event(g0);
  engine->destroy_event(g1);
  engine->synchronize_stream(compute);
  cublasDestroy(work.blas);
  engine->destroy_stream(compute);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  options o;
  CLI::App app{"hostopt-gpu-bench: a trainer loop with cuBLAS GEMMs on the GPU around the offload pipeline"};
  app.add_option("-s,--size", o.size, "Parameters in the arena, suffixes K/M/G")->capture_default_str();
  app.add_option("-c,--chunk", o.chunk, "Elements per pipeline chunk, suffixes K/M/G")->capture_default_str();
  app.add_option("-d,--depth", o.depth, "Pinned buffers per direction")
      ->capture_default_str()
      ->check(CLI::Range(2, 64));
  app.add_option("-t,--threads", o.threads, "Update threads (0: every core)")->capture_default_str();
  app.add_option("--steps", o.steps, "Measured steps per mode")
      ->capture_default_str()
      ->check(CLI::Range(1, 10000));
  app.add_option("--warmup", o.warmup, "Warm-up steps per mode")
      ->capture_default_str()
      ->check(CLI::Range(0, 100));
  app.add_option("--gemm", o.gemm, "SGEMM size m (m x m x m)")
      ->capture_default_str()
      ->check(CLI::Range(64, 16384));
  app.add_option("--gpu-ratio", o.gpu_ratio,
                 "GPU work of a step (all its micro-batches) over the CPU step: one micro-batch takes this "
                 "times the CPU time of its share of the chunks")
      ->capture_default_str();
  app.add_option(
         "--micro-batches", o.micro_batches,
         "Micro-batches per step: all but the last through accumulate_async, the last through step_async")
      ->capture_default_str()
      ->check(CLI::Range(1, 8));
  app.add_option("--modes", o.modes, "Modes to run: none, sync, pipelined, dpu")
      ->capture_default_str()
      ->delimiter(',')
      ->check(CLI::IsMember({"none", "sync", "pipelined", "dpu"}));
  app.add_option("--trace-dir", o.trace_dir, "Directory of the Chrome traces")->capture_default_str();
  app.add_option("--max-seconds", o.max_seconds, "Stop starting new steps after this long")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hostopt-gpu-bench: %s\n", e.what());
    return 1;
  }
}
