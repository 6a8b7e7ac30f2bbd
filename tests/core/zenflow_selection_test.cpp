#include "tierflow/core/zenflow/selection.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>

#include <gtest/gtest.h>

namespace tierflow::zenflow {
namespace {

TEST(ZenflowSelection, ColumnsToKeep) {
  EXPECT_EQ(columns_to_keep(1000, 0.1), 100u);
  EXPECT_EQ(columns_to_keep(1001, 0.1), 101u);  // ceil
  EXPECT_EQ(columns_to_keep(5, 0.01), 1u);      // at least one
  EXPECT_EQ(columns_to_keep(64, 1.0), 64u);
  EXPECT_EQ(columns_to_keep(0, 0.5), 0u);
}

TEST(ZenflowSelection, TopColumnsMatchesAFullSort) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> score(0, 1);
  for (int trial = 0; trial < 50; ++trial) {
    const std::size_t n = 1 + rng() % 500;
    std::vector<float> imp(n);
    for (auto& x : imp) x = std::round(score(rng) * 50) / 50;  // many ties
    const std::size_t k = 1 + rng() % n;
    std::vector<std::uint32_t> idx(n);
    for (std::uint32_t i = 0; i < n; ++i) idx[i] = i;
    std::stable_sort(idx.begin(), idx.end(), [&](auto a, auto b) { return imp[a] > imp[b]; });
    idx.resize(k);
    std::sort(idx.begin(), idx.end());
    EXPECT_EQ(top_columns(imp, k), idx);
  }
}

TEST(ZenflowSelection, NonFiniteScoresRankFirst) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> imp = {1, nan, 3, 2, inf};
  EXPECT_EQ(top_columns(imp, 2), (std::vector<std::uint32_t>{1, 4}));
  EXPECT_EQ(top_columns(imp, 3), (std::vector<std::uint32_t>{1, 2, 4}));
}

// Random refreshes: every column is owned by exactly one side at every step,
// and the reported hand-over is exactly the set difference.
TEST(ZenflowSelection, EveryColumnHasExactlyOneOwnerThroughRandomRefreshes) {
  std::mt19937 rng(11);
  const std::size_t columns = 257;
  column_split split(columns);
  std::set<std::uint32_t> device;  // independent model
  for (int step = 0; step < 300; ++step) {
    std::vector<float> imp(columns);
    for (auto& x : imp) x = static_cast<float>(rng() % 1000);
    const std::size_t k = columns_to_keep(columns, 0.01 + (rng() % 100) / 100.0);
    const auto sel = top_columns(imp, k);
    const auto change = split.refresh(sel);

    const std::set<std::uint32_t> next(sel.begin(), sel.end());
    std::set<std::uint32_t> entering, leaving;
    std::set_difference(next.begin(), next.end(), device.begin(), device.end(),
                        std::inserter(entering, entering.end()));
    std::set_difference(device.begin(), device.end(), next.begin(), next.end(),
                        std::inserter(leaving, leaving.end()));
    EXPECT_EQ(std::set<std::uint32_t>(change.entering.begin(), change.entering.end()), entering);
    EXPECT_EQ(std::set<std::uint32_t>(change.leaving.begin(), change.leaving.end()), leaving);
    device = next;

    std::size_t on_device = 0;
    for (std::uint32_t c = 0; c < columns; ++c) {
      EXPECT_EQ(split.on_device(c), device.contains(c));
      on_device += split.on_device(c);
    }
    EXPECT_EQ(on_device, k);
  }
}

TEST(ZenflowSelection, UpdateTriggerFiresWhenUnimportantMassCatchesUp) {
  update_trigger trigger(4, 0.75);
  // Important mass 10 per step on every weight; unimportant 3, 3, 3, 1 per step.
  const double small[] = {3, 3, 3, 1};
  int steps = 0;
  while (!trigger.due()) {
    for (std::size_t w = 0; w < 4; ++w) trigger.observe(w, 10, small[w]);
    ++steps;
    ASSERT_LT(steps, 100);
  }
  EXPECT_EQ(steps, 4);  // three of four weights reach 12 ≥ 10 after four steps
  trigger.reset();
  EXPECT_FALSE(trigger.due());
}

}  // namespace
}  // namespace tierflow::zenflow
