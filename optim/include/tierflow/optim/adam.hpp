// Adam and AdamW over the flat spans of one sub-group, at the memory-bandwidth
// limit, with the numerics of PyTorch's torch.optim.Adam / AdamW (fused=True):
//
//   g      = grad * grad_scale                      (loss scale, clipping folded in;
//                                                    negated to maximize)
//   g     += weight_decay * p                        (Adam: L2)
//   p     -= lr * weight_decay * p                   (AdamW: decoupled)
//   m      = m + (1 - beta1) * (g - m)               (torch's lerp)
//   v      = beta2 * v + (1 - beta2) * g * g
//   v_max  = max(v_max, v)                           (amsgrad; the denominator uses v_max)
//   p     -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// in one pass per element: read p, g, m, v; write p, m, v (and the bf16/fp16
// copy of p that goes back up to the device, when asked for). Computation is
// in fp32; bf16 moments are rounded to nearest-even when stored.
#pragma once

#include <cstdint>
#include <span>

#include "tierflow/core/dtype.hpp"
#include "tierflow/optim/executor.hpp"
#include "tierflow/optim/tensor.hpp"

namespace tierflow::optim {

enum class weight_decay_mode { l2, decoupled };  // Adam, AdamW
enum class amsgrad { off, on };

// The hyper-parameters as the caller gave them (a Python float is a double).
// The kernel's fp32 constants are derived from them in double and rounded
// once, as torch rounds a Python scalar into an fp32 tensor's operation:
// fp32(1 - beta2), not 1 - fp32(beta2), which is 1.3e-5 off for 0.999.
struct adam_options {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  weight_decay_mode decay = weight_decay_mode::decoupled;
  optim::amsgrad amsgrad = optim::amsgrad::off;

  // torch.optim.Adam's and torch.optim.AdamW's defaults.
  static adam_options adam() { return {.weight_decay = 0.0, .decay = weight_decay_mode::l2}; }
  static adam_options adamw() { return {.weight_decay = 1e-2, .decay = weight_decay_mode::decoupled}; }
};

// One sub-group's buffers, all of the same length:
//   param           fp32 master parameters (updated in place)
//   grad            fp32, bf16 or fp16
//   exp_avg         fp32 or bf16 (first moment), updated in place
//   exp_avg_sq      the same dtype as exp_avg (second moment)
//   max_exp_avg_sq  the same dtype, only with amsgrad::on (absent otherwise)
//   param_copy      optional: bf16 or fp16, receives the updated parameters
// Every pointer is aligned to its element size.
struct adam_sub_group {
  std::span<float> param;
  const_tensor_ref grad;
  tensor_ref exp_avg;
  tensor_ref exp_avg_sq;
  tensor_ref max_exp_avg_sq;
  tensor_ref param_copy;
};

enum class finite_check {
  off,        // trust the gradients (bf16 / fp32 training)
  skip_step,  // read the gradients first; any inf/nan → nothing is written
};

// torch's `maximize`: the step ascends the gradient, as if it were negated
// first (exactly: the kernel multiplies it by -grad_scale, with no temporary).
enum class objective { minimize, maximize };

struct adam_step_args {
  std::int64_t step = 1;     // 1-based step count of this sub-group (bias correction)
  float grad_scale = 1.0f;   // multiplies every gradient: 1/loss_scale × clip coefficient
  finite_check check = finite_check::off;
  optim::objective objective = optim::objective::minimize;
};

enum class step_outcome { applied, skipped_nonfinite };

class adam_optimizer {
 public:
  // Throws user_error for a non-finite or out-of-range hyper-parameter:
  // lr < 0, betas outside [0, 1), eps < 0, weight_decay < 0.
  explicit adam_optimizer(const adam_options& options);

  const adam_options& options() const noexcept { return options_; }

  // Applies one step to `group` on `ex`'s threads. Validates everything first
  // and throws user_error (nothing written) for spans of different lengths,
  // null or misaligned pointers, unsupported dtypes, step < 1 or a grad_scale
  // that is not finite and > 0. With finite_check::skip_step and an inf/nan
  // gradient it writes nothing and returns skipped_nonfinite.
  step_outcome step(executor& ex, const adam_sub_group& group, const adam_step_args& args) const;

  // Bytes one step moves per parameter for `group`'s dtypes (reads + writes),
  // e.g. 28 for all-fp32 without amsgrad or a copy: for bandwidth figures.
  static std::size_t bytes_per_param(const adam_sub_group& group, optim::amsgrad ams);

 private:
  adam_options options_;
};

// The STREAM-style bound for Adam's access pattern: in one pass, reads p, g,
// m, v and writes p, m, v (fp32, 28 bytes per element) with the arithmetic
// reduced to one add each, on the same threads, tiles and SIMD target as
// adam_optimizer::step. Its bandwidth is what a memory-bound Adam can reach.
void adam_shaped_stream(executor& ex, std::span<float> p, std::span<const float> g,
                        std::span<float> m, std::span<float> v);

}  // namespace tierflow::optim
