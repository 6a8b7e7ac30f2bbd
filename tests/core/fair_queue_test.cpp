// The link's queue: demand strictly first, background classes by weight,
// idle classes banking no credit.
#include "tierflow/core/fair_queue.hpp"

#include <gtest/gtest.h>

#include <map>

namespace tierflow {
namespace {

TEST(fair_queue, demand_goes_before_everything_queued_earlier) {
  fair_queue<int> q;
  q.push(traffic_class::optimizer_stream, 1 << 20, 1);
  q.push(traffic_class::writeback, 1 << 20, 2);
  q.push(traffic_class::prefetch, 1 << 20, 3);
  q.push(traffic_class::demand, 1 << 20, 4);
  traffic_class cls{};
  EXPECT_EQ(q.pop(true, cls), 4);
  EXPECT_EQ(cls, traffic_class::demand);
  EXPECT_EQ(q.size(), 3u);
}

TEST(fair_queue, background_is_held_back_when_not_allowed) {
  fair_queue<int> q;
  q.push(traffic_class::prefetch, 4096, 1);
  traffic_class cls{};
  EXPECT_FALSE(q.pop(false, cls).has_value());
  q.push(traffic_class::demand, 4096, 2);
  EXPECT_EQ(q.pop(false, cls), 2);
  EXPECT_EQ(q.pop(true, cls), 1);
  EXPECT_TRUE(q.empty());
}

TEST(fair_queue, backlogged_background_classes_share_by_weight) {
  fair_queue<int> q;  // weights 8 : 4 : 2
  for (int i = 0; i < 700; ++i) {
    q.push(traffic_class::prefetch, 1 << 20, 1);
    q.push(traffic_class::writeback, 1 << 20, 2);
    q.push(traffic_class::optimizer_stream, 1 << 20, 3);
  }
  std::map<traffic_class, int> served;
  traffic_class cls{};
  for (int i = 0; i < 700; ++i) {
    ASSERT_TRUE(q.pop(true, cls).has_value());
    ++served[cls];
  }
  EXPECT_NEAR(served[traffic_class::prefetch], 400, 2);
  EXPECT_NEAR(served[traffic_class::writeback], 200, 2);
  EXPECT_NEAR(served[traffic_class::optimizer_stream], 100, 2);
}

TEST(fair_queue, an_idle_class_banks_no_credit) {
  fair_queue<int> q;
  traffic_class cls{};
  // Write-back alone for a long time...
  for (int i = 0; i < 100; ++i) q.push(traffic_class::writeback, 1 << 20, 2);
  for (int i = 0; i < 100; ++i) q.pop(true, cls);
  // ...then both backlogged: prefetch must not have fallen "behind" meanwhile
  // to the point of starving write-back.
  for (int i = 0; i < 30; ++i) {
    q.push(traffic_class::writeback, 1 << 20, 2);
    q.push(traffic_class::optimizer_stream, 1 << 20, 3);
  }
  std::map<traffic_class, int> served;
  for (int i = 0; i < 30; ++i) {
    q.pop(true, cls);
    ++served[cls];
  }
  EXPECT_NEAR(served[traffic_class::writeback], 20, 2);
  EXPECT_NEAR(served[traffic_class::optimizer_stream], 10, 2);
}

}  // namespace
}  // namespace tierflow
