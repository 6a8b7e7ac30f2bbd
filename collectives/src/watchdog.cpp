// The watchdog (watchdog.hpp): one thread, asleep unless armed.

#include "tierflow/collectives/watchdog.hpp"

#include <pthread.h>

#include <cstdio>
#include <exception>
#include <string>
#include <utility>

namespace tierflow::collectives {

watchdog::watchdog(std::string_view name, std::chrono::milliseconds period, std::function<bool()> check)
    : period_(period), check_(std::move(check)) {
  thread_ = std::thread([this, n = std::string(name.substr(0, 15))] {
    (void)pthread_setname_np(pthread_self(), n.c_str());
    run();
  });
}

watchdog::~watchdog() { stop(); }

void watchdog::arm() {
  {
    lock_guard lock(mutex_);
    if (armed_) return;
    armed_ = true;
  }
  cv_.notify_one();
}

void watchdog::stop() {
  {
    lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

unsigned long watchdog::checks() const {
  lock_guard lock(mutex_);
  return checks_;
}

void watchdog::run() {
  unique_lock lock(mutex_);
  for (;;) {
    while (!armed_ && !stopping_) lock.wait(cv_);
    if (stopping_) return;
    // Disarmed before the check: an arm() during it (new work) arms it
    // again, and wins over the check's "nothing outstanding" below.
    armed_ = false;
    lock.unlock();
    bool outstanding = true;
    try {
      outstanding = check_();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tierflow: warning: watchdog check: %s\n", e.what());
    }
    lock.lock();
    ++checks_;
    if (outstanding) armed_ = true;
    if (!armed_ || stopping_) continue;
    const auto next = std::chrono::steady_clock::now() + period_;
    while (!stopping_ && std::chrono::steady_clock::now() < next) lock.wait_until(cv_, next);
  }
}

}  // namespace tierflow::collectives
