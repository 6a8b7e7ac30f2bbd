// Where an optimizer step runs: how many CPU threads and which SIMD target.
//
// The trainer keeps some cores for itself, so the caller sets the number of
// threads; every optimizer step runs inside this executor's oneTBB arena and
// never on more threads. The SIMD target is probed at run time (Highway's
// dynamic dispatch): one binary runs AVX-512, AVX2, SSE4 or the portable
// scalar path on x86-64, SVE or NEON on ARM.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <oneapi/tbb/task_arena.h>

#include "tierflow/optim/tensor.hpp"

namespace tierflow::optim {

// The SIMD targets compiled into this binary and usable on this CPU, best
// first, named "avx512-bf16", "avx512", "avx2", "sse4", "scalar" (x86-64) or
// "sve2", "sve", "neon", "scalar" (ARM). "scalar" (portable 128-bit
// emulation) is always there. "avx512-bf16" (a CPU with AVX-512 BF16) is
// "avx512" with bf16 written by VCVTNEPS2BF16: one instruction instead of
// integer rounding, the same results except that subnormal values become
// signed zero (choose "avx512" for torch's rounding of those too).
std::vector<std::string> simd_targets();

class executor {
 public:
  // `threads` >= 1 worker threads (the calling thread counts as one of them).
  // `simd` is "auto" (the best of simd_targets()) or one of its names.
  // `cpus`, when given, are the CPUs the optimizer may use (split_cores's
  // optimizer share): each pool thread that joins the arena pins itself to
  // one of them, a different one per arena slot. The calling thread is the
  // caller's to place (ZenFlow's engine pins its CPU-step thread to the same
  // CPUs). Throws user_error for threads < 1, a target not in simd_targets(),
  // or a CPU this process may not run on.
  explicit executor(int threads = 1, std::string_view simd = "auto", std::vector<int> cpus = {});
  ~executor();
  executor(const executor&) = delete;
  executor& operator=(const executor&) = delete;

  int threads() const noexcept { return threads_; }
  // The chosen target's name, as simd_targets() spells it.
  const std::string& simd() const noexcept { return simd_name_; }

  // Runs `body` inside the arena (so nested parallel loops use at most
  // threads() threads). For the optimizers; usable by a scheduler too.
  template <class Body>
  decltype(auto) run(Body&& body) {
    return arena_.execute(std::forward<Body>(body));
  }

  // The Highway target bit; for the kernels (optim/src).
  std::int64_t target() const noexcept { return target_; }

  // The CPUs the pool threads are pinned to (empty: not pinned).
  const std::vector<int>& cpus() const noexcept { return cpus_; }
  // How many times a pool thread could not pin itself (the kernel refused);
  // 0 when every entry was pinned. Reported, never thrown from a pool thread.
  std::uint64_t pin_failures() const noexcept;

 private:
  class pin_observer;

  int threads_;
  std::int64_t target_;
  std::string simd_name_;
  std::vector<int> cpus_;
  tbb::task_arena arena_;
  std::unique_ptr<pin_observer> observer_;  // after arena_: stops observing before the arena goes
};

// Writes zeros over `buffer` with the executor's threads, in the same
// element-range-to-thread partition the optimizer steps use, so that on a
// multi-socket host each page is first touched (and so placed) on the NUMA
// node of the thread that will stream it. Call once, right after allocating
// the sub-group's buffers and before the first step.
void first_touch(executor& ex, tensor_ref buffer);

}  // namespace tierflow::optim
