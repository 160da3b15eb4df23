// `hostopt-bench kernel --store DIR`: the optimizer state on a drive (stored_optimizer), its
// streamed step timed against the drive's mixed O_DIRECT bandwidth over the same bytes,
// interleaved step by step; with the RAM the store adds (peak RSS) and the page cache it left.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "hostopt/moment_format.hpp"
#include "hostopt/stored_optimizer.hpp"
#include "subcommands.hpp"

namespace bench {

namespace {

// A field of /proc/self/status in bytes (VmRSS, VmHWM), 0 where it cannot be read.
std::size_t status_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1)) * 1024;
  return 0;
}

// Resets the peak RSS to the current one (Linux >= 4.0): the store's peak is then its own.
void reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
}


} // namespace

report run_store_bench(const kernel_options& o, const common_options& c) {
  if (!std::filesystem::is_directory(o.store)) throw std::invalid_argument("--store " + o.store + ": not a directory");
  std::vector<std::size_t> sizes;
  for (const auto& s : o.sizes) sizes.push_back(parse_size(s, "--size"));
  std::vector<hostopt::moment_format> states;
  for (const auto& s : o.states) states.push_back(hostopt::parse_moment_format(s));
  const std::size_t staging = parse_size(o.staging, "--staging");
  const std::vector<int> threads = parse_threads(o.threads);
  const int t = threads.front();
  for (std::size_t n : sizes) check_memory(n * 4 + staging, "stored step of " + format_size(n) + " (f32 gradients)");

  report r("kernel --store");
  add_machine_context(r);
  r.set_context("store directory", o.store);
  r.set_context("staging budget", format_size(staging) + " in " + std::to_string(o.buffers) + " buffers");
  r.set_context("durability", o.store_sync ? "fdatasync every step" : "none (a killed process keeps every commit)");
  r.set_context("iterations", o.iterations);
  progress prog(sizes.size() * states.size(), c.progress);
  std::size_t done = 0;
  double f32_time = 0, f32_time_at_rate = 0;
  for (std::size_t n : sizes) {
    float_buffer grad(n, t);
    fill_random(grad.data, n, 1e-2f, false, t);
    for (hostopt::moment_format f : states) {
      prog.update(done++, "store " + format_size(n) + " " + std::string(hostopt::moment_format_name(f)));
      scratch_dir dir(o.store, "hostopt-bench-store");
      std::vector<hostopt::param_group> groups(1);
      groups[0].config.weight_decay = 0.01;
      groups[0].moments = f;
      groups[0].tensors = {{"w", {std::int64_t(n)}}};
      hostopt::state_store_options so;
      so.dirs = {dir.path.string()};
      so.staging_bytes = staging;
      so.sync_every_step = o.store_sync;
      so.io = o.io;
      so.buffers = o.buffers;
      const std::size_t rss_before = status_bytes("VmRSS");
      reset_peak_rss();
      const double c0 = now_seconds();
      hostopt::stored_optimizer opt = hostopt::stored_optimizer::create(groups, so, {t, o.kernel});
      const double create_s = now_seconds() - c0;
      // The roofline: the same bytes in the drive's mixed pattern, blocks of a chunk's slot.
      mixed_roofline roof(o.store, opt.step_io_bytes(), opt.chunk_bytes() + 4096, so.buffers, o.io);
      std::vector<double> ours, mixed;
      for (int it = 0; it < o.warmup + o.iterations; ++it) {
        const double t0 = now_seconds();
        opt.step(hostopt::const_view{grad.data, n, hostopt::dtype::f32});
        const double t1 = now_seconds();
        const double m = roof.seconds();
        if (it >= o.warmup) {
          ours.push_back(t1 - t0);
          mixed.push_back(m);
        }
      }
      const std::size_t peak = status_bytes("VmHWM");
      const timing ts = summarize(ours), tm = summarize(mixed);
      const double io_bytes = double(opt.step_io_bytes());
      nlohmann::ordered_json row;
      row["params"] = format_size(n);
      row["state"] = std::string(hostopt::moment_format_name(f));
      row["state_GB"] = double(opt.chunks()) * double(opt.chunk_bytes()) / 1e9;
      row["drive_GB"] = 2 * double(opt.chunks()) * double(opt.chunk_bytes() + 4096) / 1e9; // (two slots per chunk)
      row["chunks"] = opt.chunks();
      row["chunk_MB"] = double(opt.chunk_bytes()) / 1e6;
      row["step_s"] = ts.median;
      row["mixed_GB/s"] = io_bytes / tm.median / 1e9;
      row["step_GB/s"] = io_bytes / ts.median / 1e9;
      row["vs_roofline"] = ts.median / tm.median;
      row["create_s"] = create_s;
      row["staging_MB"] = double(opt.staging_bytes()) / 1e6;
      const std::size_t roof_buffers = std::size_t(so.buffers) * (opt.chunk_bytes() + 4096); // (not the store's)
      row["rss_added_MB"] = peak > rss_before + roof_buffers ? double(peak - rss_before - roof_buffers) / 1e6 : 0.0;
      row["cached_pages"] = opt.cached_pages();
      // The drive's rate drifts between rows: the step time scaled to one drive rate (times
      // the mixed rate measured beside it) compares formats as if on the same drive.
      const double at_rate = ts.median * (io_bytes / tm.median);
      if (f == hostopt::moment_format::f32) {
        f32_time = ts.median;
        f32_time_at_rate = at_rate;
      }
      row["speed_vs_f32"] = f32_time > 0 ? f32_time / ts.median : 0.0;
      row["same_drive_vs_f32"] = f32_time_at_rate > 0 ? f32_time_at_rate / at_rate : 0.0;
      row["io"] = opt.io_backend();
      r.add_row(row);
    }
  }
  prog.finish();
  r.add_note("step_s: median of the streamed step (read every chunk, update it with the fused kernels, write it "
             "back, commit); mixed_GB/s: the drive's mixed O_DIRECT pattern over the same bytes (chunk-slot blocks, "
             "the same queue depth), timed after each step; vs_roofline = step time / the mixed pass's time.");
  r.add_note("speed_vs_f32: the f32 step's time over this one's; same_drive_vs_f32: the same with each step time "
             "scaled by the mixed rate measured beside it (the drive's rate drifts from row to row).");
  r.add_note("rss_added_MB: peak RSS while the store was created and stepped, above the RSS before it (the gradient "
             "buffer is the caller's and counted before; the roofline's buffers are left out). cached_pages: the store's pages in the page cache (0: "
             "O_DIRECT bypassed it).");
  return r;
}

} // namespace bench
