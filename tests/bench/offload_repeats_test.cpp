// bench offload --repeat's figures over runs, on runs whose answers are known.
#include <stdexcept>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "offload/repeats.hpp"

namespace tierflow::bench {
namespace {

TEST(OffloadRepeats, SpreadIsTheMedianAndTheRange) {
  const std::vector<double> odd = {3, 1, 2}, even = {4, 1, 3, 2}, one = {5};
  const spread a = spread_of(odd), b = spread_of(even), c = spread_of(one);
  EXPECT_DOUBLE_EQ(a.median, 2);
  EXPECT_DOUBLE_EQ(a.min, 1);
  EXPECT_DOUBLE_EQ(a.max, 3);
  EXPECT_DOUBLE_EQ(b.median, 2.5);
  EXPECT_DOUBLE_EQ(c.median, 5);
  EXPECT_DOUBLE_EQ(c.min, 5);
  EXPECT_THROW(spread_of(std::vector<double>{}), std::invalid_argument);
}

// Warm-up steps 0-1, counted 2-5; the slowest step overall (0) is warm-up,
// step 6 is after the last window: neither may be named.
std::vector<step_record> scripted_steps() {
  return {{.step = 0, .seconds = 9.0},
          {.step = 1, .seconds = 1.0, .boundary = true},
          {.step = 2, .seconds = 1.0},
          {.step = 3, .seconds = 2.5, .compute_seconds = 1.0, .stall_seconds = 1.5, .cpu_wait_seconds = 1.4,
           .boundary = true},
          {.step = 4, .seconds = 1.1},
          {.step = 5, .seconds = 1.2, .boundary = true, .refreshed = true},
          {.step = 6, .seconds = 7.0}};
}

TEST(OffloadRepeats, TheSlowestStepIsACountedOneAndSaysWhatItWaitedFor) {
  const auto steps = scripted_steps();
  const step_summary sum = summarize(steps);
  ASSERT_EQ(sum.warm_up_steps, 2u);
  ASSERT_EQ(sum.counted_steps, 4u);
  const auto slow = slowest_counted_step(steps, sum, true);
  ASSERT_TRUE(slow.has_value());
  EXPECT_EQ(slow->step, 3u);
  EXPECT_DOUBLE_EQ(slow->seconds, 2.5);
  EXPECT_TRUE(slow->boundary);
  EXPECT_EQ(slow->waited_for(), "the previous window's CPU step");
  EXPECT_FALSE(slowest_counted_step(steps, step_summary{}, true).has_value());
  // A baseline's every step ends with the whole optimizer step.
  EXPECT_EQ(slowest_counted_step(steps, sum, false)->waited_for(), "the optimizer step and the parameters' upload");
}

TEST(OffloadRepeats, WhatAStepWaitedForFollowsWhereItsStallWent) {
  slowest_step s{.stall_seconds = 0, .zenflow = true};
  EXPECT_EQ(s.waited_for(), "no wait: compute and the device side's work");
  s = {.stall_seconds = 1.0, .cpu_wait_seconds = 0.2, .boundary = true, .refreshed = true, .zenflow = true};
  EXPECT_EQ(s.waited_for(), "the selection's hand-over");
  s = {.stall_seconds = 1.0, .boundary = true, .zenflow = true};
  EXPECT_EQ(s.waited_for(), "the host's boundary work (the window handed to the CPU step)");
  s = {.stall_seconds = 1.0, .zenflow = true};
  EXPECT_EQ(s.waited_for(), "the host's accumulation of the step's gradient");
}

TEST(OffloadRepeats, OverRunsEveryFigureIsTheMedianOfTheRunsWithItsRange) {
  strategy_runs r{.strategy = "zenflow"};
  // Three runs: one with a spike (max 3.0 over a median of 1.0).
  for (const auto& [mean, median, max] : {std::tuple{1.1, 1.0, 1.2}, std::tuple{1.5, 1.0, 3.0},
                                         std::tuple{1.2, 1.1, 1.32}})
    r.runs.push_back({.step_seconds = mean, .median_step_seconds = median, .max_step_seconds = max});
  r.ratios = {0.5, 0.7, 0.6};
  const over_runs o = summarize_runs(r);
  EXPECT_EQ(o.runs, 3u);
  EXPECT_DOUBLE_EQ(o.mean_step.median, 1.2);
  EXPECT_DOUBLE_EQ(o.mean_step.max, 1.5);
  EXPECT_DOUBLE_EQ(o.median_step.median, 1.0);
  EXPECT_DOUBLE_EQ(o.max_step.max, 3.0);
  EXPECT_DOUBLE_EQ(o.max_over_median.max, 3.0);  // the spiking run's, not hidden by the others
  EXPECT_DOUBLE_EQ(o.max_over_median.median, 1.2);
  ASSERT_TRUE(o.ratio.has_value());
  EXPECT_DOUBLE_EQ(o.ratio->median, 0.6);
  EXPECT_DOUBLE_EQ(o.ratio->min, 0.5);

  r.ratios.pop_back();
  EXPECT_THROW(summarize_runs(r), std::invalid_argument);
  EXPECT_THROW(summarize_runs(strategy_runs{.strategy = "zero-offload"}), std::invalid_argument);
  EXPECT_FALSE(summarize_runs(strategy_runs{.strategy = "zero-offload", .runs = {step_summary{}}}).ratio);
}

}  // namespace
}  // namespace tierflow::bench
