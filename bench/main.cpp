// hostopt-bench: tells a user what their machine can do with an offloaded optimizer.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "hostopt/kernels.hpp"
#include "subcommands.hpp"

namespace {

// Exit status, the same for every subcommand (README "hostopt-bench" and the --help footer).
constexpr int exit_ok = 0;
constexpr int exit_failure = 1; // a run-time failure: not enough memory, results or a trace that cannot be written
constexpr int exit_usage = 2;   // the command line is wrong: nothing was run
constexpr const char* exit_footer =
    "Exit status: 0 success; 1 a run-time failure (not enough memory, results or --trace that cannot be "
    "written); 2 a usage error, nothing run (unknown subcommand or flag, a bad value, a size of 0, a preset "
    "over --max-params).";

// Results that never reach their reader are a failure (a full disk, a closed stdout), not
// a silent success.
int finish_output(int status) {
  std::cout.flush();
  errno = 0;
  const bool lost = !std::cout || std::fflush(stdout) != 0 || std::ferror(stdout);
  if (lost && status == 0) {
    std::cerr << "error: cannot write the results to standard output"
              << (errno ? std::string(": ") + std::strerror(errno) : std::string()) << "\n";
    return exit_failure;
  }
  return status;
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"hostopt-bench: how fast the host-side Adam/AdamW step runs on this machine, and how close to its "
               "memory-bandwidth limit"};
  app.require_subcommand(1);
  app.footer(exit_footer);
  bench::common_options common;
  bool json = false, csv = false, quiet = false;
  app.add_flag("--json", json, "Print results as JSON");
  app.add_flag("--csv", csv, "Print results as CSV");
  app.add_flag("-q,--quiet", quiet, "No progress line on stderr");
  bench::kernel_options kernel_opts;
  bench::model_options model_opts;
  bench::roofline_options roofline_opts;
  bench::pipeline_options_cli pipeline_opts;
  bench::trainer_options trainer_opts;
  bench::disk_options disk_opts;
  bench::project_options project_opts;
  bench::add_kernel_command(app, kernel_opts);
  bench::add_model_command(app, model_opts);
  bench::add_roofline_command(app, roofline_opts);
  bench::add_pipeline_command(app, pipeline_opts);
  bench::add_trainer_command(app, trainer_opts);
  bench::add_disk_command(app, disk_opts);
  bench::add_project_command(app, project_opts);
  auto* list = app.add_subcommand("kernels", "List the kernels compiled in and whether this CPU runs them");
  for (auto* sub : app.get_subcommands({})) {
    sub->fallthrough(); // global flags may come after the subcommand
    sub->footer(exit_footer);
  }
  // The subcommand is the first word that is not a flag (the global flags take no value).
  std::string names;
  std::vector<std::string> known;
  for (auto* sub : app.get_subcommands({})) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
    known.push_back(sub->get_name());
  }
  bool help = false, found = false;
  for (int i = 1; i < argc && !found; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") help = true;
    if (a.empty() || a[0] == '-') continue;
    found = true;
    if (std::find(known.begin(), known.end(), a) == known.end()) {
      std::cerr << "error: unknown subcommand '" << a << "': expected one of " << names << " (see --help)\n";
      return exit_usage;
    }
  }
  if (!found && !help) {
    std::cerr << "error: a subcommand is required: one of " << names << " (see --help)\n";
    return exit_usage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help prints and exits 0; every parse error (CLI11's own codes 105, 109, ...) is a usage error.
    return finish_output(app.exit(e) == 0 ? exit_ok : exit_usage);
  }
  if (json && csv) {
    std::cerr << "error: --json and --csv exclude each other: pick one\n";
    return exit_usage;
  }
  common.format = json ? bench::output_format::json : csv ? bench::output_format::csv : bench::output_format::table;
  common.progress = !quiet;
  try {
    if (list->parsed()) {
      if (common.format == bench::output_format::table) {
        for (const auto& k : hostopt::kernels())
          std::cout << k.name << (k.supported ? "" : " (not supported here)")
                    << (k.supported && k.name == hostopt::active_kernel() ? "  <- active" : "") << "\n    "
                    << k.description << "; needs " << k.required << "\n";
        return finish_output(exit_ok);
      }
      bench::report r("kernels"); // --json / --csv: one row per kernel
      for (const auto& k : hostopt::kernels())
        r.add_row({{"kernel", k.name}, {"supported", k.supported},
                   {"active", k.supported && k.name == hostopt::active_kernel()},
                   {"description", k.description}, {"needs", k.required}});
      r.print(std::cout, common.format);
      return finish_output(exit_ok);
    }
    bench::report r("");
    if (app.got_subcommand("kernel")) r = bench::run_kernel_bench(kernel_opts, common);
    else if (app.got_subcommand("model")) r = bench::run_model_bench(model_opts, common);
    else if (app.got_subcommand("pipeline")) r = bench::run_pipeline_bench(pipeline_opts, common);
    else if (app.got_subcommand("trainer")) r = bench::run_trainer_bench(trainer_opts, common);
    else if (app.got_subcommand("disk")) r = bench::run_disk_bench(disk_opts, common);
    else if (app.got_subcommand("project")) r = bench::run_project_bench(project_opts, common);
    else r = bench::run_roofline_bench(roofline_opts, common);
    r.print(std::cout, common.format);
  } catch (const std::invalid_argument& e) {
    // Values are checked before anything is allocated or timed: a bad one is a usage error.
    std::cerr << "error: " << e.what() << "\n";
    return finish_output(exit_usage);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return finish_output(exit_failure);
  }
  return finish_output(exit_ok);
}
