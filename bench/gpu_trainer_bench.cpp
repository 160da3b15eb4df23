// hostopt-gpu-bench: a trainer loop with real GPU work around the offload pipeline. Each
// step's "forward + backward" is a run of cuBLAS SGEMMs on a compute stream followed by a
// kernel that reads the bf16 parameters and writes the f32 gradients; the GEMM count is
// chosen so that this takes --gpu-ratio times the CPU step, measured first with the
// synchronous optimizer step on the same arena. Four modes:
//   none       GPU work only (the baseline: what a trainer with its optimizer on the GPU
//              would get if the update were free)
//   sync       offload, and the host waits for params_ready before the next forward
//   pipelined  offload, the compute stream waits for params_ready (cudaStreamWaitEvent);
//              the host never waits for the device
//   dpu        delayed parameter update: two parameter and two gradient buffers, the
//              forward of step k reads the parameters of update k-2, so the update of step
//              k-1 runs while the GPU computes step k
// For each: step time, GPU busy fraction (events around each step's GPU work / wall), the
// pipeline's stage times and copy bandwidths (pipeline_timeline), and a Chrome trace.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
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
  int timelines = 0;
  double copy_in_ms = 0, update_ms = 0, copy_out_ms = 0, pipe_wall_ms = 0, wall_over_slowest = 0;
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
  const int total = o.warmup + o.steps;
  std::vector<device_event> start(total), end(total);
  for (int k = 0; k < total; ++k) {
    start[k] = e.create_event();
    end[k] = e.create_event();
  }
  std::vector<pipeline_handle> handles(total);
  std::vector<bool> issued(total, false);
  std::vector<pipeline_timeline> timelines;
  std::int64_t last_timeline_start = -1;
  bool measuring = false;
  auto collect = [&] {
    const pipeline_timeline tl = env.pipe.last_timeline();
    if (tl.start_ns == last_timeline_start || tl.spans.empty()) return;
    last_timeline_start = tl.start_ns;
    if (measuring) timelines.push_back(tl);
  };
  auto wait_handle = [&](int k) {
    if (k >= 0 && k < total && issued[k]) {
      issued[k] = false;
      handles[k].wait();
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
      e.synchronize_event(handles[k - 1].params_ready()); // the host waits for the parameters
      wait_handle(k - 1);
    } else if (mode == "pipelined" && k >= 1) {
      e.stream_wait_event(env.compute, handles[k - 1].params_ready());
      e.stream_wait_event(env.compute, handles[k - 1].grads_consumed());
      wait_handle(k - 2); // the GPU waits for k-1 already; this only keeps the queue short
    } else if (dpu && k >= 2) {
      e.stream_wait_event(env.compute, handles[k - 2].params_ready());
      e.stream_wait_event(env.compute, handles[k - 2].grads_consumed());
      wait_handle(k - 3);
    }
    e.record_event(start[k], env.compute);
    env.work.forward_backward(env.compute, env.params[buf], env.grads[buf], env.n, k);
    e.record_event(end[k], env.compute);
    if (mode != "none") {
      handles[k] = env.pipe.step_async({env.grads[buf], env.n, dtype::f32},
                                       {env.params[buf], env.n, dtype::bf16}, device_order::after(end[k]));
      issued[k] = true;
    }
  };
  auto drain = [&](int upto) {
    for (int k = 0; k < upto; ++k) wait_handle(k);
    e.synchronize_stream(env.compute);
  };

  for (int k = 0; k < o.warmup; ++k) step(k);
  drain(o.warmup);
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
  drain(done);
  const double wall = seconds_since(t0);

  mode_result r;
  r.mode = mode;
  r.steps = done - o.warmup;
  r.step_ms = wall / r.steps * 1e3;
  double busy = 0;
  for (int k = o.warmup; k < done; ++k)
    busy += double(e.event_time_ns(end[k]) - e.event_time_ns(start[k])) * 1e-9;
  r.gpu_busy = busy / wall;
  r.timelines = int(timelines.size());
  std::vector<double> in, up, out, pw, ratio;
  for (const auto& tl : timelines) {
    in.push_back(tl.busy_seconds(pipeline_stage::copy_in));
    up.push_back(tl.busy_seconds(pipeline_stage::update));
    out.push_back(tl.busy_seconds(pipeline_stage::copy_out));
    pw.push_back(tl.wall_seconds());
    ratio.push_back(tl.wall_over_slowest_stage());
  }
  r.copy_in_ms = median(in) * 1e3;
  r.update_ms = median(up) * 1e3;
  r.copy_out_ms = median(out) * 1e3;
  r.pipe_wall_ms = median(pw) * 1e3;
  r.wall_over_slowest = median(ratio);
  if (r.copy_in_ms > 0) r.d2h_gbps = double(env.n * 4) / (r.copy_in_ms * 1e-3) / 1e9;
  if (r.copy_out_ms > 0) r.h2d_gbps = double(env.n * 2) / (r.copy_out_ms * 1e-3) / 1e9;

  // The trace: every measured pipeline operation, and the compute stream's steps as a
  // second process, on one time axis.
  pipeline_timeline merged;
  merged.start_ns = e.event_time_ns(start[o.warmup]);
  merged.end_ns = e.event_time_ns(end[done - 1]);
  for (const auto& tl : timelines) {
    merged.spans.insert(merged.spans.end(), tl.spans.begin(), tl.spans.end());
    merged.start_ns = std::min(merged.start_ns, tl.start_ns);
    merged.end_ns = std::max(merged.end_ns, tl.end_ns);
  }
  std::string json = merged.chrome_trace_json();
  std::string gpu =
      ",{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":2,\"args\":{\"name\":\"GPU compute stream\"}}";
  char buf[256];
  for (int k = o.warmup; k < done; ++k) {
    const std::int64_t s = e.event_time_ns(start[k]), f = e.event_time_ns(end[k]);
    std::snprintf(
        buf, sizeof buf,
        ",{\"name\":\"forward+backward %d\",\"cat\":\"gpu\",\"ph\":\"X\",\"pid\":2,\"tid\":0,\"ts\":%.3f,"
        "\"dur\":%.3f}",
        k, double(s - merged.start_ns) * 1e-3, double(f - s) * 1e-3);
    gpu += buf;
  }
  if (json.size() >= 3 && json.compare(json.size() - 2, 2, "]}") == 0 && json[json.size() - 3] != '[')
    json.insert(json.size() - 2, gpu);
  std::filesystem::create_directories(o.trace_dir);
  r.trace = (std::filesystem::path(o.trace_dir) / ("gpu_trainer_" + mode + ".json")).string();
  std::ofstream(r.trace) << json;

  for (int k = 0; k < total; ++k) {
    e.destroy_event(start[k]);
    e.destroy_event(end[k]);
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

  // 2. GEMMs sized so that a micro-batch (the GPU work of a step) takes gpu_ratio x the CPU step.
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
  work.count = std::max(1, int(o.gpu_ratio * cpu_s / gemm_s + 0.5));
  const double micro_s = work.count * gemm_s;

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
  std::printf("  SGEMM %dx%d: %.3f ms; %d per micro-batch: %.2f ms of GPU work (%.2f x the CPU step)\n\n",
              o.gemm, o.gemm, gemm_s * 1e3, work.count, micro_s * 1e3, micro_s / cpu_s);

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

  std::printf("%-10s %6s %9s %8s %9s %9s %9s %9s %8s %8s %10s\n", "mode", "steps", "step_ms", "gpu_busy",
              "d2h_ms", "update_ms", "h2d_ms", "pipe_ms", "D2H_GB/s", "H2D_GB/s", "wall/slow");
  for (const auto& r : results)
    std::printf("%-10s %6d %9.2f %7.1f%% %9.2f %9.2f %9.2f %9.2f %8.2f %8.2f %10.2f\n", r.mode.c_str(),
                r.steps, r.step_ms, r.gpu_busy * 100, r.copy_in_ms, r.update_ms, r.copy_out_ms,
                r.pipe_wall_ms, r.d2h_gbps, r.h2d_gbps, r.wall_over_slowest);
  std::puts("\ntargets:");
  for (const auto& r : results) {
    if (r.mode == "pipelined") {
      const double slowest = std::max({r.copy_in_ms, r.update_ms, r.copy_out_ms});
      std::printf("  pipelined: pipeline wall %.2f ms <= 1.1 x max(D2H %.2f, CPU update %.2f, H2D %.2f) = "
                  "%.2f ms: %s\n",
                  r.pipe_wall_ms, r.copy_in_ms, r.update_ms, r.copy_out_ms, 1.1 * slowest,
                  r.pipe_wall_ms <= 1.1 * slowest ? "MET" : "MISSED");
    } else if (r.mode == "dpu") {
      if (cpu_s < micro_s)
        std::printf("  dpu: GPU busy %.1f%% >= 90%% (the CPU step %.2f ms is shorter than a micro-batch %.2f "
                    "ms): %s\n",
                    r.gpu_busy * 100, cpu_s * 1e3, micro_s * 1e3, r.gpu_busy >= 0.9 ? "MET" : "MISSED");
      else
        std::printf(
            "  dpu: GPU busy %.1f%%; no target (the CPU step %.2f ms is longer than a micro-batch %.2f ms)\n",
            r.gpu_busy * 100, cpu_s * 1e3, micro_s * 1e3);
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
  app.add_option("--gpu-ratio", o.gpu_ratio, "GPU work per step over the CPU step")->capture_default_str();
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
