// ZenFlow's device side when the trainer computes on the CPU, over the
// trainer's own buffers: the compute copy of each weight is the trainer's
// fp32 parameter, read and written where it lies, and this step's gradient
// is the trainer's gradient buffer, named again every step (its address may
// change between steps, as a torch parameter's .grad does). Nothing is
// copied to make the device's view.
//
// Both copies are fp32 here, so the compute copy of a device-owned column is
// its master value too: the device keeps only the owned columns' optimizer
// state (packed in ascending column order, as the stand-in does) and
// updates the parameter in place. The host's master values, when they are
// not the parameters themselves (memory_host_state over the parameters, the
// arrangement without overlap_step), go through a staging copy of the
// weight, made on the first upload, so that a CPU step running beside the
// forward never writes what the forward reads.
//
// Layout: the engine's. A 2-D weight of rows × cols is stored column after
// column (column c is elements [c·rows, (c+1)·rows)); a row-major torch
// weight of shape (out, in) is exactly that with rows = in and cols = out,
// so a ZenFlow "column" is one output unit's row of the torch weight.
//
// Threads: stage_upload() may run on the engine's CPU-step thread; it
// touches only the staging copy and reads only the host's master values.
// Everything else runs on the trainer's thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tierflow/core/zenflow/engine.hpp"

namespace tierflow::zenflow {

class cpu_device final : public device_side {
 public:
  // `parameters[w]`: weight w's compute copy (elements() fp32 values, the
  // program's, outliving this object), whose values are the initial master
  // values. A 1-D weight is the device's from the start, its state zero.
  // The arithmetic is `rule` with side::device. Throws user_error for a
  // count or a buffer of the wrong size.
  cpu_device(const std::vector<weight_shape>& weights, update_rule& rule, std::vector<std::span<float>> parameters);

  // This step's gradient of weight `w` (elements() fp32 values): read by
  // every call of the step until engine::step() returns. Throws user_error
  // for a buffer of the wrong size.
  void set_gradient(std::size_t w, std::span<const float> gradient);
  // Forgets every gradient: a step must name them again before it runs.
  void clear_gradients();

  std::span<float> parameters(std::size_t w) { return parameters_[w]; }
  // The columns whose state the device holds (ascending).
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
    std::vector<float> state0, state1;   // columns.size() · rows each
  };
  std::span<const float> gradient(std::size_t w) const;

  const std::vector<weight_shape>& weights_;
  update_rule& rule_;
  std::vector<std::span<float>> parameters_;
  std::vector<std::span<const float>> gradients_;
  // Per weight: empty until an upload's master is not the parameter itself.
  std::vector<std::vector<float>> staging_;
  std::vector<owned> owned_;
};

}  // namespace tierflow::zenflow
