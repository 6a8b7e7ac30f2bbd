// `tierflow bench offload`: a hardware-in-the-loop planner for offloaded
// training. The CPU optimizer and the NVMe I/O run for real on real bytes;
// with --device sim the device's compute and its PCIe link follow a stated
// model, printed with the result; with --device cuda a GPU runs the model's
// matmuls and the copies over its link for real. Strategies, side by side
// when several are given (--strategy zero-offload,zero-infinity,zenflow):
// zero-offload (DeepSpeed's ZeRO-Offload: the gradient offloaded during the
// backward, CPU Adam on every core, the parameters uploaded after; state in
// host memory), zero-infinity (the same with the state swapped from NVMe by
// DeepSpeed's pipelined read and write), zenflow (selective device updates,
// asynchronous windows); ratios are against zero-offload. --repeat N runs
// them all N times, alternating their order, and shows each figure as the
// median over the runs with its range, and each run's slowest step.
#include <charconv>
#include <cstdio>
#include <optional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "offload/plan.hpp"
#include "offload/repeats.hpp"
#include "offload/run.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"

namespace tierflow::cli {
namespace {

using nlohmann::json;

struct offload_flags {
  std::string model = "gpt2-small";
  std::string device = "sim";
  std::string host_memory = "auto";
  std::string nvme_dir;
  std::string optimizer = "adamw";
  std::string strategy = "zenflow";
  std::uint64_t steps = 12;
  unsigned repeat = 1;
  double tflops = 400;
  std::string device_memory = "80G";
  double hbm_gbps = 3350;
  double pcie_gbps = 25;
  double pcie_latency_us = 10;
  std::uint64_t batch_tokens = 65536;
  std::string update_interval = "4";
  std::optional<std::uint64_t> select_interval;
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

// A whole number of steps ≥ 1, or "auto" (nullopt).
std::optional<std::uint64_t> parse_update_interval(const std::string& text) {
  if (text == "auto") return std::nullopt;
  std::uint64_t steps = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), steps);
  if (ec != std::errc() || end != text.data() + text.size() || steps == 0)
    throw user_error("--update-interval: '" + text + "' is not a whole number of steps ≥ 1 or auto");
  return steps;
}

bench::offload_options to_options(const offload_flags& flags) {
  bench::offload_options options;
  options.model = flags.model;
  bench::parse_device(flags.device, options);
  if (options.device == bench::device_kind::cuda && !flags.model_flags_given.empty())
    throw user_error(flags.model_flags_given.front() +
                     ": describes the simulated device; --device cuda measures its own");
  if (flags.host_memory != "auto") options.host_memory = parse_size(flags.host_memory, "--host-memory");
  options.nvme_dir = flags.nvme_dir;
  options.optimizer = bench::parse_optimizer(flags.optimizer);
  options.steps = flags.steps;
  options.device_model.tflops = flags.tflops;
  options.device_model.memory_bytes = parse_size(flags.device_memory, "--device-memory");
  options.device_model.hbm_bytes_per_second = flags.hbm_gbps * 1e9;
  options.device_model.pcie_bytes_per_second = flags.pcie_gbps * 1e9;
  options.device_model.pcie_latency_seconds = flags.pcie_latency_us * 1e-6;
  options.batch_tokens = flags.batch_tokens;
  options.update_interval = parse_update_interval(flags.update_interval);
  options.select_interval = flags.select_interval;
  options.topk_ratio = flags.topk_ratio;
  options.overlap = !flags.no_overlap;
  options.threads = flags.threads;
  options.sub_group_elements = parse_size(flags.sub_group, "--sub-group");
  options.depth = flags.depth;
  options.trace_path = flags.trace;
  return options;
}

json spread_json(const bench::spread& s) { return {{"median", s.median}, {"min", s.min}, {"max", s.max}}; }

json slowest_json(const std::optional<bench::slowest_step>& slow) {
  if (!slow) return nullptr;
  return {{"step", slow->step}, {"seconds", slow->seconds}, {"stall_seconds", slow->stall_seconds},
          {"host_seconds", slow->host_seconds}, {"cpu_wait_seconds", slow->cpu_wait_seconds},
          {"boundary", slow->boundary}, {"refreshed", slow->refreshed}, {"waited_for", slow->waited_for()}};
}

json summary_json(const bench::step_summary& sum) {
  return {{"step_seconds", sum.step_seconds},
          {"warm_up_steps", sum.warm_up_steps},
          {"counted_steps", sum.counted_steps},
          {"windows", sum.windows},
          {"median_step_seconds", sum.median_step_seconds},
          {"max_step_seconds", sum.max_step_seconds},
          {"stall_fraction", sum.stall_fraction},
          {"cpu_wait_per_step_seconds", sum.cpu_wait_per_step_seconds}};
}

json result_json(const bench::offload_plan& plan, const bench::offload_result& result) {
  json steps = json::array();
  for (const auto& step : result.steps) {
    steps.push_back({{"step", step.step}, {"seconds", step.seconds}, {"compute_seconds", step.compute_seconds},
                     {"stall_seconds", step.stall_seconds}, {"host_seconds", step.host_seconds},
                     {"cpu_wait_seconds", step.cpu_wait_seconds}, {"boundary", step.boundary},
                     {"refreshed", step.refreshed}});
  }
  const bool zenflow = plan.options.strategy == bench::strategy::zenflow;
  json out = summary_json(result.summary);
  out.update({{"strategy", result.strategy},
              {"slowest_step", slowest_json(bench::slowest_counted_step(result.steps, result.summary, zenflow))},
              {"model", plan.model.name},
              {"parameters", plan.model.parameters()},
              {"optimizer", bench::to_string(plan.options.optimizer)},
              {"batch_tokens", plan.options.batch_tokens},
              {"device", plan.options.device == bench::device_kind::cuda
                             ? "cuda:" + std::to_string(plan.options.cuda_device)
                             : std::string("sim")},
              {"device_model", result.device_model},
              {"compute_seconds_per_step", result.compute_seconds},
              {"drain_seconds", result.drain_seconds},
              {"bytes", result.bytes},
              {"steps", steps},
              {"state_on_nvme", plan.memory.state_on_nvme},
              {"state_bytes", plan.memory.state_bytes},
              {"host_memory_bytes", plan.host_memory},
              {"host_stream_bytes", plan.memory.stream_tier},
              {"optimizer_threads", plan.optimizer_threads},
              {"optimizer_cpus", result.optimizer_cpus},
              {"trainer_cpus", result.trainer_cpus}});
  if (result.optimizer_step_seconds > 0) {
    out["optimizer_step_seconds"] = result.optimizer_step_seconds;
    out["io_alone_seconds"] = result.io_alone_seconds;
    out["compute_alone_seconds"] = result.compute_alone_seconds;
  }
  if (!result.hideability.empty()) {
    out["window_compute_seconds"] = result.window_compute_seconds;
    out["cpu_step_seconds"] = result.cpu_step_seconds;
    out["host_work_per_step_seconds"] = result.summary.host_work_per_step_seconds;
    out["refreshes"] = result.refreshes;
    out["hideability"] = result.hideability;
  }
  return out;
}

std::string cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (const int c : cpus) out += (out.empty() ? "" : ",") + std::to_string(c);
  return out.empty() ? std::string("-") : out;
}

