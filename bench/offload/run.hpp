// Runs one strategy of `tierflow bench offload` on a plan: the CPU optimizer
// and the NVMe I/O for real, on real bytes; the device's compute and its PCIe
// link either from the stated model (--device sim) or on a CUDA GPU (--device
// cuda). The device's waiting for the host is the stall; steps.hpp has the
// trainer's loop and the two devices.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "offload/plan.hpp"

namespace tierflow::bench {

// One step, from its start on the device to the next step's start.
struct step_record {
  std::uint64_t step = 0;
  double seconds = 0;          // its compute, then the gap until the next step started
  double compute_seconds = 0;  // its forward and backward on the device
  double stall_seconds = 0;    // the device idle in that gap, waiting for the host
  double host_seconds = 0;     // host work for the step (optimizer, accumulation, ...)
  double cpu_wait_seconds = 0; // zenflow: the trainer waited this long for a window's CPU step
  bool boundary = false;       // an optimizer update window ended with this step
  bool refreshed = false;      // zenflow: columns changed sides after this step (the first selection too)
};

// The steady state of a run: whole update windows after the first.
struct step_summary {
  std::uint64_t warm_up_steps = 0;  // the first window: shown, not counted
  std::uint64_t counted_steps = 0;  // from there through the last window's boundary
  std::uint64_t windows = 0;        // update windows among the counted steps
  double step_seconds = 0;          // mean
  double median_step_seconds = 0;
  double max_step_seconds = 0;
  double stall_fraction = 0;        // device idle / device time
  double cpu_wait_per_step_seconds = 0;
  double host_work_per_step_seconds = 0;  // mean over the counted steps that end no window
};

// Summarises `steps`: the counted span starts after the first window's
// boundary and ends with the last window's (each step's record holds the
// wait before the next step, so the last window's wait is in). A run with one
// window counts it whole.
step_summary summarize(std::span<const step_record> steps);

struct offload_result {
  std::string strategy;
  std::string device_model;  // the stated model or the GPU, one line
  std::vector<step_record> steps;
  step_summary summary;
  double drain_seconds = 0;     // after the measured span: the last optimizer work finishing
  double compute_seconds = 0;   // device compute per step: modelled (sim) or measured (cuda)
  std::map<std::string, std::uint64_t> bytes;  // per link
  // The optimizer step alone (zero-offload, zero-infinity): its mean time,
  // and what I/O alone and compute alone take for the same state.
  double optimizer_step_seconds = 0;
  double io_alone_seconds = 0;
  double compute_alone_seconds = 0;
  // ZenFlow: one window's device compute against its CPU step (with its I/O).
  double window_compute_seconds = 0;
  double cpu_step_seconds = 0;
  std::uint64_t refreshes = 0;  // selection refreshes, the first selection among them
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
