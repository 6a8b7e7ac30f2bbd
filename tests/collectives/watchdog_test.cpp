// The watchdog that polls the NCCL backend's collectives nobody waits for
// on the host: it checks while armed, sleeps from the first "nothing
// outstanding" until the next arm(), takes no lock of its own while
// checking (arm() may be called under the lock the check takes), survives
// a check that throws, and stops at once whatever its period.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "tierflow/collectives/watchdog.hpp"

namespace tc = tierflow::collectives;
using namespace std::chrono_literals;

namespace {

// Waits up to 5 s for `ready()`.
template <typename Ready>
bool eventually(Ready ready) {
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

TEST(Watchdog, ChecksWhileSomethingIsOutstandingThenSleepsUntilArmedAgain) {
  std::atomic<int> outstanding{0}, calls{0};
  tc::watchdog dog("test-watch", 2ms, [&] {
    calls.fetch_add(1);
    if (outstanding.load() > 0) outstanding.fetch_sub(1);
    return outstanding.load() > 0;
  });
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(calls.load(), 0) << "never armed: never checks";

  outstanding = 5;
  dog.arm();
  // One check a piece of work, the last one seeing nothing left.
  ASSERT_TRUE(eventually([&] { return outstanding.load() == 0 && dog.checks() == 5; })) << dog.checks();
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(dog.checks(), 5u) << "nothing outstanding: asleep, not polling";
  EXPECT_EQ(calls.load(), 5);

  outstanding = 2;
  dog.arm();
  ASSERT_TRUE(eventually([&] { return dog.checks() == 7; })) << dog.checks();
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(dog.checks(), 7u);
}

TEST(Watchdog, ChecksAboutOnceAPeriod) {
  std::atomic<int> calls{0};
  tc::watchdog dog("test-watch", 20ms, [&] {
    calls.fetch_add(1);
    return true;
  });
  dog.arm();
  std::this_thread::sleep_for(200ms);
  dog.stop();
  // About ten; a loaded machine checks less often, never more.
  EXPECT_GE(calls.load(), 2);
  EXPECT_LE(calls.load(), 11);
}

TEST(Watchdog, ArmUnderTheLockTheCheckTakesDoesNotDeadlock) {
  std::mutex m;
  std::atomic<int> calls{0};
  tc::watchdog dog("test-watch", 1ms, [&] {
    std::lock_guard lock(m);
    calls.fetch_add(1);
    return true;
  });
  for (int i = 0; i < 2000; ++i) {  // as the NCCL backend does: a collective recorded under its mutex
    std::lock_guard lock(m);
    dog.arm();
  }
  ASSERT_TRUE(eventually([&] { return calls.load() >= 3; }));
}

TEST(Watchdog, ACheckThatThrowsIsLoggedAndCheckedAgain) {
  std::atomic<int> calls{0};
  tc::watchdog dog("test-watch", 1ms, [&]() -> bool {
    if (calls.fetch_add(1) < 2) throw std::runtime_error("the device is gone");
    return false;
  });
  testing::internal::CaptureStderr();
  dog.arm();
  ASSERT_TRUE(eventually([&] { return dog.checks() == 3; }));
  dog.stop();
  const std::string logged = testing::internal::GetCapturedStderr();
  EXPECT_NE(logged.find("watchdog check: the device is gone"), std::string::npos) << logged;
  EXPECT_EQ(calls.load(), 3);
}

TEST(Watchdog, StopsAtOnceWhateverItsPeriod) {
  tc::watchdog dog("test-watch", 1h, [] { return true; });
  dog.arm();
  ASSERT_TRUE(eventually([&] { return dog.checks() == 1; }));
  const auto t0 = std::chrono::steady_clock::now();
  dog.stop();
  dog.stop();  // idempotent
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
}

}  // namespace
