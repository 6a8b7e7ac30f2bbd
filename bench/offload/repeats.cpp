#include "offload/repeats.hpp"

#include <algorithm>
#include <stdexcept>

namespace tierflow::bench {

spread spread_of(std::span<const double> values) {
  if (values.empty()) throw std::invalid_argument("spread_of: no values");
  std::vector<double> v(values.begin(), values.end());
  std::ranges::sort(v);
  const std::size_t n = v.size();
  return {.median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2, .min = v.front(), .max = v.back()};
}

std::string slowest_step::waited_for() const {
  if (stall_seconds <= 0) return "no wait: compute and the device side's work";
  if (!zenflow) return "the optimizer step and the parameters' upload";
  if (cpu_wait_seconds > 0 && cpu_wait_seconds >= 0.5 * stall_seconds) return "the previous window's CPU step";
  if (refreshed) return "the selection's hand-over";
  if (boundary) return "the host's boundary work (the window handed to the CPU step)";
  return "the host's accumulation of the step's gradient";
}

std::optional<slowest_step> slowest_counted_step(std::span<const step_record> steps, const step_summary& summary,
                                                 bool zenflow) {
  const std::uint64_t begin = summary.warm_up_steps, end = begin + summary.counted_steps;
  const step_record* worst = nullptr;
  for (const auto& rec : steps)
    if (rec.step >= begin && rec.step < end && (!worst || rec.seconds > worst->seconds)) worst = &rec;
  if (!worst) return std::nullopt;
  return slowest_step{.step = worst->step, .seconds = worst->seconds, .compute_seconds = worst->compute_seconds,
                      .stall_seconds = worst->stall_seconds, .host_seconds = worst->host_seconds,
                      .cpu_wait_seconds = worst->cpu_wait_seconds, .boundary = worst->boundary,
                      .refreshed = worst->refreshed, .zenflow = zenflow};
}

over_runs summarize_runs(const strategy_runs& r) {
  if (r.runs.empty()) throw std::invalid_argument("summarize_runs: " + r.strategy + " has no run");
  if (!r.ratios.empty() && r.ratios.size() != r.runs.size())
    throw std::invalid_argument("summarize_runs: " + r.strategy + " has a ratio for some runs only");
  std::vector<double> mean, median, max, max_over_median;
  for (const auto& s : r.runs) {
    mean.push_back(s.step_seconds);
    median.push_back(s.median_step_seconds);
    max.push_back(s.max_step_seconds);
    max_over_median.push_back(s.median_step_seconds > 0 ? s.max_step_seconds / s.median_step_seconds : 0);
  }
  over_runs out{.runs = r.runs.size(),
                .mean_step = spread_of(mean),
                .median_step = spread_of(median),
                .max_step = spread_of(max),
                .max_over_median = spread_of(max_over_median)};
  if (!r.ratios.empty()) out.ratio = spread_of(r.ratios);
  return out;
}

}  // namespace tierflow::bench
