// `tierflow bench offload`: a hardware-in-the-loop planner for offloaded
// training. The CPU optimizer and the NVMe I/O run for real on real bytes;
// with --device sim the device's compute and its PCIe link follow a stated
// model, printed with the result; with --device cuda a GPU runs the model's
// matmuls and the copies over its link for real. Strategies, side by side
// when several are given (--strategy sync,pipelined,zenflow): sync
// (ZeRO-Offload: the device waits for the whole CPU step), pipelined
// (ZeRO-Infinity's streamed optimizer step), zenflow (selective device
// updates, asynchronous windows).
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "offload/plan.hpp"
#include "offload/run.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"

namespace tierflow::cli {
namespace {

using nlohmann::json;

struct offload_flags {
  std::string model = "gpt2-medium";
  std::string device = "sim";
  std::string host_memory = "2G";
  std::string nvme_dir;
  std::string optimizer = "adamw";
  std::string strategy = "zenflow";
  std::uint64_t steps = 12;
  double tflops = 400;
  std::string device_memory = "80G";
  double pcie_gbps = 25;
  double pcie_latency_us = 10;
  std::uint64_t batch_tokens = 16384;
  std::uint64_t update_interval = 4;
  std::uint64_t select_interval = 0;
  double topk_ratio = 0.1;
  bool no_overlap = false;
  unsigned threads = 0;
  std::string sub_group = "4M";
  unsigned depth = 3;
  std::string trace;
  bool as_json = false;
  std::vector<std::string> model_flags_given;  // the simulated device's flags the user set
};

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

bench::offload_options to_options(const offload_flags& f) {
  bench::offload_options o;
  o.model = f.model;
  bench::parse_device(f.device, o);
  if (o.device == bench::device_kind::cuda && !f.model_flags_given.empty())
    throw user_error(f.model_flags_given.front() + ": describes the simulated device; --device cuda measures its own");
  o.host_memory = parse_size(f.host_memory, "--host-memory");
  o.nvme_dir = f.nvme_dir;
  o.optimizer = bench::parse_optimizer(f.optimizer);
  o.steps = f.steps;
  o.device_model.tflops = f.tflops;
  o.device_model.memory_bytes = parse_size(f.device_memory, "--device-memory");
  o.device_model.pcie_bytes_per_second = f.pcie_gbps * 1e9;
  o.device_model.pcie_latency_seconds = f.pcie_latency_us * 1e-6;
  o.batch_tokens = f.batch_tokens;
  o.update_interval = f.update_interval;
  if (f.select_interval) o.select_interval = f.select_interval;
  o.topk_ratio = f.topk_ratio;
  o.overlap = !f.no_overlap;
  o.threads = f.threads;
  o.sub_group_elements = parse_size(f.sub_group, "--sub-group");
  o.depth = f.depth;
  o.trace_path = f.trace;
  return o;
}

json result_json(const bench::offload_plan& plan, const bench::offload_result& r) {
  json steps = json::array();
  for (const auto& s : r.steps) {
    steps.push_back({{"step", s.step}, {"seconds", s.seconds}, {"stall_seconds", s.stall_seconds},
                     {"host_seconds", s.host_seconds}, {"boundary", s.boundary}});
  }
  json j = {{"strategy", r.strategy},
            {"model", plan.model.name},
            {"parameters", plan.model.parameters()},
            {"optimizer", bench::to_string(plan.options.optimizer)},
            {"device", plan.options.device == bench::device_kind::cuda
                           ? "cuda:" + std::to_string(plan.options.cuda_device)
                           : std::string("sim")},
            {"device_model", r.device_model},
            {"step_seconds", r.step_seconds},
            {"warm_up_steps", r.warm_up_steps},
            {"median_step_seconds", r.median_step_seconds},
            {"max_step_seconds", r.max_step_seconds},
            {"stall_fraction", r.stall_fraction},
            {"compute_seconds_per_step", r.compute_seconds},
            {"drain_seconds", r.drain_seconds},
            {"bytes", r.bytes},
            {"steps", steps},
            {"state_on_nvme", plan.memory.state_on_nvme},
            {"state_bytes", plan.memory.state_bytes},
            {"host_stream_bytes", plan.memory.stream_tier},
            {"optimizer_threads", plan.optimizer_threads},
            {"optimizer_cpus", r.optimizer_cpus},
            {"trainer_cpus", r.trainer_cpus}};
  if (r.optimizer_step_seconds > 0) {
    j["optimizer_step_seconds"] = r.optimizer_step_seconds;
    j["io_alone_seconds"] = r.io_alone_seconds;
    j["compute_alone_seconds"] = r.compute_alone_seconds;
  }
  if (!r.hideability.empty()) {
    j["window_compute_seconds"] = r.window_compute_seconds;
    j["cpu_step_seconds"] = r.cpu_step_seconds;
    j["host_work_per_step_seconds"] = r.host_work_per_step_seconds;
    j["hideability"] = r.hideability;
  }
  return j;
}

void print_human(const bench::offload_plan& plan, const bench::offload_result& r) {
  std::printf("\n%s — %s, %s parameters, %s, batch %llu tokens\n", r.strategy.c_str(), plan.model.name.c_str(),
              format_bytes(static_cast<double>(plan.model.parameters())).c_str(),
              bench::to_string(plan.options.optimizer), static_cast<unsigned long long>(plan.options.batch_tokens));
  std::printf("  state %s on %s, streamed through %s of pinned host memory by %u optimizer thread(s)\n",
              format_bytes(static_cast<double>(plan.memory.state_bytes)).c_str(),
              plan.memory.state_on_nvme ? "NVMe" : "the host",
              format_bytes(static_cast<double>(plan.memory.stream_tier)).c_str(), plan.optimizer_threads);
  if (!r.optimizer_cpus.empty()) {
    auto list = [](const std::vector<int>& cpus) {
      std::string out;
      for (const int c : cpus) out += (out.empty() ? "" : ",") + std::to_string(c);
      return out.empty() ? std::string("-") : out;
    };
    std::printf("  optimizer threads pinned to CPUs %s, the trainer's thread to %s (pt_reserved_cores_perc)\n",
                list(r.optimizer_cpus).c_str(), list(r.trainer_cpus).c_str());
  }
  std::printf("  %-6s %10s %10s %10s\n", "step", "seconds", "stall", "host");
  for (const auto& s : r.steps) {
    std::printf("  %-6llu %10.3f %10.3f %10.3f%s\n", static_cast<unsigned long long>(s.step), s.seconds,
                s.stall_seconds, s.host_seconds, s.boundary ? "  update" : "");
  }
  std::printf("  steps %llu on: mean step %.3f s (median %.3f, max %.3f), device compute %.3f s/step, "
              "stall fraction %.3f\n",
              static_cast<unsigned long long>(r.warm_up_steps), r.step_seconds, r.median_step_seconds,
              r.max_step_seconds, r.compute_seconds, r.stall_fraction);
  if (r.optimizer_step_seconds > 0) {
    const double bound = std::max(r.io_alone_seconds, r.compute_alone_seconds);
    std::printf("  optimizer step %.3f s = %.2fx max(I/O alone %.3f s, compute alone %.3f s)\n",
                r.optimizer_step_seconds, r.optimizer_step_seconds / bound, r.io_alone_seconds,
                r.compute_alone_seconds);
  }
  if (!r.hideability.empty()) std::printf("  %s\n", r.hideability.c_str());
  std::printf("  bytes:");
  for (const auto& [link, bytes] : r.bytes) std::printf(" %s %s;", link.c_str(), format_bytes(static_cast<double>(bytes)).c_str());
  std::printf("\n  drain after the last step %.3f s\n", r.drain_seconds);
}

void run(const offload_flags& flags) {
  const auto strategies = split_list(flags.strategy);
  if (strategies.empty()) throw user_error("--strategy: give sync, pipelined, zenflow or a comma-separated list");
  // Every plan is made (and so every value checked) before any work starts.
  std::vector<bench::offload_plan> plans;
  for (const auto& s : strategies) {
    bench::offload_options o = to_options(flags);
    o.strategy = bench::parse_strategy(s);
    if (strategies.size() > 1 && !o.trace_path.empty()) o.trace_path += "." + s + ".json";
    plans.push_back(bench::make_plan(o));
  }
  if (!flags.as_json) std::printf("%s\n", plans[0].device_description.c_str());

  json runs = json::array();
  std::vector<bench::offload_result> results;
  for (const auto& plan : plans) {
    results.push_back(bench::run_offload(plan));
    if (flags.as_json) runs.push_back(result_json(plan, results.back()));
    else print_human(plan, results.back());
  }
  auto find = [&](const char* name) -> const bench::offload_result* {
    for (const auto& r : results) if (r.strategy == name) return &r;
    return nullptr;
  };
  const auto* sync = find("sync");
  if (flags.as_json) {
    if (runs.size() == 1) {
      std::cout << runs[0].dump(2) << '\n';
      return;
    }
    json out = {{"runs", runs}};
    for (const auto& r : results) {
      if (sync && &r != sync) out["step_ratio_vs_sync"][r.strategy] = r.step_seconds / sync->step_seconds;
    }
    std::cout << out.dump(2) << '\n';
    return;
  }
  if (sync && results.size() > 1) {
    std::printf("\nside by side (mean step, relative to sync):\n");
    for (const auto& r : results)
      std::printf("  %-10s %8.3f s  %6.2fx  stall %.3f\n", r.strategy.c_str(), r.step_seconds,
                  r.step_seconds / sync->step_seconds, r.stall_fraction);
  }
}

}  // namespace

void add_bench_offload_command(CLI::App& app) {
  auto f = std::make_shared<offload_flags>();
  CLI::App* cmd = bench_command(app).add_subcommand(
      "offload", "Offloaded training steps: real CPU optimizer and NVMe I/O, a modelled or a CUDA device");
  cmd->add_option("--model", f->model,
                  "gpt2-small|gpt2-medium|gpt2-large|gpt2-xl|llama-1b|llama-7b|llama-13b or LAYERSxHIDDENxVOCAB")
      ->capture_default_str();
  cmd->add_option("--device", f->device, "sim (a modelled device) or cuda[:N] (a GPU: cuBLAS matmuls, real copies)")
      ->capture_default_str();
  cmd->add_option("--host-memory", f->host_memory, "Pinned host memory for the run (K/M/G)")->capture_default_str();
  cmd->add_option("--nvme-dir", f->nvme_dir, "Keep the optimizer state on NVMe files in this directory");
  cmd->add_option("--optimizer", f->optimizer, "adamw|muon")->capture_default_str();
  cmd->add_option("--strategy", f->strategy, "sync|pipelined|zenflow, or several comma-separated")
      ->capture_default_str();
  cmd->add_option("--steps", f->steps, "Training steps")->capture_default_str();
  const CLI::Option* model_flags[] = {
      cmd->add_option("--device-tflops", f->tflops, "Sustained TFLOP/s of the modelled device")->capture_default_str(),
      cmd->add_option("--device-memory", f->device_memory, "Memory of the modelled device")->capture_default_str(),
      cmd->add_option("--pcie-gbps", f->pcie_gbps, "PCIe GB/s per direction of the modelled device")
          ->capture_default_str(),
      cmd->add_option("--pcie-latency-us", f->pcie_latency_us, "Per-transfer PCIe latency of the modelled device")
          ->capture_default_str(),
  };
  cmd->add_option("--batch-tokens", f->batch_tokens, "Tokens per step")->capture_default_str();
  cmd->add_option("--update-interval", f->update_interval, "ZenFlow: steps per CPU update window")
      ->capture_default_str();
  cmd->add_option("--select-interval", f->select_interval, "ZenFlow: steps between selection refreshes");
  cmd->add_option("--topk-ratio", f->topk_ratio, "ZenFlow: share of columns updated on the device")
      ->capture_default_str();
  cmd->add_flag("--no-overlap", f->no_overlap, "ZenFlow: run the CPU step at the boundary, not overlapped");
  cmd->add_option("--threads", f->threads, "Optimizer threads (default: the cores not reserved for the trainer)");
  cmd->add_option("--sub-group", f->sub_group, "Largest sub-group the optimizer streams, in elements (K/M)")
      ->capture_default_str();
  cmd->add_option("--depth", f->depth, "Sub-groups resident while streaming")->capture_default_str();
  cmd->add_option("--trace", f->trace, "Write a Perfetto / Chrome trace of the run to this file");
  cmd->add_flag("--json", f->as_json, "One JSON object on stdout");
  cmd->callback([f, model_flags] {
    for (const CLI::Option* opt : model_flags)
      if (opt->count() > 0) f->model_flags_given.push_back(opt->get_name());
    run(*f);
  });
}

}  // namespace tierflow::cli
