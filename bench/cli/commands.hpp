// The tierflow CLI's verbs. Each add_*_command registers a subcommand on the
// app and the callback that runs it; errors propagate as tierflow::error
// (user_error for bad input) and main() turns them into one line and an exit code.
#pragma once

#include <CLI/CLI.hpp>

namespace tierflow::cli {

void add_info_command(CLI::App& app);

// The `bench` and `tune` parent verbs, shared by every `bench X` / `tune X`:
// each returns the existing subcommand or creates it (so the add_* calls for
// its children may come in any order), requiring one child.
inline CLI::App& parent_command(CLI::App& app, const char* name, const char* description) {
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    if (sub->get_name() == name) return *sub;
  }
  CLI::App* parent = app.add_subcommand(name, description);
  parent->require_subcommand(1);
  return *parent;
}
inline CLI::App& bench_command(CLI::App& app) {
  return parent_command(app, "bench", "Benchmark one part of the offload path beside its peer");
}
inline CLI::App& tune_command(CLI::App& app) {
  return parent_command(app, "tune", "Sweep settings on this machine and write the best as a config snippet");
}

// `tierflow bench io` (bench_io.cpp) and `tierflow tune io` (tune_io.cpp).
void add_bench_io_command(CLI::App& app);
void add_tune_io_command(CLI::App& app);

// `tierflow bench optim` (bench_optim.cpp).
void add_bench_optim_command(CLI::App& app);

// `tierflow bench offload` (bench_offload.cpp).
void add_bench_offload_command(CLI::App& app);

}  // namespace tierflow::cli
