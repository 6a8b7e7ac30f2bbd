// Runs one strategy of `tierflow bench offload` on a plan: the CPU optimizer
// and the NVMe I/O for real, on real bytes; the device's compute and its PCIe
// link either from the stated model (--device sim) or on a CUDA GPU (--device
// cuda). The device's waiting for the host is the stall; steps.hpp has the
// two devices' loops.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "offload/plan.hpp"

namespace tierflow::bench {

struct step_record {
  std::uint64_t step = 0;
  double seconds = 0;        // device time of the step: its stall + its compute
  double stall_seconds = 0;  // the device waited for the host
  double host_seconds = 0;   // host work for the step (optimizer, accumulation, ...)
  bool boundary = false;     // an optimizer update ended with this step
};

struct offload_result {
  std::string strategy;
  std::string device_model;  // the stated model or the GPU, one line
  std::vector<step_record> steps;
  std::uint64_t warm_up_steps = 0;  // the first steps, shown but left out of the summary
  double step_seconds = 0;      // mean over the steady state
  double median_step_seconds = 0;
  double max_step_seconds = 0;
  double stall_fraction = 0;
  double drain_seconds = 0;     // after the last step: the last optimizer work finishing
  double compute_seconds = 0;   // device compute per step: modelled (sim) or measured (cuda)
  std::map<std::string, std::uint64_t> bytes;  // per link
  // The optimizer step alone, when it ran as a whole step (sync, pipelined):
  // its mean time, and what I/O alone and compute alone take for the same state.
  double optimizer_step_seconds = 0;
  double io_alone_seconds = 0;
  double compute_alone_seconds = 0;
  // ZenFlow: one window's device compute against its CPU step (with its I/O).
  double window_compute_seconds = 0;
  double cpu_step_seconds = 0;
  double host_work_per_step_seconds = 0;
  // The CPUs the optimizer threads were pinned to (ZenFlow: the share
  // pt_reserved_cores_perc leaves; empty: not pinned) and the trainer's.
  std::vector<int> optimizer_cpus, trainer_cpus;
  std::string hideability;  // one sentence: hideable or not, and what would make it so
  std::string telemetry_json;  // the store's snapshot
};

// Throws tierflow::error for I/O failures (naming the block and file) and
// user_error for a directory that cannot be used.
offload_result run_offload(const offload_plan& plan);

}  // namespace tierflow::bench
