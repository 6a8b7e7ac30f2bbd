// The training steps of one `tierflow bench offload` run. run_offload()
// (run.cpp) sets up the store, the optimizer and the state; run_steps() is
// the trainer's loop, the same for every device; a device_timeline is the
// device it drives:
//   make_sim_timeline:  a device modelled from sim_device, anchored to the
//                       wall clock (sim_steps.cpp);
//   make_cuda_timeline: a CUDA GPU running the model's matmuls through
//                       cuBLAS, with real copies over its PCIe link
//                       (cuda_steps.cpp).
// Either way the host's work (the optimizer, the NVMe I/O, ZenFlow's
// accumulation) runs for real, and the device's waiting is the stall.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
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

// One step as the device ran it: its forward and backward, then the device
// time ZenFlow's device side took after it (a window applied, the selected
// columns updated), before the next step could start.
struct step_span {
  offload_clock::time_point start, end;
  double side_seconds = 0;
};

// What a device's timeline gives back once its work is done.
struct device_timeline_result {
  std::vector<step_span> spans;          // one per step run
  offload_clock::time_point next_start;  // when the step after the last could have started
  std::uint64_t d2h_bytes = 0, h2d_bytes = 0;
  double compute_seconds = 0;  // device compute per step: modelled, or the measured mean
  std::string description;     // one line: the model stated, or the GPU measured
};

// A device as a trainer drives it, in the order the trainer issues its work.
// Called from the trainer's thread, except zenflow_device()'s stage_upload
// (the engine's CPU-step thread).
class device_timeline {
 public:
  virtual ~device_timeline() = default;
  // Step s's forward and backward, after everything issued for the device
  // before: the parameters sent up (baselines), the device side's work (zenflow).
  virtual void launch(std::uint64_t s) = 0;
  // Marks where step s would start if launched now, without running it: the
  // end of the run's measured span (s is the step after the last).
  virtual void mark_next_start(std::uint64_t s) = 0;
  // Baselines: step s's gradient went down while its last backward ran;
  // returns once all of it is in host memory.
  virtual void receive_gradient(std::uint64_t s) = 0;
  // Baselines: every updated parameter goes up; the next launch waits for it.
  virtual void send_parameters() = 0;
  // ZenFlow: the engine's device side.
  virtual zenflow::device_side& zenflow_device() = 0;
  // ZenFlow: device work issued from here on runs after step s's backward.
  virtual void order_after_backward(std::uint64_t s) = 0;
  // ZenFlow: brackets the device side's update after step s (update_device()).
  virtual void begin_side(std::uint64_t s) = 0;
  virtual void end_side(std::uint64_t s) = 0;
  // Waits for the device's work and reads its timeline back.
  virtual device_timeline_result finish() = 0;
};

std::unique_ptr<device_timeline> make_sim_timeline(const offload_plan& plan, std::span<const float> gradient);

// Throws user_error in a build without CUDA, or when the device cannot hold
// the run; tierflow::error for a failed CUDA or cuBLAS call.
std::unique_ptr<device_timeline> make_cuda_timeline(const offload_plan& plan, std::span<const float> gradient,
                                                    float initial_parameter);

// What run_steps needs from the run's set-up.
struct step_loop_inputs {
  const offload_plan& plan;
  zenflow::update_rule& rule;                 // the optimizer arithmetic (optim's AdamW or Muon)
  zenflow::host_state* host_state = nullptr;  // zenflow: the host's master and state, in the store
  // zero-offload, zero-infinity: the whole optimizer step over the state.
  std::function<std::chrono::nanoseconds()> optimizer_step;
};

struct step_loop_output {
  std::vector<step_record> steps;
  std::vector<trace_event> events;
  std::vector<double> optimizer_seconds;  // each whole optimizer step (baselines)
  device_timeline_result device;
  double drain_seconds = 0;  // after the measured span: the last window's CPU step, the device's last work
  std::optional<zenflow::engine_stats> engine_stats;
};

// Runs the plan's steps on `device`: the baselines' loop or ZenFlow's, the
// same on every device. Rethrows what the optimizer, the I/O or the device threw.
step_loop_output run_steps(const step_loop_inputs& in, device_timeline& device);

// The step records of a timeline. A step runs from its start to the next
// step's start (the last: to when the next could have started), so every
// wait is some step's; its stall is the part of the gap after its compute
// that the device did not spend on its device side's work.
std::vector<step_record> account_steps(const device_timeline_result& timeline);

}  // namespace tierflow::bench
