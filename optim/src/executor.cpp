#include "tierflow/optim/executor.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include <oneapi/tbb/task_scheduler_observer.h>

#include "kernels.hpp"
#include "tiles.hpp"
#include "tierflow/core/affinity.hpp"
#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::optim {

std::vector<std::string> simd_targets() {
  std::vector<std::string> names;
  for (auto& [bits, name] : detail::available_targets()) names.push_back(name);
  return names;
}

namespace {
std::int64_t pick_target(std::string_view simd, std::string& chosen) {
  const auto targets = detail::available_targets();
  TF_ASSERT(!targets.empty(), "Highway reports no usable target");
  if (simd == "auto") {
    chosen = targets.front().second;
    return targets.front().first;
  }
  std::string known;
  for (const auto& [bits, name] : targets) {
    if (name == simd) {
      chosen = name;
      return bits;
    }
    known += (known.empty() ? "" : ", ") + name;
  }
  throw user_error("--simd: '" + std::string(simd) + "' is not available here (choose auto, " +
                   known + ")");
}
}  // namespace

// Pins each pool thread, as it joins the arena, to the CPU of its slot, and
// gives it back its own mask as it leaves: oneTBB's pool threads are shared
// by every arena in the process, so a pin must not outlive the visit. Slots
// are unique among the threads in the arena at one time, so no two pool
// threads share a CPU while both work.
class executor::pin_observer final : public tbb::task_scheduler_observer {
 public:
  pin_observer(tbb::task_arena& arena, const std::vector<int>& cpus)
      : tbb::task_scheduler_observer(arena), cpus_(cpus) {
    observe(true);
  }
  // Stops observing once every pool thread has left the arena: oneTBB calls
  // no exit callback after observe(false), so a thread still inside would
  // keep its pin into the next arena it serves. Idle pool threads leave an
  // arena within milliseconds; the wait gives up after a second (the thread
  // then stays pinned, which is slower elsewhere but correct).
  ~pin_observer() override {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (inside_.load(std::memory_order_acquire) > 0 && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    observe(false);
  }

  void on_scheduler_entry(bool is_worker) override {
    if (!is_worker) return;  // the calling thread is the caller's to place
    inside_.fetch_add(1, std::memory_order_acq_rel);
    const int slot = std::max(0, tbb::this_task_arena::current_thread_index());
    const int cpu = cpus_[static_cast<std::size_t>(slot) % cpus_.size()];
    try {
      saved_mask() = current_affinity();
      pin_current_thread(std::span(&cpu, 1));
    } catch (const std::exception&) {
      saved_mask().clear();
      failures_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void on_scheduler_exit(bool is_worker) override {
    if (!is_worker) return;
    if (!saved_mask().empty()) {
      try {
        pin_current_thread(saved_mask());
      } catch (const std::exception&) {
        failures_.fetch_add(1, std::memory_order_relaxed);
      }
      saved_mask().clear();
    }
    inside_.fetch_sub(1, std::memory_order_acq_rel);
  }

  std::uint64_t failures() const noexcept { return failures_.load(std::memory_order_relaxed); }

 private:
  // The mask a pool thread had before it joined (per thread: a thread is in
  // at most one arena at a time).
  static std::vector<int>& saved_mask() {
    thread_local std::vector<int> mask;
    return mask;
  }

  const std::vector<int>& cpus_;
  std::atomic<std::uint64_t> failures_{0};
  std::atomic<int> inside_{0};  // pool threads in the arena now
};

executor::executor(int threads, std::string_view simd, std::vector<int> cpus)
    : threads_(threads),
      target_(0),
      cpus_(std::move(cpus)),
      arena_(threads >= 1 ? threads : 1, /*reserved_for_masters=*/1) {
  if (threads < 1) throw user_error("threads: must be at least 1, got " + std::to_string(threads));
  target_ = pick_target(simd, simd_name_);
  if (!cpus_.empty()) {
    const std::vector<int> allowed = current_affinity();
    for (const int c : cpus_) {
      if (std::find(allowed.begin(), allowed.end(), c) == allowed.end())
        throw user_error("optimizer CPUs: CPU " + std::to_string(c) + " is not one this process may run on");
    }
    arena_.initialize();
    observer_ = std::make_unique<pin_observer>(arena_, cpus_);
  }
}

executor::~executor() = default;

std::uint64_t executor::pin_failures() const noexcept { return observer_ ? observer_->failures() : 0; }

void first_touch(executor& ex, tensor_ref buffer) {
  if (buffer.size == 0) return;
  if (buffer.data == nullptr) throw user_error("first_touch: null buffer");
  const std::size_t elem = size_of(buffer.type);
  auto* bytes = static_cast<unsigned char*>(buffer.data);
  detail::for_each_tile(ex, buffer.size, [&](std::size_t begin, std::size_t end) {
    std::memset(bytes + begin * elem, 0, (end - begin) * elem);
  });
}

}  // namespace tierflow::optim
