// Lock requirements the compiler checks. Under clang (-Wthread-safety) these
// expand to its thread-safety attributes; elsewhere to nothing. Use
// tierflow::mutex and tierflow::lock_guard (annotated) rather than std::mutex
// for state that a TF_GUARDED_BY names.
#pragma once

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
  // For std::condition_variable; the analysis cannot follow a wait.
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

}  // namespace tierflow