void print_steps(const bench::offload_result& result) {
  std::printf("  %-6s %10s %10s %10s %10s %10s\n", "step", "seconds", "compute", "stall", "host", "cpu wait");
  for (const auto& step : result.steps) {
    const std::uint64_t first = result.summary.warm_up_steps, end = first + result.summary.counted_steps;
    const bool counted = step.step >= first && step.step < end;
    std::printf("  %-6llu %10.3f %10.3f %10.3f %10.3f %10.3f%s%s\n", static_cast<unsigned long long>(step.step),
                step.seconds, step.compute_seconds, step.stall_seconds, step.host_seconds, step.cpu_wait_seconds,
                step.boundary ? "  update" : "", counted ? "" : "  (not counted)");
  }
}

void print_human(const bench::offload_plan& plan, const bench::offload_result& result) {
  std::printf("\n%s — %s, %s parameters, %s, batch %llu tokens\n", result.strategy.c_str(), plan.model.name.c_str(),
              format_bytes(static_cast<double>(plan.model.parameters())).c_str(),
              bench::to_string(plan.options.optimizer), static_cast<unsigned long long>(plan.options.batch_tokens));
  std::printf("  state %s on %s, streamed through %s of pinned host memory by %u optimizer thread(s)\n",
              format_bytes(static_cast<double>(plan.memory.state_bytes)).c_str(),
              plan.memory.state_on_nvme ? "NVMe" : "the host",
              format_bytes(static_cast<double>(plan.memory.stream_tier)).c_str(), plan.optimizer_threads);
  if (!result.optimizer_cpus.empty())
    std::printf("  optimizer threads pinned to CPUs %s, the trainer's thread to %s (pt_reserved_cores_perc)\n",
                cpu_list(result.optimizer_cpus).c_str(), cpu_list(result.trainer_cpus).c_str());
  print_steps(result);
  const bench::step_summary& summary = result.summary;
  std::printf("  steps %llu-%llu (%llu whole windows): mean step %.3f s (median %.3f, max %.3f), device compute "
              "%.3f s/step, stall fraction %.3f, CPU-step wait %.3f s/step\n",
              static_cast<unsigned long long>(summary.warm_up_steps),
              static_cast<unsigned long long>(summary.warm_up_steps + summary.counted_steps - 1),
              static_cast<unsigned long long>(summary.windows), summary.step_seconds, summary.median_step_seconds,
              summary.max_step_seconds, result.compute_seconds, summary.stall_fraction,
              summary.cpu_wait_per_step_seconds);
  if (result.optimizer_step_seconds > 0) {
    const double bound = std::max(result.io_alone_seconds, result.compute_alone_seconds);
    std::printf("  optimizer step %.3f s = %.2fx max(I/O alone %.3f s, compute alone %.3f s)\n",
                result.optimizer_step_seconds, result.optimizer_step_seconds / bound, result.io_alone_seconds,
                result.compute_alone_seconds);
  }
  if (!result.hideability.empty())
    std::printf("  %s; %llu selection(s), the first among them\n", result.hideability.c_str(),
                static_cast<unsigned long long>(result.refreshes));
  std::printf("  bytes:");
  for (const auto& [link, bytes] : result.bytes)
    std::printf(" %s %s;", link.c_str(), format_bytes(static_cast<double>(bytes)).c_str());
  std::printf("\n  drain after the measured span %.3f s\n", result.drain_seconds);
}

