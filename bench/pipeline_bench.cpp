// `hostopt-bench pipeline`: the end-to-end offloaded step — gradients copied in, chunks
// updated, parameters copied out — on the host engine with a PCIe-like bandwidth cap (or
// CUDA when a device exists), against the synchronous step on the same data. With --store,
// the same pipeline over a stored_optimizer too (the state streamed from the drive around the
// chunks), interleaved, against the drive's mixed bandwidth over its bytes: whether the
// drive keeps up with the pipeline.
#include <CLI/CLI.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "bench_common.hpp"
#include "hostopt/offload_pipeline.hpp"
#include "hostopt/optimizer.hpp"
#include "hostopt/stored_optimizer.hpp"
#include "subcommands.hpp"

namespace bench {


void add_pipeline_command(CLI::App& app, pipeline_options_cli& o) {
  auto* cmd = app.add_subcommand("pipeline", "Time the offloaded step through the copy-in/update/copy-out pipeline");
  cmd->add_option("-s,--size", o.size, "Parameters, suffixes K/M/G")->capture_default_str();
  cmd->add_option("-t,--threads", o.threads, "Update threads: a list like 1,2, or 'all'")->capture_default_str();
  cmd->add_option("-c,--chunk", o.chunk, "Elements per chunk, suffixes K/M/G")->capture_default_str();
  cmd->add_option("-d,--depth", o.depth, "Pinned buffers per direction (>= 2)")->capture_default_str()->check(CLI::Range(2, 64));
  cmd->add_option("--cap", o.caps, "Host-engine copy bandwidth caps in GB/s per direction (0 = uncapped)")
      ->capture_default_str()->delimiter(',');
  cmd->add_option("--mix", o.mix, "Dtype mix GRAD:OUT of the device buffers (OUT is required)")->capture_default_str();
  cmd->add_option("-e,--engine", o.engine, "Copy engine: auto (cuda when a device exists), host or cuda")
      ->capture_default_str()->check(CLI::IsMember({"auto", "host", "cuda"}));
  cmd->add_option("-i,--iterations", o.iterations, "Timed iterations")->capture_default_str()->check(CLI::Range(1, 100000));
  cmd->add_option("--trace", o.trace, "Write the last step's Chrome trace (Perfetto) JSON to this file");
  cmd->add_option("--store", o.store, "A directory on a local drive: also run the pipeline over a stored_optimizer "
                                     "there (state streamed from the drive), against the drive's mixed bandwidth");
  cmd->add_option("--staging", o.staging, "With --store: RAM for the store's staging buffers, suffixes K/M/G")
      ->capture_default_str();
}

report run_pipeline_bench(const pipeline_options_cli& o, const common_options& c) {
  const std::size_t n = parse_size(o.size, "--size");
  const std::size_t chunk = parse_size(o.chunk, "--chunk");
  const dtype_mix mix = parse_mix(o.mix);
  if (mix.out < 0) throw std::invalid_argument("dtype mix '" + o.mix + "': the pipeline copies parameters out, so OUT cannot be none");
  const std::vector<int> threads = parse_threads(o.threads);
  if (!o.store.empty() && !std::filesystem::is_directory(o.store))
    throw std::invalid_argument("--store " + o.store + ": not a directory");
  const std::size_t staging = o.store.empty() ? 0 : parse_size(o.staging, "--staging");
  const bool cuda = o.engine == "cuda" || (o.engine == "auto" && hostopt::cuda_device_available());
  const auto gt = hostopt::dtype(mix.grad), pt = hostopt::dtype(mix.out);
  const std::size_t gsz = hostopt::dtype_size(gt), psz = hostopt::dtype_size(pt);
  // State, host copies of grads/params for the synchronous step, device buffers (host
  // memory on the host engine) and the pinned rings.
  check_memory(n * (12 + 2 * (gsz + psz)) + 2 * std::size_t(o.depth) * chunk * (gsz + psz),
               "pipeline benchmark of " + format_size(n) + " parameters");

  report r("pipeline");
  add_machine_context(r);
  r.set_context("engine", cuda ? "cuda" : "host");
  r.set_context("chunk", format_size(chunk));
  r.set_context("depth", o.depth);
  if (!o.store.empty()) r.set_context("store", o.store + ", staging " + format_size(staging) + ", no fdatasync");
  const std::vector<double> caps = cuda ? std::vector<double>{0.0} : o.caps;
  progress prog(caps.size() * threads.size(), c.progress);
  std::size_t done = 0;
  for (double cap : caps)
    for (int t : threads) {
      prog.update(done++, "pipeline cap=" + std::to_string(cap) + " threads=" + std::to_string(t));
      hostopt::host_engine_options eo;
      eo.bandwidth_gbps = cap;
      auto engine = cuda ? hostopt::make_cuda_copy_engine(0) : hostopt::make_host_copy_engine(eo);
      hostopt::adam_config cfg;
      cfg.weight_decay = 0.01;
      hostopt::optimizer opt({{cfg, {{"flat", {std::int64_t(n)}}}}}, {t, ""});
      fill_random(opt.params().data(), opt.arena_size(), 1.0f, false, t);
      const std::size_t arena = opt.arena_size();
      hostopt::pipeline_options po;
      po.chunk_elems = chunk;
      po.depth = o.depth;
      po.grad_type = gt;
      po.param_type = pt;
      hostopt::offload_pipeline pipe(opt, *engine, po);
      // With --store: the same pipeline over a store of the same state (its own device buffer
      // for the parameters), and the drive's mixed pattern over the bytes a step moves.
      std::unique_ptr<scratch_dir> dir;
      std::unique_ptr<hostopt::stored_optimizer> stored;
      std::unique_ptr<hostopt::offload_pipeline> stored_pipe;
      std::unique_ptr<mixed_roofline> drive;
      if (!o.store.empty()) {
        dir = std::make_unique<scratch_dir>(o.store, "hostopt-bench-pipeline-store");
        hostopt::state_store_options so;
        so.dirs = {dir->path.string()};
        so.staging_bytes = staging;
        so.sync_every_step = false;
        stored = std::make_unique<hostopt::stored_optimizer>(hostopt::stored_optimizer::create(
            {{cfg, {{"flat", {std::int64_t(n)}}}}}, so, {t, ""}, {opt.params().data(), arena, hostopt::dtype::f32}));
        stored_pipe = std::make_unique<hostopt::offload_pipeline>(*stored, *engine, po);
        drive = std::make_unique<mixed_roofline>(o.store, stored->step_io_bytes(), stored->chunk_bytes() + 4096,
                                                 so.buffers, "auto");
      }
      // Gradients prepared on the host, then placed in device memory.
      float_buffer host_grad = typed_buffer(arena, gt, t), host_out = typed_buffer(arena, pt, t);
      if (gt == hostopt::dtype::f32) fill_random(host_grad.data, arena, 0.01f, false, t);
      else fill_random_half(reinterpret_cast<std::uint16_t*>(host_grad.data), arena, gt, t);
      struct device_mem {
        hostopt::copy_engine& e;
        void* p;
        ~device_mem() { e.free_device(p); }
      } dgrad{*engine, engine->allocate_device(arena * gsz)}, dparams{*engine, engine->allocate_device(arena * psz)},
          dstored{*engine, stored ? engine->allocate_device(arena * psz) : nullptr};
      // The trainer's stream: it wrote the gradients, so every step is ordered after it.
      const hostopt::device_stream trainer = engine->create_stream();
      {
        hostopt::pinned_buffer staging(*engine, arena * gsz);
        std::memcpy(staging.data(), host_grad.data, arena * gsz);
        engine->copy_async(trainer, hostopt::copy_direction::to_device, dgrad.p, staging.data(), arena * gsz);
        engine->synchronize_stream(trainer);
      }
      const hostopt::device_order after_trainer = hostopt::device_order::after(trainer);
      std::vector<double> wall, sync, ratio, in_s, up_s, out_s, store_wall, store_update, drive_s;
      hostopt::pipeline_timeline last;
      for (int it = 0; it < o.iterations + 1; ++it) {
        pipe.step({dgrad.p, arena, gt}, {dparams.p, arena, pt}, after_trainer);
        const hostopt::pipeline_timeline tl = pipe.last_timeline();
        const double t0 = now_seconds();
        opt.step(hostopt::const_view{host_grad.data, arena, gt}, hostopt::mut_view{host_out.data, arena, pt});
        const double t1 = now_seconds();
        if (stored) {
          stored_pipe->step({dgrad.p, arena, gt}, {dstored.p, arena, pt}, after_trainer);
          const hostopt::pipeline_timeline st = stored_pipe->last_timeline();
          const double d = drive->seconds();
          if (it > 0) {
            store_wall.push_back(st.wall_seconds());
            store_update.push_back(st.busy_seconds(hostopt::pipeline_stage::update));
            drive_s.push_back(d);
          }
        }
        if (it == 0) continue;
        wall.push_back(tl.wall_seconds());
        ratio.push_back(tl.wall_over_slowest_stage());
        in_s.push_back(tl.busy_seconds(hostopt::pipeline_stage::copy_in));
        up_s.push_back(tl.busy_seconds(hostopt::pipeline_stage::update));
        out_s.push_back(tl.busy_seconds(hostopt::pipeline_stage::copy_out));
        sync.push_back(t1 - t0);
        last = tl;
      }
      nlohmann::ordered_json row;
      row["size"] = format_size(n);
      row["threads"] = t;
      row["mix"] = mix.name();
      row["cap_GB/s"] = cuda ? nlohmann::ordered_json("cuda") : nlohmann::ordered_json(cap);
      row["chunks"] = pipe.num_chunks();
      row["copy_in_ms"] = summarize(in_s).median * 1e3;
      row["update_ms"] = summarize(up_s).median * 1e3;
      row["copy_out_ms"] = summarize(out_s).median * 1e3;
      row["wall_ms"] = summarize(wall).median * 1e3;
      row["wall/slowest"] = summarize(ratio).median;
      row["in_GB/s"] = double(arena * gsz) / summarize(in_s).median / 1e9;
      row["out_GB/s"] = double(arena * psz) / summarize(out_s).median / 1e9;
      row["sync_ms"] = summarize(sync).median * 1e3;
      row["sync/wall"] = summarize(sync).median / summarize(wall).median;
      if (stored) {
        const double sw = summarize(store_wall).median, dm = summarize(drive_s).median;
        row["store_wall_ms"] = sw * 1e3;
        row["store_update_ms"] = summarize(store_update).median * 1e3;
        row["store/ram"] = sw / summarize(wall).median;
        row["drive_ms"] = dm * 1e3;
        row["store_wall/drive"] = sw / dm;
        row["bound_by"] = dm >= 0.8 * sw ? "drive" : "pipeline";
        row["store_cached_pages"] = stored->cached_pages();
      }
      r.add_row(row);
      if (!o.trace.empty()) {
        std::ofstream f(o.trace);
        f << last.chrome_trace_json();
        if (!f) throw std::runtime_error("--trace '" + o.trace + "': cannot write the file");
      }
    }
  prog.finish();
  r.add_note("Busy times are per stage, summed over chunks; wall/slowest = wall / busiest stage (1.0 = perfect overlap, "
             "3.0 = none). sync_ms is the synchronous step on host copies of the same data (no transfers): sync/wall "
             "near 1 means the pipeline costs nothing over it.");
  if (!o.store.empty())
    r.add_note("--store: store_wall_ms is the same pipeline over a stored_optimizer (state streamed from the drive around "
               "the pipeline's chunks, committed each step), interleaved with the in-RAM one; drive_ms is the drive's "
               "mixed O_DIRECT pattern over the bytes a step moves (its roofline), timed beside it. bound_by: drive "
               "when drive_ms is at least 0.8 x store_wall_ms (the GPU would wait for the drive: faster drives, "
               "more stripes or 8-bit moments), else pipeline.");
  if (!cuda)
    r.add_note("Host engine: 'device' memory is host memory and each copy runs on a copy thread, so with 2 cores the "
               "copies compete with the update for cores and memory bandwidth, which a real GPU's DMA engines do not.");
  return r;
}

} // namespace bench
