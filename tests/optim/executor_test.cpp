// The executor's thread placement: pool threads pinned to the CPUs given,
// the caller's thread left alone, and CPUs the process may not use refused.
#include "tierflow/optim/executor.hpp"

#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>
#include <oneapi/tbb/parallel_for.h>

#include "tierflow/core/affinity.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::optim {
namespace {

// Runs a parallel loop of slow iterations in the executor and returns the
// affinity each thread other than the caller had while it worked.
std::map<std::thread::id, std::vector<int>> pool_affinities(executor& ex) {
  std::mutex m;
  std::map<std::thread::id, std::vector<int>> seen;
  const auto caller = std::this_thread::get_id();
  ex.run([&] {
    tbb::parallel_for(0, 8 * ex.threads(), [&](int) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // long enough for the pool to join
      if (std::this_thread::get_id() == caller) return;
      std::lock_guard lock(m);
      seen[std::this_thread::get_id()] = current_affinity();
    });
  });
  return seen;
}

TEST(Executor, PoolThreadsArePinnedToTheGivenCpus) {
  const std::vector<int> all = current_affinity();
  if (all.size() < 2) GTEST_SKIP() << "needs two CPUs to have a pool thread";
  const std::vector<int> mine{all.back()};
  executor ex(2, "auto", mine);
  EXPECT_EQ(ex.cpus(), mine);
  const auto seen = pool_affinities(ex);
  ASSERT_FALSE(seen.empty()) << "no pool thread joined the loop";
  for (const auto& [id, cpus] : seen) EXPECT_EQ(cpus, mine);
  EXPECT_EQ(ex.pin_failures(), 0u);
  EXPECT_EQ(current_affinity(), all);  // the caller's thread is untouched
}

TEST(Executor, WithoutCpusNothingIsPinnedEvenAfterAPinnedExecutorRan) {
  const std::vector<int> all = current_affinity();
  if (all.size() < 2) GTEST_SKIP() << "needs two CPUs to have a pool thread";
  {
    // oneTBB's pool threads serve every arena: the pin must leave with them.
    executor pinned(2, "auto", {all.back()});
    ASSERT_FALSE(pool_affinities(pinned).empty());
  }
  executor ex(2);
  EXPECT_TRUE(ex.cpus().empty());
  for (const auto& [id, cpus] : pool_affinities(ex)) EXPECT_EQ(cpus, all);
}

TEST(Executor, RefusesCpusThisProcessMayNotUse) {
  try {
    executor ex(1, "auto", {CPU_SETSIZE - 1});
    FAIL() << "expected a refusal";
  } catch (const user_error& e) {
    EXPECT_NE(std::string(e.what()).find("CPU " + std::to_string(CPU_SETSIZE - 1)), std::string::npos) << e.what();
  }
  EXPECT_THROW(executor(0), user_error);
}

}  // namespace
}  // namespace tierflow::optim