const char* const peer = "zero-offload";  // what every ratio is against

void print_side_by_side(const std::vector<bench::offload_result>& results, const bench::offload_result& base) {
  std::printf("\nside by side (mean step, relative to %s):\n", peer);
  for (const auto& result : results)
    std::printf("  %-14s %8.3f s  %6.2fx  stall %.3f  max/median %.2f\n", result.strategy.c_str(),
                result.summary.step_seconds, result.summary.step_seconds / base.summary.step_seconds,
                result.summary.stall_fraction,
                result.summary.max_step_seconds / result.summary.median_step_seconds);
}

// The trace file of one run: FILE as given for one strategy run once,
// FILE.STRATEGY.json with several strategies, .runR before .json with --repeat.
std::string trace_path_of(const std::string& given, const std::string& strategy, bool several, unsigned repeat,
                          unsigned repeats) {
  if (given.empty() || (!several && repeats == 1)) return given;
  return given + (several ? "." + strategy : "") + (repeats > 1 ? ".run" + std::to_string(repeat + 1) : "") + ".json";
}

void print_run_line(unsigned repeat, unsigned repeats, const bench::offload_result& result) {
  const bench::step_summary& sum = result.summary;
  std::printf("run %u/%u  %-14s mean %.3f s, median %.3f, max %.3f (max/median %.2f)", repeat + 1, repeats,
              result.strategy.c_str(), sum.step_seconds, sum.median_step_seconds, sum.max_step_seconds,
              sum.median_step_seconds > 0 ? sum.max_step_seconds / sum.median_step_seconds : 0.0);
  if (const auto slow = bench::slowest_counted_step(result.steps, sum, result.strategy == "zenflow"))
    std::printf("; slowest step %llu%s: stall %.3f s, %s\n", static_cast<unsigned long long>(slow->step),
                slow->refreshed ? " (boundary, refresh)" : slow->boundary ? " (boundary)" : "", slow->stall_seconds,
                slow->waited_for().c_str());
  else
    std::printf("\n");
  std::fflush(stdout);  // a line as each run ends, not all at the end of a long series
}

