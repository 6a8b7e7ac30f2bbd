#include "tierflow/core/affinity.hpp"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "tierflow/core/error.hpp"

namespace tierflow {
namespace {

TEST(Affinity, SplitCoversEveryCpuOnce) {
  const auto cpus = current_affinity();
  ASSERT_FALSE(cpus.empty());
  for (double share : {0.0, 0.25, 0.5, 0.75, 0.99}) {
    const core_split s = split_cores(share);
    EXPECT_FALSE(s.optimizer.empty());
    if (cpus.size() > 1) {
      std::vector<int> all = s.trainer;
      all.insert(all.end(), s.optimizer.begin(), s.optimizer.end());
      std::sort(all.begin(), all.end());
      EXPECT_EQ(all, cpus) << share;
      if (share > 0) {
        EXPECT_FALSE(s.trainer.empty()) << share;
      }
    }
  }
  EXPECT_THROW(split_cores(1.0), user_error);
  EXPECT_THROW(split_cores(-0.1), user_error);
}

TEST(Affinity, PinningAThreadNarrowsItsMask) {
  const auto cpus = current_affinity();
  std::vector<int> seen;
  std::thread t([&] {
    pin_current_thread(std::span(cpus).last(1));
    seen = current_affinity();
  });
  t.join();
  EXPECT_EQ(seen, std::vector<int>{cpus.back()});
  EXPECT_EQ(current_affinity(), cpus);  // other threads keep theirs
  EXPECT_THROW(pin_current_thread(std::vector<int>{CPU_SETSIZE - 1}), error);
  EXPECT_THROW(pin_current_thread(std::vector<int>{-1}), user_error);
}

TEST(Affinity, PinningAnotherThreadNarrowsItsMask) {
  const auto cpus = current_affinity();
  std::mutex m;
  std::condition_variable cv;
  bool pinned = false;
  std::vector<int> seen;
  std::thread t([&] {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return pinned; });
    seen = current_affinity();
  });
  pin_thread(t.native_handle(), std::span(cpus).first(1));
  {
    std::lock_guard lock(m);
    pinned = true;
  }
  cv.notify_all();
  t.join();
  EXPECT_EQ(seen, std::vector<int>{cpus.front()});
  EXPECT_EQ(current_affinity(), cpus);
}

}  // namespace
}  // namespace tierflow
