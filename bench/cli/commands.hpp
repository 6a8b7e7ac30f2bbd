// The tierflow CLI's verbs. Each add_*_command registers a subcommand on the
// app and the callback that runs it; errors propagate as tierflow::error
// (user_error for bad input) and main() turns them into one line and an exit code.
#pragma once

#include <CLI/CLI.hpp>

namespace tierflow::cli {

void add_info_command(CLI::App& app);

}  // namespace tierflow::cli