std::string spread_text(const bench::spread& s, const char* format) {
  char buffer[96];
  std::string f = std::string(format) + " [" + format + ", " + format + "]";
  std::snprintf(buffer, sizeof buffer, f.c_str(), s.median, s.min, s.max);
  return buffer;
}

void print_over_runs(const std::vector<bench::strategy_runs>& all) {
  std::printf("\nover %zu runs (median over the runs [least, greatest]):\n", all.front().runs.size());
  std::printf("  %-14s %-24s %-24s %-24s %-20s %s\n", "strategy", "mean step s", "median step s", "max step s",
              "max/median", (std::string("vs ") + peer).c_str());
  for (const auto& r : all) {
    const bench::over_runs o = bench::summarize_runs(r);
    std::printf("  %-14s %-24s %-24s %-24s %-20s %s\n", r.strategy.c_str(), spread_text(o.mean_step, "%.3f").c_str(),
                spread_text(o.median_step, "%.3f").c_str(), spread_text(o.max_step, "%.3f").c_str(),
                spread_text(o.max_over_median, "%.2f").c_str(),
                o.ratio ? (spread_text(*o.ratio, "%.2f") + "x").c_str() : "-");
  }
}

json over_runs_json(const std::vector<bench::strategy_runs>& all) {
  json out = json::object();
  for (const auto& r : all) {
    const bench::over_runs o = bench::summarize_runs(r);
    json j = {{"runs", o.runs},
              {"mean_step_seconds", spread_json(o.mean_step)},
              {"median_step_seconds", spread_json(o.median_step)},
              {"max_step_seconds", spread_json(o.max_step)},
              {"max_over_median", spread_json(o.max_over_median)}};
    if (o.ratio) j["step_ratio_vs_zero_offload"] = spread_json(*o.ratio);
    out[r.strategy] = j;
  }
  return out;
}

