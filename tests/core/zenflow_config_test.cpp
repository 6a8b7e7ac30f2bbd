#include "tierflow/core/zenflow/config.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tierflow/core/error.hpp"

namespace tierflow::zenflow {
namespace {

using nlohmann::json;

std::string refusal(const json& j) {
  try {
    from_json(j);
  } catch (const user_error& e) {
    return e.what();
  }
  return "";
}

TEST(ZenflowConfig, DefaultsMatchDeepSpeed) {
  const config c = from_json(json::object());
  EXPECT_DOUBLE_EQ(c.topk_ratio, 0.1);
  EXPECT_EQ(c.strategy, select_strategy::automatic);
  EXPECT_FALSE(c.select_interval);
  EXPECT_FALSE(c.update_interval);
  EXPECT_FALSE(c.overlap_step);
  EXPECT_DOUBLE_EQ(c.auto_ratio, 0.99);
  EXPECT_EQ(c.full_warm_up_rounds, 0u);
  EXPECT_DOUBLE_EQ(c.pt_reserved_cores_perc, 0.5);
  EXPECT_EQ(c.norm, importance_norm::l1);
}

TEST(ZenflowConfig, ReadsADeepSpeedSectionAsItIs) {
  const config c = from_json(json::parse(R"({
    "topk_ratio": 0.05, "select_strategy": "step", "select_interval": 300,
    "update_interval": 4, "overlap_step": true, "offload": false,
    "auto_ratio": 0.95, "full_warm_up_rounds": 2, "pt_reserved_cores_perc": 0.25 })"));
  EXPECT_DOUBLE_EQ(c.topk_ratio, 0.05);
  EXPECT_EQ(c.strategy, select_strategy::step);
  EXPECT_EQ(c.select_interval, 300u);
  EXPECT_EQ(c.update_interval, 4u);
  EXPECT_TRUE(c.overlap_step);
  EXPECT_EQ(c.full_warm_up_rounds, 2u);
}

TEST(ZenflowConfig, RefusesBadValuesNamingTheKey) {
  EXPECT_NE(refusal({{"topk_ratio", 0}}).find("zenflow.topk_ratio: 0"), std::string::npos);
  EXPECT_NE(refusal({{"topk_ratio", 1.5}}).find("outside (0, 1]"), std::string::npos);
  EXPECT_EQ(refusal({{"topk_ratio", 1.0}}), "");
  EXPECT_NE(refusal({{"topk_ratio", "x"}}).find("not a number"), std::string::npos);
  EXPECT_NE(refusal({{"select_strategy", "weekly"}}).find("zenflow.select_strategy"), std::string::npos);
  EXPECT_NE(refusal({{"update_interval", 0}}).find("zenflow.update_interval"), std::string::npos);
  EXPECT_NE(refusal({{"topk_rato", 0.1}}).find("unknown key"), std::string::npos);
  EXPECT_NE(refusal({{"select_strategy", "step"}, {"select_interval", 2}, {"update_interval", 4}})
                .find("less than update_interval 4"),
            std::string::npos);
  EXPECT_NE(refusal({{"select_strategy", "step"}}).find("select_interval"), std::string::npos);
  EXPECT_NE(refusal({{"pt_reserved_cores_perc", 1.0}}).find("[0, 1)"), std::string::npos);
  EXPECT_NE(refusal(json::array()).find("expected an object"), std::string::npos);
  // offload: DeepSpeed's default is accepted, true (moments in pinned host
  // memory) is refused rather than ignored.
  EXPECT_EQ(refusal({{"offload", false}}), "");
  EXPECT_NE(refusal({{"offload", true}}).find("zenflow.offload: true is not supported"), std::string::npos);
  EXPECT_NE(refusal({{"offload", 1}}).find("not true or false"), std::string::npos);
}

TEST(ZenflowSchedule, StepStrategyBoundaries) {
  config c;
  c.strategy = select_strategy::step;
  c.select_interval = 8;
  c.update_interval = 4;
  c.full_warm_up_rounds = 2;
  const schedule s = resolve(c);
  // Steps 0, 1: warm-up, full updates. Then windows of 4: steps 5, 9, 13 end one.
  std::vector<std::uint64_t> updates, selects;
  for (std::uint64_t step = 0; step < 18; ++step) {
    if (is_update_boundary(s, step)) updates.push_back(step);
    if (is_select_boundary(s, step)) selects.push_back(step);
  }
  EXPECT_EQ(updates, (std::vector<std::uint64_t>{0, 1, 5, 9, 13, 17}));
  EXPECT_EQ(selects, (std::vector<std::uint64_t>{9, 17}));
  for (auto step : selects) EXPECT_TRUE(is_update_boundary(s, step)) << step;
}

TEST(ZenflowSchedule, EpochStrategyUsesStepsPerEpochAndNeverFreezesWithoutIt) {
  config c;
  c.update_interval = 4;
  c.steps_per_epoch = 50;
  schedule s = resolve(c);
  EXPECT_EQ(s.select_interval, 52u);  // one epoch, rounded up to whole windows
  c.steps_per_epoch.reset();
  s = resolve(c);
  EXPECT_EQ(s.select_interval, 40u);
  EXPECT_NE(s.select_interval_source.find("unknown"), std::string::npos);
  c.update_interval.reset();
  s = resolve(c);
  EXPECT_FALSE(s.update_interval);
  EXPECT_EQ(s.select_interval, 100u);
}

}  // namespace
}  // namespace tierflow::zenflow
