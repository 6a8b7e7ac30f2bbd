// ZenFlow's device side and host state in plain host memory: the device
// stand-in that lets the engine and its tests (the engine's, and the
// convergence test's against AdamW) run for real without a GPU, and the
// simplest host_state. bench offload has its own simulated device; the CUDA
// device is optim::cuda_zenflow_device.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tierflow/core/zenflow/engine.hpp"

namespace tierflow::zenflow {

// The host_state in host memory: its states are vectors, one set per
// weight; its master values are vectors too, or the program's own buffers.
class memory_host_state final : public host_state {
 public:
  // Every buffer its own, zero (the program writes the initial master
  // values through buffers()).
  memory_host_state(const std::vector<weight_shape>& weights, std::size_t state_count);
  // The master values are `master[w]` (elements() each, the program's, used
  // in place and outliving this object) — the trainer's parameters
  // themselves (cpu_device's compute copies) where no CPU step runs while
  // the trainer reads them, that is without overlap_step: the CPU step then
  // updates the host-owned columns where the forward reads them, with
  // nothing to stage. Throws user_error for a buffer of the wrong size.
  memory_host_state(const std::vector<weight_shape>& weights, std::size_t state_count,
                    std::vector<std::span<float>> master);
  void for_each(std::span<const std::size_t> weights,
                const std::function<void(std::size_t, const host_buffers&)>& fn) override;
  host_buffers buffers(std::size_t w);

 private:
  std::vector<std::vector<float>> param_, state0_, state1_;
  std::vector<std::span<float>> master_;  // param_'s, or the program's buffers
};

// The device, in host memory. Per weight it keeps the compute copy (fp32
// here; bf16 on a GPU), this step's gradient (written by the trainer through
// gradient()), the staging area of uploads, and the device-owned columns'
// master values and states, packed column after column in selection order.
// The device-side arithmetic is `rule` with side::device.
class standin_device final : public device_side {
 public:
  standin_device(const std::vector<weight_shape>& weights, update_rule& rule);

  // Sets weight `w`'s initial values (the compute copy, and the master of a
  // 1-D weight, which the device owns from the start). The host_state's
  // master must start from the same values.
  void initialize(std::size_t w, std::span<const float> values);
  // The compute copy of weight `w`: what forward and backward read.
  std::span<float> parameters(std::size_t w) { return compute_[w]; }
  // Where the trainer puts this step's gradient of weight `w`.
  std::span<float> gradient(std::size_t w) { return grad_[w]; }

  // The columns whose master and state the device holds (ascending).
  std::span<const std::uint32_t> owned_columns(std::size_t w) const { return owned_[w].columns; }

  void column_importance(std::size_t w, importance_norm norm, std::span<float> out) override;
  void update_owned(std::size_t w, std::int64_t step) override;
  std::span<const float> download_gradient(std::size_t w) override;
  void stage_upload(std::size_t w, std::span<const column_run> runs, std::span<const float> master) override;
  void apply_staged(std::size_t w, std::span<const column_run> runs) override;
  void hand_over(std::size_t w, std::span<const std::uint32_t> selected, const packed_columns& entering,
                 const packed_columns& leaving) override;
  bool read_owned(std::size_t w, const packed_columns& out) override;
  bool write_owned(std::size_t w, const packed_columns& in) override;

 private:
  struct owned {
    std::vector<std::uint32_t> columns;  // ascending
    std::vector<float> master, state0, state1;  // columns.size() · rows each
  };
  const std::vector<weight_shape>& weights_;
  update_rule& rule_;
  std::vector<std::vector<float>> compute_, grad_, staging_;
  std::vector<owned> owned_;
};

}  // namespace tierflow::zenflow
