// Which columns of each 2-D weight the device updates every step (the
// selected, "important" ones), which the host accumulates and updates every
// window, and when the host's window should close (update_interval "auto").
//
// Weights are stored transposed, so a column is contiguous: column c of a
// rows × cols weight is elements [c*rows, (c+1)*rows) of its flat buffer.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tierflow/core/zenflow/config.hpp"

namespace tierflow::zenflow {

// How many of `columns` a ratio keeps: ceil(ratio · columns), at least one.
std::size_t columns_to_keep(std::size_t columns, double topk_ratio);

// Each column's importance from a gradient stored column after column
// (`rows` elements each, out.size() columns): Σ|g| with l1, Σg² with l2,
// summed in double. What a device side on host memory reports.
void column_norms(std::span<const float> grad, std::uint64_t rows, importance_norm norm, std::span<float> out);

// The `k` columns of highest importance, as ascending column indices. Ties go
// to the lower index, so the answer does not depend on the sort's whims.
// Non-finite scores rank first (a column whose gradient overflowed must be
// looked at on the device, not hidden in the host's window).
std::vector<std::uint32_t> top_columns(std::span<const float> importance, std::size_t k);

// The columns that change hands at a refresh. Either way a column takes its
// master value and optimizer state with it; the engine rebases the state to
// the step count of the side it enters (update_rule::rebase_state).
struct selection_change {
  std::vector<std::uint32_t> entering;  // host → device
  std::vector<std::uint32_t> leaving;   // device → host
};

// One weight's split of its columns between the device and the host. Every
// column is owned by exactly one side at every moment; refresh() moves the
// boundary and says which columns crossed it.
class column_split {
 public:
  // Initially every column is the host's.
  explicit column_split(std::size_t columns);

  // Makes `selected` (ascending, unique, each < columns()) the device's set.
  selection_change refresh(std::span<const std::uint32_t> selected);

  bool on_device(std::uint32_t column) const { return device_[column] != 0; }
  std::size_t columns() const { return device_.size(); }
  std::span<const std::uint32_t> selected() const { return selected_; }

 private:
  std::vector<std::uint8_t> device_;  // 1 when the device owns the column
  std::vector<std::uint32_t> selected_;
};

// update_interval "auto": per weight, a running average of the selected
// columns' gradient mass per step, and the unselected columns' mass
// accumulated since the last CPU update. The window closes once at least
// `auto_ratio` of the weights have accumulated as much unimportant mass as
// one step's important mass.
class update_trigger {
 public:
  update_trigger(std::size_t weights, double auto_ratio, double average_decay = 0.9);

  // One step's masses for one weight (sums of the column importances).
  void observe(std::size_t weight, double important_mass, double unimportant_mass);
  // True when the host's window should close after this step.
  bool due() const;
  // The CPU update consumed the accumulated mass.
  void reset();

  std::size_t weights() const { return important_.size(); }

  // What the trigger has seen, for a checkpoint: per weight, the running
  // average, the mass since the last CPU update, and whether it has a value.
  struct state {
    std::vector<double> important;
    std::vector<double> unimportant;
    std::vector<std::uint8_t> seen;
  };
  state save() const { return {important_, unimportant_, seen_}; }
  // Resumes from save()'s answer, of the same number of weights.
  void load(const state& s);

 private:
  std::vector<double> important_;     // running average per step
  std::vector<double> unimportant_;   // accumulated since the last update
  std::vector<std::uint8_t> seen_;    // the running average has a first value
  double auto_ratio_;
  double decay_;
};

}  // namespace tierflow::zenflow
