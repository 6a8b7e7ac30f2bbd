// The training steps of one `tierflow bench offload` run, on one kind of
// device. run_offload() sets up the store, the optimizer and the state, then
// hands the steps to the device's loop:
//   simulate_steps: a device timeline modelled from sim_device, anchored to
//                   the wall clock (sim_steps.cpp);
//   cuda_steps:     a CUDA GPU running the model's matmuls through cuBLAS,
//                   with real copies over its PCIe link (cuda_steps.cpp).
// Either way the host's work (the optimizer, the NVMe I/O, ZenFlow's
// accumulation) runs for real, and the device's waiting is the stall.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "offload/plan.hpp"
#include "offload/run.hpp"
#include "tierflow/core/zenflow/engine.hpp"

namespace tierflow::bench {

using offload_clock = std::chrono::steady_clock;

inline offload_clock::duration span_of(double seconds) {
  return std::chrono::duration_cast<offload_clock::duration>(std::chrono::duration<double>(seconds));
}
inline double seconds_between(offload_clock::time_point a, offload_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct trace_event {
  std::string name;
  std::string track;  // one of trace_tracks()
  offload_clock::time_point start;
  double seconds;
};

// The trace's tracks: the device, the host's work, the device's stalls.
inline constexpr const char* device_track = "device";
inline constexpr const char* host_track = "host";
inline constexpr const char* stall_track = "stall";

// What run_offload gives a device's loop.
struct step_loop_inputs {
  const offload_plan& plan;
  zenflow::update_rule& rule;               // the optimizer arithmetic (optim's AdamW or Muon)
  zenflow::host_state* host_state = nullptr;  // zenflow: the host's master and state, in the store
  std::span<const float> gradient;          // the fixed gradient the host side works with
  float initial_parameter = 0.02f;          // every master value's start (the store holds the same)
  // sync and pipelined: the whole optimizer step over the streamed state.
  std::function<std::chrono::nanoseconds()> optimizer_step;
};

struct step_loop_output {
  std::string device_description;  // one line: the model stated, or the GPU measured
  std::vector<step_record> steps;
  std::vector<trace_event> events;
  std::vector<double> optimizer_seconds;  // each whole optimizer step (sync, pipelined)
  std::uint64_t d2h_bytes = 0, h2d_bytes = 0;
  double compute_seconds = 0;  // device compute per step: modelled, or the measured mean
  double drain_seconds = 0;    // after the last step: the last optimizer work finishing
  std::optional<zenflow::engine_stats> engine_stats;
};

step_loop_output simulate_steps(const step_loop_inputs& in);

// Throws user_error in a build without CUDA, or when the device cannot hold
// the run; tierflow::error for a failed CUDA or cuBLAS call.
step_loop_output cuda_steps(const step_loop_inputs& in);

}  // namespace tierflow::bench
