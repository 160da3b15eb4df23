// `hostopt-bench disk DIR`: what a local drive does with O_DIRECT I/O (the page cache bypassed)
// at a few block sizes and queue depths — sequential writes, reads, and a mix of both (the
// streamed optimizer step reads one chunk's state while it writes another's back). The roofline
// of optimizer state kept on drives: no streamed step moves its bytes faster than "mixed".
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "direct_file.hpp"
#include "io_queue.hpp"
#include "subcommands.hpp"

namespace bench {

namespace {

namespace drive = hostopt::drive;

enum class pattern { write, read, mixed };

// One pass over the file in block order, `depth` requests in flight: writes, reads, or each
// even block read and each odd one written. Returns the seconds it took.
double pass(drive::io_queue& q, const drive::direct_file& f, std::vector<drive::direct_buffer>& buffers,
            std::size_t block, std::uint64_t blocks, pattern p) {
  std::vector<std::size_t> free_slots(buffers.size());
  for (std::size_t i = 0; i < free_slots.size(); ++i) free_slots[i] = i;
  auto settle = [&](std::size_t at_least) {
    for (const auto& c : q.wait(at_least)) {
      if (c.result != static_cast<std::int64_t>(block)) {
        throw std::runtime_error(c.result < 0 ? f.path() + ": " + std::string(std::strerror(static_cast<int>(-c.result)))
                                              : f.path() + ": a short transfer (" + std::to_string(c.result) + " of " +
                                                    std::to_string(block) + " bytes)");
      }
      free_slots.push_back(static_cast<std::size_t>(c.tag));
    }
  };
  const double t0 = now_seconds();
  for (std::uint64_t k = 0; k < blocks; ++k) {
    if (free_slots.empty()) settle(1);
    const std::size_t slot = free_slots.back();
    free_slots.pop_back();
    const bool write = p == pattern::write || (p == pattern::mixed && k % 2 == 1);
    q.submit({f.fd(), write, buffers[slot].get(), block, k * block, slot});
  }
  settle(q.in_flight());
  return now_seconds() - t0;
}

// The file bench creates in DIR, removed however the run ends.
struct scratch_file {
  std::string path;
  ~scratch_file() {
    if (!path.empty()) std::remove(path.c_str());
  }
};

} // namespace

mixed_roofline::mixed_roofline(const std::string& dir, std::uint64_t bytes, std::size_t block, unsigned depth,
                               const std::string& io)
    : path_((std::filesystem::path(dir) / ("hostopt-bench-mixed." + std::to_string(::getpid()) + ".tmp")).string()),
      block_(block), blocks_(bytes / block) {
  auto f = std::make_unique<drive::direct_file>(drive::direct_file::create(path_, blocks_ * block_));
  queue_ = drive::make_io_queue(depth, drive::parse_io_backend(io, "--io"));
  std::vector<drive::direct_buffer> buffers;
  for (unsigned i = 0; i < depth; ++i) buffers.push_back(drive::make_direct_buffer(block));
  for (std::size_t i = 0; i < depth; ++i)
    for (std::size_t j = 0; j < block; j += 64) buffers[i][j] = std::byte(i * 131 + j / 64);
  file_ = std::move(f);
  buffers_ = std::move(buffers);
  pass(*queue_, *file_, buffers_, block_, blocks_, pattern::write); // (a reserved, unwritten extent reads as zeros for free)
}
mixed_roofline::~mixed_roofline() {
  file_.reset();
  std::remove(path_.c_str());
}
double mixed_roofline::seconds() { return pass(*queue_, *file_, buffers_, block_, blocks_, pattern::mixed); }
double mixed_roofline::bytes() const { return double(blocks_) * double(block_); }

void add_disk_command(CLI::App& app, disk_options& o) {
  auto* cmd = app.add_subcommand("disk", "Measure a drive's O_DIRECT write, read and mixed bandwidth (the roofline "
                                         "of optimizer state on local drives)");
  cmd->add_option("dir", o.dir, "A directory on the drive (a scratch file is made there and removed)")->required();
  cmd->add_option("-s,--size", o.size, "Bytes of the scratch file, suffixes K/M/G (larger than the drive's cache "
                                       "for sustained figures)")->capture_default_str();
  cmd->add_option("-b,--block", o.blocks, "Block sizes (multiples of 4K)")->capture_default_str()->delimiter(',');
  cmd->add_option("-d,--depth", o.depths, "Queue depths (requests in flight)")->capture_default_str()->delimiter(',')
      ->check(CLI::Range(1u, 4096u));
  cmd->add_option("--io", o.io, "auto (io_uring where the kernel allows it, else threads), io_uring, or threads "
                                "(pread/pwrite from a thread per request in flight)")->capture_default_str();
  cmd->add_option("-i,--iterations", o.iterations, "Passes per pattern (the median is reported)")
      ->capture_default_str()->check(CLI::Range(1, 1000));
}

report run_disk_bench(const disk_options& o, const common_options& c) {
  // Every value checked before anything is created or timed (std::invalid_argument: usage).
  const drive::io_backend backend = drive::parse_io_backend(o.io, "--io");
  const std::uint64_t size = parse_size(o.size, "--size");
  std::vector<std::size_t> blocks;
  for (const auto& b : o.blocks) {
    const std::size_t block = parse_size(b, "--block");
    if (block % drive::direct_alignment != 0)
      throw std::invalid_argument("--block " + b + ": O_DIRECT needs a multiple of 4K");
    if (block > size) throw std::invalid_argument("--block " + b + " is larger than --size " + o.size);
    if (block > (std::size_t(1) << 30)) throw std::invalid_argument("--block " + b + ": at most 1G");
    blocks.push_back(block);
  }
  if (blocks.empty() || o.depths.empty()) throw std::invalid_argument("--block and --depth need at least one value");
  if (!std::filesystem::is_directory(o.dir)) throw std::invalid_argument("disk: " + o.dir + " is not a directory");
  const std::size_t most = *std::max_element(blocks.begin(), blocks.end()) *
                           *std::max_element(o.depths.begin(), o.depths.end());
  check_memory(most, "disk benchmark buffers (largest block x deepest queue)");

  scratch_file scratch{(std::filesystem::path(o.dir) / ("hostopt-bench-disk." + std::to_string(::getpid()) + ".tmp"))
                           .string()};
  drive::direct_file f = drive::direct_file::create(scratch.path, size);
  report r("disk");
  add_machine_context(r);
  r.set_context("directory", o.dir);
  r.set_context("file bytes", format_size(size));
  std::string used;
  progress prog(blocks.size() * o.depths.size(), c.progress);
  std::size_t done = 0;
  double best_mixed = 0;
  for (std::size_t block : blocks) {
    const std::uint64_t count = size / block;
    for (unsigned depth : o.depths) {
      prog.update(done++, "disk block=" + format_size(block) + " depth=" + std::to_string(depth));
      auto q = drive::make_io_queue(depth, backend);
      used = drive::to_string(q->backend());
      std::vector<drive::direct_buffer> buffers;
      for (unsigned i = 0; i < depth; ++i) buffers.push_back(drive::make_direct_buffer(block));
      for (std::size_t i = 0; i < depth; ++i) // (not zeros: a drive may compress or skip them)
        for (std::size_t j = 0; j < block; j += 64) buffers[i][j] = std::byte(i * 131 + j / 64);
      nlohmann::ordered_json row;
      row["block"] = format_size(block);
      row["depth"] = depth;
      const double bytes = double(count) * double(block);
      for (auto [name, p] : {std::pair{"write_GB/s", pattern::write}, std::pair{"read_GB/s", pattern::read},
                             std::pair{"mixed_GB/s", pattern::mixed}}) {
        std::vector<double> t;
        for (int it = 0; it < o.iterations; ++it) t.push_back(pass(*q, f, buffers, block, count, p));
        row[name] = bytes / summarize(t).median / 1e9;
      }
      best_mixed = std::max(best_mixed, row["mixed_GB/s"].get<double>());
      r.add_row(row);
    }
  }
  prog.finish();
  const std::uint64_t cached = f.cached_pages();
  const long page = ::sysconf(_SC_PAGESIZE);
  r.set_context("io", used);
  r.set_context("page cache after the run", std::to_string(cached) + " of " +
                                                std::to_string((size + page - 1) / page) + " pages of the file");
  r.add_note("O_DIRECT throughout (io: " + used + "); mixed = even blocks read, odd ones written, as a streamed step "
             "reads one chunk's state while writing another's. Best mixed: " + std::to_string(best_mixed).substr(0, 5) +
             " GB/s — no streamed step moving B bytes of state runs faster than B / that.");
  if (cached != 0)
    r.add_note("warning: " + std::to_string(cached) + " pages of the file are in the page cache: this filesystem does "
               "not honour O_DIRECT, so these figures may be the cache's, not the drive's");
  return r;
}

} // namespace bench
