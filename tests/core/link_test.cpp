// Links: every transfer runs and completes once; demand never waits behind
// background transfers; counts per class.
#include "tierflow/core/link.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace tierflow {
namespace {

using namespace std::chrono_literals;

// Takes `delay` per transfer and remembers when each started.
class slow_mover final : public mover {
 public:
  explicit slow_mover(std::chrono::milliseconds delay) : delay_(delay) {}
  std::string engine() const override { return "test"; }
  void move(const transfer& t) override {
    if (t.block_name == "boom") throw error(EIO, error_context{"move"}.of_block(t.block_name));
    std::this_thread::sleep_for(delay_);
  }

 private:
  std::chrono::milliseconds delay_;
};

transfer make_transfer(traffic_class cls, std::string name = "b") {
  transfer t;
  t.block_name = std::move(name);
  t.bytes = 4096;
  t.cls = cls;
  return t;
}

TEST(link, demand_never_waits_behind_background) {
  trace_recorder trace;
  link l(tier_kind::nvme, tier_kind::host, std::make_unique<slow_mover>(40ms), 2, &trace);
  std::atomic<int> done{0};
  for (int i = 0; i < 6; ++i)
    l.submit(make_transfer(traffic_class::prefetch), [&](std::exception_ptr) { ++done; });
  std::this_thread::sleep_for(5ms);  // background has taken its engine
  const auto start = std::chrono::steady_clock::now();
  std::mutex m;
  std::condition_variable cv;
  bool demand_done = false;
  l.submit(make_transfer(traffic_class::demand), [&](std::exception_ptr) {
    std::lock_guard lock(m);
    demand_done = true;
    cv.notify_all();
  });
  {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return demand_done; });
  }
  const auto took = std::chrono::steady_clock::now() - start;
  // One transfer's time (40 ms), not the 6 x 40 ms of background ahead of it.
  EXPECT_LT(took, 75ms);
  while (done.load() < 6) std::this_thread::sleep_for(1ms);
  const link_telemetry t = l.telemetry();
  EXPECT_EQ(t.classes[index_of(traffic_class::prefetch)].transfers, 6u);
  EXPECT_EQ(t.classes[index_of(traffic_class::demand)].transfers, 1u);
  EXPECT_EQ(t.transfers, 7u);
  EXPECT_GT(t.busy_ns, 0u);
  EXPECT_EQ(trace.size(), 7u);
}

TEST(link, a_failed_transfer_reports_its_error) {
  link l(tier_kind::host, tier_kind::nvme, std::make_unique<slow_mover>(0ms), 1, nullptr);
  std::mutex m;
  std::condition_variable cv;
  std::exception_ptr seen;
  bool finished = false;
  l.submit(make_transfer(traffic_class::writeback, "boom"), [&](std::exception_ptr e) {
    std::lock_guard lock(m);
    seen = std::move(e);  // the engine thread keeps no reference
    finished = true;
    cv.notify_all();
  });
  std::unique_lock lock(m);
  cv.wait(lock, [&] { return finished; });
  ASSERT_TRUE(seen);
  try {
    std::rethrow_exception(seen);
  } catch (const error& e) {
    EXPECT_EQ(e.context().block, "boom");
  }
}

}  // namespace
}  // namespace tierflow
