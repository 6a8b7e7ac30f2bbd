// ZenFlow's update rule over optim's kernels: Adam or AdamW by columns for
// most weights, Muon over the whole matrix for the weights chosen for it
// (the hidden matrices, optim/grouping.hpp), one engine for both.
//
// Hyper-parameters are per weight and may change between steps (an LR
// schedule, per-group settings). A change made on the trainer's thread
// before engine::step() reaches:
//   - the device's update of that step (update_owned runs on the trainer's
//     thread with the values set then);
//   - the host's CPU step of the window that step ends: the engine calls
//     begin_host_step() at that step, which fixes the values that CPU step
//     applies, so it may run on the engine's thread while the trainer sets
//     the next step's.
// With update_interval 1 and no overlap every window is one step, so each
// step's values reach both sides as they reach torch.optim.AdamW's step.
//
// Layout: weight_shape's. A Muon weight of rows × cols, stored column after
// column, is the row-major matrix of cols × rows that Muon orthogonalizes
// (a torch (out, in) weight, rows = in).
#pragma once

#include <cstddef>
#include <vector>

#include "tierflow/core/zenflow/engine.hpp"
#include "tierflow/optim/adam.hpp"
#include "tierflow/optim/executor.hpp"
#include "tierflow/optim/grouping.hpp"
#include "tierflow/optim/muon.hpp"

namespace tierflow::optim {

class zenflow_rule final : public zenflow::update_rule {
 public:
  // kinds[w]: weight w's optimizer; Muon's weights are updated whole
  // (granularity::matrix). The device side's updates run on
  // `device_threads`, the host's CPU steps on `host_threads` (the same
  // executor may serve both). Every weight starts with
  // adam_options::adamw() and muon_options{}. Both executors outlive the
  // rule.
  zenflow_rule(std::vector<optimizer_kind> kinds, executor& device_threads, executor& host_threads);

  // Weight w's Adam/AdamW hyper-parameters from the next step on (see the
  // header's comment). Trainer's thread only. Throws user_error for a
  // value adam_optimizer refuses, or amsgrad (the engine keeps two state
  // buffers per element); nothing changes then.
  void set_adam(std::size_t w, const adam_options& options);
  // The same for a Muon weight's hyper-parameters.
  void set_muon(std::size_t w, const muon_options& options);
  const adam_options& adam(std::size_t w) const { return current_[w].adam; }
  const muon_options& muon(std::size_t w) const { return current_[w].muon; }
  optimizer_kind kind(std::size_t w) const { return kinds_[w]; }

  zenflow::granularity unit(std::size_t w) const noexcept override;
  std::size_t state_count() const noexcept override { return 2; }
  // The host's side with the values fixed by begin_host_step(), the
  // device's with the current ones.
  void apply(const zenflow::update_args& args) override;
  // Adam's moments rebased to the step count of the side they cross to
  // (with the weight's current betas); Muon's momentum has no
  // step-dependent correction and stays as it is.
  void rebase_state(const zenflow::crossing_args& args) override;
  void begin_host_step(std::int64_t host_step) override;

 private:
  struct weight_options {
    adam_options adam = adam_options::adamw();
    muon_options muon{};
  };
  std::vector<optimizer_kind> kinds_;
  executor& device_threads_;
  executor& host_threads_;
  std::vector<weight_options> current_;  // the trainer's: the device side's values
  // The host side's values, copied from current_ by begin_host_step() on
  // the trainer's thread while no CPU step runs, read by the CPU step (on
  // the engine's thread after its hand-off, which orders the copy first).
  std::vector<weight_options> host_;
  // One Muon workspace per side: the two sides' updates may run at once.
  muon_optimizer device_muon_{muon_options{}};
  muon_optimizer host_muon_{muon_options{}};
};

}  // namespace tierflow::optim
