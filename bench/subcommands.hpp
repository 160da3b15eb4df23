#pragma once
// The subcommands of hostopt-bench: each registers its flags on the CLI and runs into a
// report.

#include <string>
#include <vector>

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
};
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
};
void add_model_command(CLI::App& app, model_options& o);
report run_model_bench(const model_options& o, const common_options& c);

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
report run_disk_bench(const disk_options& o, const common_options& c);

/// "f32:none" -> grad dtype and copy-out dtype (or none); throws std::invalid_argument.
struct dtype_mix {
  int grad;  // hostopt::dtype
  int out;   // -1 = none, else hostopt::dtype
  std::string name() const;
};
dtype_mix parse_mix(const std::string& text);

} // namespace bench
