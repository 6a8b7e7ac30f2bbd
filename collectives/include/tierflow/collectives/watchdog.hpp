// A thread that keeps checking on work nobody waits for on the host: the
// NCCL backend's collectives that torch's streams wait for on the GPU
// (nccl_communicator::stream_wait), which no host wait then polls for
// NCCL's asynchronous error or the timeout. Without it a dead peer would
// leave those streams blocked, and the host hung at its next
// synchronization, with no error and no end.
//
// While armed, `check` runs on the watchdog's thread every `period`; it
// returns whether anything is still outstanding, and the watchdog sleeps
// (no wake-ups at all) from the first false until the next arm(). `check`
// takes whatever locks it needs: the watchdog holds none of its own while
// calling it, so arm() may be called with those locks held. An exception
// from `check` is logged and the check goes on: `check` reports failures
// by breaking what it watches, not by throwing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <string_view>
#include <thread>

#include "tierflow/core/thread_annotations.hpp"

namespace tierflow::collectives {

class watchdog {
 public:
  // `name` (a thread's name, 15 characters at most kept) and `check` as above.
  watchdog(std::string_view name, std::chrono::milliseconds period, std::function<bool()> check);
  // stop()s.
  ~watchdog();
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;

  // Something new is outstanding: check from now on until `check` says
  // nothing is. Cheap (a flag and a notify); never blocks on `check`.
  void arm() TF_EXCLUDES(mutex_);
  // Ends the thread, waiting for a check under way; idempotent. Not to be
  // called from `check`.
  void stop() TF_EXCLUDES(mutex_);

  // Checks run so far, for tests.
  unsigned long checks() const TF_EXCLUDES(mutex_);

 private:
  void run() TF_EXCLUDES(mutex_);

  const std::chrono::milliseconds period_;
  const std::function<bool()> check_;
  mutable mutex mutex_;
  std::condition_variable cv_;
  bool armed_ TF_GUARDED_BY(mutex_) = false;
  bool stopping_ TF_GUARDED_BY(mutex_) = false;
  unsigned long checks_ TF_GUARDED_BY(mutex_) = 0;
  std::thread thread_;  // (last: started once the rest is)
};

}  // namespace tierflow::collectives
