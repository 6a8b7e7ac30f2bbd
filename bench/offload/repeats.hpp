// `tierflow bench offload --repeat N`: the same strategies run N times, and
// what the runs say together. One run can be lucky — a boundary step that
// waited for a slow CPU step in one run may not in the next — so each
// figure is shown as the median over the runs with its range, and each
// run's slowest counted step is named: which step, how long, and what it
// waited for.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "offload/run.hpp"

namespace tierflow::bench {

// The median of some values, and their least and greatest.
struct spread {
  double median = 0, min = 0, max = 0;
};
// Throws std::invalid_argument for no values.
spread spread_of(std::span<const double> values);

// A run's slowest counted step, and what its time was spent on.
struct slowest_step {
  std::uint64_t step = 0;
  double seconds = 0, compute_seconds = 0, stall_seconds = 0, host_seconds = 0, cpu_wait_seconds = 0;
  bool boundary = false, refreshed = false;
  bool zenflow = false;  // ZenFlow's loop; else a baseline's, whose every step ends with the optimizer step
  // One phrase: what the device waited for in that step's gap.
  std::string waited_for() const;
};
// None when the summary counts no step.
std::optional<slowest_step> slowest_counted_step(std::span<const step_record> steps, const step_summary& summary,
                                                 bool zenflow);

// One strategy over the runs: each run's summary and, when the peer ran in
// the same repeat, its mean step over the peer's in that repeat.
struct strategy_runs {
  std::string strategy;
  std::vector<step_summary> runs;
  std::vector<double> ratios;  // empty for the peer itself, or when it did not run
};

struct over_runs {
  std::uint64_t runs = 0;
  spread mean_step, median_step, max_step;
  spread max_over_median;  // each run's max step over its own median
  std::optional<spread> ratio;
};
// Throws std::invalid_argument when `r` holds no run, or ratios for some runs only.
over_runs summarize_runs(const strategy_runs& r);

}  // namespace tierflow::bench
