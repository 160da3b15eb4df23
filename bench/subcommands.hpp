#pragma once
// The subcommands of hostopt-bench: each registers its flags on the CLI and runs into a
// report.

#include <memory>
#include <string>
#include <vector>

#include "direct_file.hpp"
#include "io_queue.hpp"
#include "report.hpp"

namespace CLI {
class App;
}

namespace bench {

/// Options every subcommand shares.
struct common_options {
  output_format format = output_format::table;
  bool progress = true;
};

struct kernel_options {
  std::vector<std::string> sizes{"64M"};
  std::string threads = "all";
  std::vector<std::string> modes{"adamw"};
  std::vector<std::string> mixes{"f32:none", "bf16:bf16"};
  int iterations = 5;
  int warmup = 1;
  std::string kernel;
  std::string baseline = "none";
  std::vector<std::string> states{"f32"}; // moment formats: f32, bf16, 8bit
  // --store DIR: the state on a drive (stored_optimizer), streamed through staging buffers.
  std::string store;
  std::string staging = "256M";
  unsigned buffers = 8;
  bool store_sync = false;
  std::string io = "auto";
};
/// `kernel --store DIR`: the streamed step against the drive's mixed roofline (store_bench.cpp).
report run_store_bench(const kernel_options& o, const common_options& c);
void add_kernel_command(CLI::App& app, kernel_options& o);
report run_kernel_bench(const kernel_options& o, const common_options& c);

struct model_options {
  std::string preset = "gpt2-small";
  std::string shapes_file;
  std::string max_params = "512M";
  std::string threads = "all";
  std::string mix = "f32:none";
  std::vector<std::string> states{"f32"};
  int iterations = 5;
  int warmup = 1;
  double drive_gbps = 0;  // > 0: project the state kept on a drive of this mixed bandwidth
  double gpu_step_ms = 0; // > 0: and whether that drive keeps up with a GPU step of this length
};
void add_model_command(CLI::App& app, model_options& o);
report run_model_bench(const model_options& o, const common_options& c);

struct project_options {
  std::vector<std::string> states{"f32", "bf16", "8bit"};
  std::vector<std::string> kernels; // empty: the active kernel
  std::string mix = "f32:none";
  std::vector<std::string> bandwidths{"measured", "loaded"};
  std::string cache_size = "64K";
  std::string stream_size = "64M";
  int iterations = 3000;
  std::string validate; // a size: also measure the steps there
  int validate_iterations = 5;
};
/// `project`: each format's step time and speedup over f32 at a memory bandwidth per core.
void add_project_command(CLI::App& app, project_options& o);
report run_project_bench(const project_options& o, const common_options& c);
struct roofline_options {
  std::string size = "64M";
  std::string threads = "all";
  int iterations = 5;
};
void add_roofline_command(CLI::App& app, roofline_options& o);
report run_roofline_bench(const roofline_options& o, const common_options& c);

struct pipeline_options_cli {
  std::string size = "64M";
  std::string threads = "all";
  std::string chunk = "4M";
  int depth = 2;
  std::vector<double> caps{12.0, 0.0};
  std::string mix = "bf16:bf16";
  std::string engine = "auto";
  int iterations = 5;
  std::string trace;
  std::string store;            // a directory on a local drive: the pipeline over a store there too
  std::string staging = "256M"; // with store: its staging budget
};
void add_pipeline_command(CLI::App& app, pipeline_options_cli& o);
report run_pipeline_bench(const pipeline_options_cli& o, const common_options& c);

struct trainer_options {
  std::string preset = "gpt2-small";
  std::string params; // a flat model instead of the preset
  std::string max_params = "512M";
  std::vector<std::string> tokens{"8K", "32K", "128K"};
  int micro = 2;
  double tflops = 400;
  std::vector<std::string> links{"pcie4"};
  std::vector<std::string> modes{"sync", "dpu", "sync-overlap", "dpu-overlap"};
  std::string threads; // empty: every hardware thread
  std::string state = "f32";
  std::string mix = "f32:bf16";
  std::string chunk = "1M";
  int steps = 6;
};
void add_trainer_command(CLI::App& app, trainer_options& o);
report run_trainer_bench(const trainer_options& o, const common_options& c);

struct disk_options {
  std::string dir;
  std::string size = "1G";
  std::vector<std::string> blocks{"256K", "1M", "4M"};
  std::vector<unsigned> depths{1, 4, 16, 32};
  std::string io = "auto";
  int iterations = 1;
};
void add_disk_command(CLI::App& app, disk_options& o);

/// The drive's mixed pattern (half the blocks read, half written, `depth` in flight) over a
/// scratch file of `bytes` in `dir`, written once first; removed with the object. The
/// roofline of a streamed step moving the same bytes.
class mixed_roofline {
public:
  mixed_roofline(const std::string& dir, std::uint64_t bytes, std::size_t block, unsigned depth, const std::string& io);
  ~mixed_roofline();
  double seconds(); ///< one timed pass
  double bytes() const;

private:
  std::string path_;
  std::size_t block_;
  std::uint64_t blocks_;
  std::unique_ptr<hostopt::drive::io_queue> queue_;
  std::unique_ptr<hostopt::drive::direct_file> file_;
  std::vector<std::unique_ptr<std::byte[], hostopt::drive::direct_buffer_deleter>> buffers_;
};
report run_disk_bench(const disk_options& o, const common_options& c);

/// "f32:none" -> grad dtype and copy-out dtype (or none); throws std::invalid_argument.
struct dtype_mix {
  int grad;  // hostopt::dtype
  int out;   // -1 = none, else hostopt::dtype
  std::string name() const;
};
dtype_mix parse_mix(const std::string& text);

} // namespace bench
