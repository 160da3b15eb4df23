// hostopt-bench: tells a user what their machine can do with an offloaded optimizer.
#include <CLI/CLI.hpp>

#include <iostream>

#include "bench_common.hpp"
#include "hostopt/kernels.hpp"
#include "subcommands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"hostopt-bench: how fast the host-side Adam/AdamW step runs on this machine, and how close to its "
               "memory-bandwidth limit"};
  app.require_subcommand(1);
  bench::common_options common;
  bool json = false, csv = false, quiet = false;
  app.add_flag("--json", json, "Print results as JSON");
  app.add_flag("--csv", csv, "Print results as CSV");
  app.add_flag("-q,--quiet", quiet, "No progress line on stderr");
  bench::kernel_options kernel_opts;
  bench::model_options model_opts;
  bench::roofline_options roofline_opts;
  bench::pipeline_options_cli pipeline_opts;
  bench::add_kernel_command(app, kernel_opts);
  bench::add_model_command(app, model_opts);
  bench::add_roofline_command(app, roofline_opts);
  bench::add_pipeline_command(app, pipeline_opts);
  auto* list = app.add_subcommand("kernels", "List the kernels compiled in and whether this CPU runs them");
  for (auto* sub : app.get_subcommands({}))
    sub->fallthrough(); // global flags may come after the subcommand
  CLI11_PARSE(app, argc, argv);
  if (json && csv) {
    std::cerr << "error: --json and --csv exclude each other: pick one\n";
    return 2;
  }
  common.format = json ? bench::output_format::json : csv ? bench::output_format::csv : bench::output_format::table;
  common.progress = !quiet;
  try {
    if (list->parsed()) {
      for (const auto& k : hostopt::kernels())
        std::cout << k.name << (k.supported ? "" : " (not supported here)")
                  << (k.supported && k.name == hostopt::active_kernel() ? "  <- active" : "") << "\n";
      return 0;
    }
    bench::report r("");
    if (app.got_subcommand("kernel")) r = bench::run_kernel_bench(kernel_opts, common);
    else if (app.got_subcommand("model")) r = bench::run_model_bench(model_opts, common);
    else if (app.got_subcommand("pipeline")) r = bench::run_pipeline_bench(pipeline_opts, common);
    else r = bench::run_roofline_bench(roofline_opts, common);
    r.print(std::cout, common.format);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
