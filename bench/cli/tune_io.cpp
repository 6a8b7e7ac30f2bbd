// `tierflow tune io`: sweeps block size × queue depth × threads on a scratch
// file in a directory, as DeepSpeed's ds_nvme_tune does, ranks the settings by
// measured bandwidth and writes the winner as the config snippet the engine
// reads (io::read_config; `bench io --config`).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "io_runner.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/io/probe.hpp"

namespace tierflow::cli {
namespace {

struct tune_io_options {
  std::string path;
  std::string size = "64M";
  std::string block_sizes = "128K,256K,512K,1M";
  std::string queue_depths = "4,8,16,32,64";
  std::string threads = "1,2";
  std::string pattern = "both";
  std::string backend = "auto";
  std::string output;
  unsigned top = 10;
  bool as_json = false;
};

struct trial {
  std::size_t block_size = 0;
  unsigned queue_depth = 0;
  unsigned threads = 0;
  double read = 0;   // bytes/s, 0 when not measured
  double write = 0;
  double score = 0;  // what the ranking uses
};

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::vector<unsigned> parse_counts(const std::string& text, const char* what, unsigned max) {
  std::vector<unsigned> out;
  for (const std::string& item : split(text)) {
    char* end = nullptr;
    const unsigned long v = std::strtoul(item.c_str(), &end, 10);
    if (end == item.c_str() || *end != '\0' || v < 1 || v > max) {
      throw user_error(std::string(what) + ": '" + item + "' is not a whole number in 1.." + std::to_string(max));
    }
    out.push_back(static_cast<unsigned>(v));
  }
  if (out.empty()) throw user_error(std::string(what) + ": empty list");
  return out;
}

// The scratch file: created in the directory, removed however the run ends.
class scratch_file {
 public:
  explicit scratch_file(const std::string& dir) : path_(dir + "/.tierflow-tune-" + std::to_string(::getpid())) {}
  ~scratch_file() { ::unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void run(const tune_io_options& opt) {
  (void)io::probe_path(opt.path);  // a clear one-line error for a missing or read-only directory
  const std::uint64_t size = parse_size(opt.size, "--size");
  std::vector<std::size_t> block_sizes;
  for (const std::string& b : split(opt.block_sizes)) block_sizes.push_back(parse_size(b, "--block-sizes"));
  if (block_sizes.empty()) throw user_error("--block-sizes: empty list");
  const std::vector<unsigned> depths = parse_counts(opt.queue_depths, "--queue-depths", 4096);
  const std::vector<unsigned> thread_counts = parse_counts(opt.threads, "--threads", 256);
  if (opt.pattern != "read" && opt.pattern != "write" && opt.pattern != "both") {
    throw user_error("--pattern: '" + opt.pattern + "' is not one of read, write, both");
  }
  const io::backend_kind backend = io::parse_backend(opt.backend, "--backend");
  const bool reads = opt.pattern != "write", writes = opt.pattern != "read";
  const std::string output = opt.output.empty() ? opt.path + "/tierflow-io.json" : opt.output;

  scratch_file scratch(opt.path);
  std::vector<trial> trials;
  const std::size_t total = block_sizes.size() * depths.size() * thread_counts.size();
  progress_bar bar("tune io");
  for (std::size_t b : block_sizes) {
    for (unsigned qd : depths) {
      for (unsigned t : thread_counts) {
        trial tr{b, qd, t};
        io_job job;
        job.path = scratch.path();
        job.size = std::max<std::uint64_t>(size, b);
        job.engine.backend = backend;
        job.engine.block_size = b;
        job.engine.queue_depth = qd;
        job.engine.threads = t;
        if (writes) {
          job.pattern = io_pattern::write;
          tr.write = run_io_job(job).bytes_per_second;
        }
        if (reads) {
          job.pattern = io_pattern::read;
          tr.read = run_io_job(job).bytes_per_second;
        }
        // Both: the harmonic mean, the rate of moving the same bytes out and back.
        tr.score = reads && writes ? 2 / (1 / tr.read + 1 / tr.write) : (reads ? tr.read : tr.write);
        trials.push_back(tr);
        if (!opt.as_json) bar.update(static_cast<double>(trials.size()) / static_cast<double>(total), tr.score);
      }
    }
  }
  bar.finish();
  std::stable_sort(trials.begin(), trials.end(), [](const trial& a, const trial& b) { return a.score > b.score; });

  const trial& best = trials.front();
  io::engine_config winner;
  winner.backend = backend;
  winner.block_size = best.block_size;
  winner.queue_depth = best.queue_depth;
  winner.threads = best.threads;
  const std::string snippet = io::config_snippet(winner);
  {
    std::ofstream out(output);
    out << snippet;
    if (!out) throw user_error("--output " + output + ": cannot be written");
  }

  if (opt.as_json) {
    nlohmann::ordered_json j;
    j["path"] = opt.path;
    j["pattern"] = opt.pattern;
    j["size"] = size;
    nlohmann::json list = nlohmann::json::array();
    for (const trial& t : trials) {
      list.push_back({{"block_size", t.block_size},
                      {"queue_depth", t.queue_depth},
                      {"threads", t.threads},
                      {"read_bytes_per_second", t.read},
                      {"write_bytes_per_second", t.write},
                      {"score", t.score}});
    }
    j["trials"] = list;
    j["best"] = list.front();
    j["config_path"] = output;
    j["config"] = nlohmann::json::parse(snippet);
    std::cout << j.dump() << '\n';
    return;
  }
  std::printf("tierflow tune io: %s, %s per trial, %zu trials, ranked by %s\n\n", opt.path.c_str(),
              format_bytes(static_cast<double>(size)).c_str(), trials.size(),
              reads && writes ? "the harmonic mean of read and write bandwidth" : (reads ? "read bandwidth" : "write bandwidth"));
  std::printf("  %-4s %-10s %-6s %-8s %-14s %-14s\n", "rank", "block", "depth", "threads", "read", "write");
  for (std::size_t i = 0; i < trials.size() && i < opt.top; ++i) {
    const trial& t = trials[i];
    std::printf("  %-4zu %-10s %-6u %-8u %-14s %-14s\n", i + 1, format_bytes(static_cast<double>(t.block_size)).c_str(),
                t.queue_depth, t.threads, reads ? format_rate(t.read).c_str() : "-",
                writes ? format_rate(t.write).c_str() : "-");
  }
  std::printf("\nwrote %s:\n%s", output.c_str(), snippet.c_str());
}

}  // namespace

void add_tune_io_command(CLI::App& app) {
  auto opt = std::make_shared<tune_io_options>();
  CLI::App* cmd = tune_command(app).add_subcommand(
      "io", "Sweep block size x queue depth x threads in a directory; write the best as a config snippet");
  cmd->add_option("--path", opt->path, "The directory to test in (a scratch file is made and removed)")->required();
  cmd->add_option("--size", opt->size, "Bytes per trial")->capture_default_str();
  cmd->add_option("--block-sizes", opt->block_sizes, "Comma-separated block sizes")->capture_default_str();
  cmd->add_option("--queue-depths", opt->queue_depths, "Comma-separated queue depths")->capture_default_str();
  cmd->add_option("--threads", opt->threads, "Comma-separated thread counts")->capture_default_str();
  cmd->add_option("--pattern", opt->pattern, "read | write | both")->capture_default_str()
      ->check(CLI::IsMember({"read", "write", "both"}));
  cmd->add_option("--backend", opt->backend, "auto | uring | threads")->capture_default_str()
      ->check(CLI::IsMember({"auto", "uring", "threads"}));
  cmd->add_option("--output", opt->output, "Where to write the snippet (default: DIR/tierflow-io.json)");
  cmd->add_option("--top", opt->top, "Rows of the ranking to print")->capture_default_str();
  cmd->add_flag("--json", opt->as_json, "One JSON object on stdout instead of the table");
  cmd->callback([opt] { run(*opt); });
}

}  // namespace tierflow::cli