void run(const offload_flags& flags) {
  const auto strategies = split_list(flags.strategy);
  if (strategies.empty())
    throw user_error("--strategy: give zero-offload, zero-infinity, zenflow or a comma-separated list");
  // Every plan is made (and so every value checked) before any work starts.
  std::vector<bench::offload_plan> plans;
  for (const auto& s : strategies) {
    bench::offload_options options = to_options(flags);
    options.strategy = bench::parse_strategy(s);
    plans.push_back(bench::make_plan(options));
  }
  if (!flags.as_json) std::printf("%s\n", plans[0].device_description.c_str());

  // results[r][i]: repeat r of strategy i. Odd repeats run the strategies in
  // the reverse order, so none always runs first on a fresh disk and CPU.
  const unsigned repeats = flags.repeat;
  const bool several = plans.size() > 1;
  std::vector<std::vector<bench::offload_result>> results(repeats, std::vector<bench::offload_result>(plans.size()));
  json runs = json::array();
  for (unsigned r = 0; r < repeats; ++r) {
    for (std::size_t k = 0; k < plans.size(); ++k) {
      const std::size_t i = r % 2 ? plans.size() - 1 - k : k;
      bench::offload_plan plan = plans[i];
      plan.options.trace_path = trace_path_of(flags.trace, bench::to_string(plan.options.strategy), several, r, repeats);
      bench::offload_result& result = results[r][i] = bench::run_offload(plan);
      if (flags.as_json) {
        runs.push_back(result_json(plan, result));
        if (repeats > 1) runs.back()["repeat"] = r + 1;
      } else if (repeats == 1) {
        print_human(plan, result);
      } else {
        print_run_line(r, repeats, result);
      }
    }
  }
  // The peer's index, if it ran; each strategy's runs with their ratios to it.
  std::optional<std::size_t> base;
  for (std::size_t i = 0; i < plans.size(); ++i)
    if (results[0][i].strategy == peer) base = i;
  std::vector<bench::strategy_runs> per_strategy(plans.size());
  for (std::size_t i = 0; i < plans.size(); ++i) {
    per_strategy[i].strategy = results[0][i].strategy;
    for (unsigned r = 0; r < repeats; ++r) {
      per_strategy[i].runs.push_back(results[r][i].summary);
      if (base && i != *base)
        per_strategy[i].ratios.push_back(results[r][i].summary.step_seconds / results[r][*base].summary.step_seconds);
    }
  }
  if (flags.as_json) {
    if (runs.size() == 1) {
      std::cout << runs[0].dump(2) << '\n';
      return;
    }
    json out = {{"runs", runs}};
    if (repeats > 1) {
      out["repeats"] = repeats;
      out["over_runs"] = over_runs_json(per_strategy);
    }
    for (const auto& r : per_strategy)
      if (!r.ratios.empty()) out["step_ratio_vs_zero_offload"][r.strategy] = bench::summarize_runs(r).ratio->median;
    std::cout << out.dump(2) << '\n';
    return;
  }
  if (repeats > 1) print_over_runs(per_strategy);
  else if (base && several) print_side_by_side(results[0], results[0][*base]);
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
  cmd->add_option("--host-memory", f->host_memory,
                  "Pinned host memory for the run (K/M/G), or auto: what the run needs, if the machine has it")
      ->capture_default_str();
  cmd->add_option("--nvme-dir", f->nvme_dir, "Keep the optimizer state on NVMe files in this directory");
  cmd->add_option("--optimizer", f->optimizer, "adamw|muon")->capture_default_str();
  cmd->add_option("--strategy", f->strategy,
                  "zero-offload (alias sync)|zero-infinity (alias pipelined)|zenflow, or several comma-separated")
      ->capture_default_str();
  cmd->add_option("--steps", f->steps, "Training steps")->capture_default_str();
  cmd->add_option("--repeat", f->repeat,
                  "Run every strategy this many times; print each run's slowest step and the median over the runs")
      ->check(CLI::Range(1u, 1000u))
      ->capture_default_str();
  const CLI::Option* model_flags[] = {
      cmd->add_option("--device-tflops", f->tflops, "Sustained TFLOP/s of the modelled device")->capture_default_str(),
      cmd->add_option("--device-memory", f->device_memory, "Memory of the modelled device")->capture_default_str(),
      cmd->add_option("--hbm-gbps", f->hbm_gbps, "HBM GB/s of the modelled device (ZenFlow's selective update)")
          ->capture_default_str(),
      cmd->add_option("--pcie-gbps", f->pcie_gbps, "PCIe GB/s per direction of the modelled device")
          ->capture_default_str(),
      cmd->add_option("--pcie-latency-us", f->pcie_latency_us, "Per-transfer PCIe latency of the modelled device")
          ->capture_default_str(),
  };
  cmd->add_option("--batch-tokens", f->batch_tokens, "Tokens per step")->capture_default_str();
  cmd->add_option("--update-interval", f->update_interval, "ZenFlow: steps per CPU update window, or auto")
      ->capture_default_str();
  cmd->add_option("--select-interval", f->select_interval,
                  "ZenFlow: steps between selection refreshes (default: two windows; 8 with auto)");
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
