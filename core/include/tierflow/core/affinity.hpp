// Splitting the CPUs this process may use between the trainer and the CPU
// optimizer (ZenFlow's pt_reserved_cores_perc), and pinning threads to them.
#pragma once

#include <span>
#include <thread>
#include <vector>

namespace tierflow {

struct core_split {
  std::vector<int> trainer;    // CPUs left to the trainer (its Python thread, data loading)
  std::vector<int> optimizer;  // CPUs for the optimizer's threads
};

// The CPUs of this process' affinity mask, the first `reserved_share` of them
// (rounded, at least one when there are two or more) for the trainer and the
// rest for the optimizer. With one CPU both get it. Throws user_error for a
// share outside [0, 1).
core_split split_cores(double reserved_share);

// Pins the calling thread to `cpus`. Throws tierflow::error when the kernel
// refuses (naming the CPUs).
void pin_current_thread(std::span<const int> cpus);

// Pins another thread of this process (a std::thread's native handle).
void pin_thread(std::thread::native_handle_type thread, std::span<const int> cpus);

// The CPUs the calling thread may run on.
std::vector<int> current_affinity();

}  // namespace tierflow
