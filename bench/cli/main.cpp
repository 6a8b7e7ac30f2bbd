// tierflow — the command-line tool: `info`, and the bench/tune verbs.
//
// Exit codes: 0 success; 1 a failure or a bad value (one line on stderr);
// 2 a command line that does not parse (usage on stderr).
#include <cstdio>
#include <exception>
#include <iostream>

#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/version.hpp"

int main(int argc, char** argv) {
  CLI::App app{"tierflow: train beyond GPU memory; benchmark GPU / host / NVMe offload", "tierflow"};
  app.set_version_flag("--version", std::string("tierflow ") + tierflow::version);
  app.require_subcommand(1);
  app.failure_message(CLI::FailureMessage::help);
  tierflow::cli::add_info_command(app);
  tierflow::cli::add_bench_io_command(app);
  tierflow::cli::add_bench_optim_command(app);
  tierflow::cli::add_bench_offload_command(app);
  tierflow::cli::add_tune_io_command(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // the error and the usage of the command that failed, on stderr
    return 2;
  } catch (const tierflow::user_error& e) {
    std::fprintf(stderr, "tierflow: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tierflow: %s\n", e.what());
    return 1;
  }
  return 0;
}
