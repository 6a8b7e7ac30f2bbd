// Lock requirements the compiler checks. Under clang (-Wthread-safety) these
// expand to its thread-safety attributes; elsewhere to nothing. Use
// tierflow::mutex with tierflow::lock_guard, or tierflow::unique_lock where
// the lock is released inside its scope or waited on (all annotated), rather
// than std::mutex for state that a TF_GUARDED_BY names.
// scripts/thread_safety.sh runs the analysis.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define TF_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define TF_THREAD_ANNOTATION(x)
#endif

#define TF_CAPABILITY(x) TF_THREAD_ANNOTATION(capability(x))
#define TF_SCOPED_CAPABILITY TF_THREAD_ANNOTATION(scoped_lockable)
#define TF_GUARDED_BY(x) TF_THREAD_ANNOTATION(guarded_by(x))
#define TF_PT_GUARDED_BY(x) TF_THREAD_ANNOTATION(pt_guarded_by(x))
#define TF_REQUIRES(...) TF_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define TF_EXCLUDES(...) TF_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define TF_ACQUIRE(...) TF_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define TF_RELEASE(...) TF_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TF_TRY_ACQUIRE(...) TF_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define TF_NO_THREAD_SAFETY_ANALYSIS TF_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace tierflow {

// std::mutex with the capability attribute, so TF_GUARDED_BY can name it.
class TF_CAPABILITY("mutex") mutex {
 public:
  void lock() TF_ACQUIRE() { m_.lock(); }
  void unlock() TF_RELEASE() { m_.unlock(); }
  bool try_lock() TF_TRY_ACQUIRE(true) { return m_.try_lock(); }
  // The std::mutex beneath, for code the analysis need not follow; waits on
  // a condition variable go through tierflow::unique_lock instead.
  std::mutex& native() { return m_; }

 private:
  std::mutex m_;
};

// A scoped lock the analysis understands.
class TF_SCOPED_CAPABILITY lock_guard {
 public:
  explicit lock_guard(mutex& m) TF_ACQUIRE(m) : m_(m) { m_.lock(); }
  ~lock_guard() TF_RELEASE() { m_.unlock(); }
  lock_guard(const lock_guard&) = delete;
  lock_guard& operator=(const lock_guard&) = delete;

 private:
  mutex& m_;
};

// A scoped lock that may be released and taken again inside its scope, and
// waited on with a std::condition_variable; the analysis follows both (it
// cannot see through a std::unique_lock over mutex::native()).
class TF_SCOPED_CAPABILITY unique_lock {
 public:
  explicit unique_lock(mutex& m) TF_ACQUIRE(m) : lock_(m.native()) {}
  // Releases the mutex if this lock holds it.
  ~unique_lock() TF_RELEASE() {}
  unique_lock(const unique_lock&) = delete;
  unique_lock& operator=(const unique_lock&) = delete;

  void lock() TF_ACQUIRE() { lock_.lock(); }
  void unlock() TF_RELEASE() { lock_.unlock(); }
  // Blocks until `cv` is notified or wakes spuriously: the mutex is released
  // while blocked and held again on return, so the caller loops on its
  // condition (`while (!ready) lock.wait(cv);`), which the analysis then
  // checks with the lock held.
  void wait(std::condition_variable& cv) { cv.wait(lock_); }
  // The same, but returns by `deadline` at the latest.
  void wait_until(std::condition_variable& cv, std::chrono::steady_clock::time_point deadline) {
    cv.wait_until(lock_, deadline);
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace tierflow
