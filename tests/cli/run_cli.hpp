// Runs the tierflow CLI as a user would and captures what it printed.
#pragma once

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "temp_dir.hpp"

namespace tierflow::testing {

struct cli_result {
  int exit_code = -1;  // -1: killed by a signal
  std::string out;
  std::string err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The program under test: TIERFLOW_CLI as built, or $TIERFLOW_CLI_PATH when the
// test binaries run from another folder (scripts/gpu_bundle.sh's bundle).
inline const char* cli_path() {
  const char* moved = std::getenv("TIERFLOW_CLI_PATH");
  return moved && *moved ? moved : TIERFLOW_CLI;
}

// Runs TIERFLOW_CLI with `args`; stdout and stderr go through temporary files
// so that large outputs cannot dead-lock a pipe. `in_child`, when given, runs
// in the child just before exec (e.g. to install a seccomp filter); it may
// _exit() to report that it could not.
inline cli_result run_cli(const std::vector<std::string>& args, void (*in_child)() = nullptr) {
  char out_name[] = "/tmp/tierflow-cli-out-XXXXXX";
  char err_name[] = "/tmp/tierflow-cli-err-XXXXXX";
  const int out_fd = ::mkstemp(out_name);
  const int err_fd = ::mkstemp(err_name);
  cli_result r;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out_fd, STDOUT_FILENO);
    ::dup2(err_fd, STDERR_FILENO);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    ::dup2(null_fd, STDIN_FILENO);
    if (in_child != nullptr) in_child();
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(cli_path()));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(cli_path(), argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  ::close(out_fd);
  ::close(err_fd);
  r.out = slurp(out_name);
  r.err = slurp(err_name);
  ::unlink(out_name);
  ::unlink(err_name);
  return r;
}

}  // namespace tierflow::testing
