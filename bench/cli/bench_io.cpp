// `tierflow bench io`: the peer of fio and DeepSpeed's ds_io — moves a file's
// blocks through tierflow's io::engine at a given block size and queue depth
// and reports bandwidth, IOPS and latency percentiles (bench/io_vs_fio.sh runs
// it beside fio on the same file).
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "io_runner.hpp"
#include "tierflow/core/units.hpp"

namespace tierflow::cli {
namespace {

struct bench_io_options {
  std::string path;
  std::string size = "1G";
  std::string io_size;
  std::string block_size = "1M";
  unsigned queue_depth = 32;
  std::string pattern = "read";
  unsigned threads = 1;
  bool buffered = false;
  std::string backend = "auto";
  bool sqpoll = false;
  unsigned submit_batch = 8;
  bool no_register = false;
  std::string config;
  bool as_json = false;
};

std::string latency(double us) {
  char text[32];
  if (us >= 1000) std::snprintf(text, sizeof text, "%.2f ms", us / 1000);
  else std::snprintf(text, sizeof text, "%.1f us", us);
  return text;
}

void run(const bench_io_options& opt, const CLI::App& cmd) {
  io_job job;
  // A config snippet (from `tierflow tune io`) sets the defaults; flags given win.
  if (!opt.config.empty()) job.engine = io::read_config(opt.config);
  auto given = [&](const char* flag) { return cmd.count(flag) > 0 || opt.config.empty(); };
  job.path = opt.path;
  job.size = parse_size(opt.size, "--size");
  job.io_size = opt.io_size.empty() ? 0 : parse_size(opt.io_size, "--io-size");
  if (given("--block-size")) job.engine.block_size = parse_size(opt.block_size, "--block-size");
  if (given("--queue-depth")) job.engine.queue_depth = opt.queue_depth;
  if (given("--threads")) job.engine.threads = opt.threads;
  if (given("--backend")) job.engine.backend = io::parse_backend(opt.backend, "--backend");
  if (given("--sqpoll")) job.engine.sqpoll = opt.sqpoll;
  if (given("--submit-batch")) job.engine.submit_batch = opt.submit_batch;
  job.pattern = parse_pattern(opt.pattern, "--pattern");
  job.buffered = opt.buffered;
  job.register_memory = !opt.no_register;

  progress_bar bar(std::string("bench io ") + to_string(job.pattern));
  if (!opt.as_json) job.progress = [&bar](double f, double rate) { bar.update(f, rate); };
  const io_result r = run_io_job(job);
  bar.finish();

  if (opt.as_json) {
    nlohmann::ordered_json j;
    j["pattern"] = to_string(r.pattern);
    j["bytes"] = r.bytes;
    j["seconds"] = r.seconds;
    j["bytes_per_second"] = r.bytes_per_second;
    j["iops"] = r.iops;
    j["latency_us"] = {{"p50", r.p50_us}, {"p99", r.p99_us}};
    j["block_size"] = job.engine.block_size;
    j["queue_depth"] = job.engine.queue_depth;
    j["threads"] = job.engine.threads;
    j["backend"] = io::to_string(r.backend);
    j["direct"] = r.direct;
    std::cout << j.dump() << '\n';
    return;
  }
  std::printf("tierflow bench io: %s %s, %s in %s blocks, queue depth %u, %u thread(s), %s\n",
              to_string(r.pattern), job.path.c_str(), format_bytes(static_cast<double>(r.bytes)).c_str(),
              format_bytes(static_cast<double>(job.engine.block_size)).c_str(), job.engine.queue_depth,
              job.engine.threads, r.direct ? "O_DIRECT" : "page cache");
  std::printf("engine: %s\n\n", r.engine.c_str());
  auto row = [](const char* key, const std::string& value) { std::printf("  %-14s %s\n", key, value.c_str()); };
  row("bytes", format_bytes(static_cast<double>(r.bytes)));
  row("seconds", std::to_string(r.seconds));
  row("bandwidth", format_rate(r.bytes_per_second));
  row("iops", std::to_string(static_cast<std::uint64_t>(r.iops + 0.5)));
  row("latency p50", latency(r.p50_us));
  row("latency p99", latency(r.p99_us));
}

}  // namespace

void add_bench_io_command(CLI::App& app) {
  auto opt = std::make_shared<bench_io_options>();
  CLI::App* cmd = bench_command(app).add_subcommand(
      "io", "Measure file I/O through tierflow's engine (the peer of fio and ds_io)");
  cmd->add_option("--path", opt->path, "The file to use (created and laid out when missing or smaller)")->required();
  cmd->add_option("--size", opt->size, "Region of the file to use, e.g. 1G (K/M/G suffixes)")->capture_default_str();
  cmd->add_option("--io-size", opt->io_size, "Bytes to move (default: --size), e.g. for short random runs");
  cmd->add_option("--block-size", opt->block_size, "Bytes per request, a multiple of 4K")->capture_default_str();
  cmd->add_option("--queue-depth", opt->queue_depth, "Requests in flight per thread")->capture_default_str()
      ->check(CLI::Range(1u, 4096u));
  cmd->add_option("--pattern", opt->pattern, "read | write | randread | randwrite")->capture_default_str()
      ->check(CLI::IsMember({"read", "write", "randread", "randwrite"}));
  cmd->add_option("--threads", opt->threads, "Worker threads (one io_uring each)")->capture_default_str()->check(CLI::Range(1u, 256u));
  cmd->add_flag("--buffered", opt->buffered, "Through the page cache instead of O_DIRECT");
  cmd->add_option("--backend", opt->backend, "auto | uring | threads")->capture_default_str()
      ->check(CLI::IsMember({"auto", "uring", "threads"}));
  cmd->add_flag("--sqpoll", opt->sqpoll, "io_uring: a kernel thread polls the submission queue");
  cmd->add_option("--submit-batch", opt->submit_batch,
                  "io_uring: SQEs handed to the kernel at a time while refilling the queue (0: all at once)")
      ->capture_default_str()
      ->check(CLI::Range(0u, 4096u));
  cmd->add_flag("--no-register", opt->no_register, "Do not register the buffers and the file with the rings");
  cmd->add_option("--config", opt->config, "Engine settings from a config snippet (tierflow tune io writes one)");
  cmd->add_flag("--json", opt->as_json, "One JSON object on stdout instead of the table");
  cmd->callback([opt, cmd] { run(*opt, *cmd); });
}

}  // namespace tierflow::cli
