// Muon (MomentUm Orthogonalized by Newton–Schulz) on the CPU, one matrix at a
// time — the unit a scheduler streams from NVMe:
//
//   g  = grad * grad_scale
//   buf = buf + (1 - mu) * (g - buf)        (ema: torch.optim.Muon)
//   buf = mu * buf + g                      (sgd: Moonshot's reference)
//   u  = nesterov ? g + mu * (buf - g) [ema] / g + mu * buf [sgd] : buf
//   u  = NS(u)                              (quintic Newton–Schulz, below)
//   p *= 1 - lr * weight_decay               (decoupled)
//   p -= adjusted_lr * u
//
// NS(X): transposes a tall X (rows > cols), divides by max(||X||_F, eps), then
// ns_steps times  A = X Xᵀ;  B = b A + c A A;  X = a X + B X  with (a, b, c) =
// (3.4445, -4.7750, 2.0315), and transposes back. The three GEMMs run on
// oneDNN in bf16 (as torch.optim.Muon, which rounds every operand to bf16;
// AVX512-BF16/AMX where present) or fp32. Where oneDNN has no bf16 GEMM for
// the CPU (before AVX-512: Debian's oneDNN 2.6 needs avx512_core), bf16 mode
// runs fp32 GEMMs on the same bf16 values and rounds each result to bf16
// where the bf16 GEMMs store it: the products are exact in fp32 either way,
// so only the order of the fp32 sums differs (bf16_gemms_native() tells).
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "tierflow/core/dtype.hpp"
#include "tierflow/optim/executor.hpp"
#include "tierflow/optim/tensor.hpp"

namespace tierflow::optim {

enum class muon_momentum { ema, sgd };
enum class nesterov { off, on };
enum class lr_adjustment {
  original,            // lr · sqrt(max(1, rows / cols))   (torch's default)
  match_rms_adamw,     // lr · 0.2 · sqrt(max(rows, cols))  (Moonshot)
  spectral_unclamped,  // lr · sqrt(rows / cols)            (Bernstein)
};

struct muon_options {
  float lr = 1e-3f;
  float weight_decay = 0.1f;
  float momentum = 0.95f;
  optim::nesterov nesterov = optim::nesterov::on;
  muon_momentum momentum_form = muon_momentum::ema;
  int ns_steps = 5;
  float ns_a = 3.4445f;
  float ns_b = -4.7750f;
  float ns_c = 2.0315f;
  float eps = 1e-7f;
  lr_adjustment adjust_lr = lr_adjustment::original;
  dtype gemm_dtype = dtype::bf16;  // bf16 or fp32
};

// One 2-D parameter (row-major rows × cols) and its state:
//   param            fp32 master values, updated in place
//   grad             fp32, bf16 or fp16
//   momentum_buffer  fp32, updated in place
//   param_copy       optional bf16 or fp16 copy of the updated parameter
struct muon_matrix {
  std::span<float> param;
  const_tensor_ref grad;
  std::span<float> momentum_buffer;
  std::size_t rows = 0;
  std::size_t cols = 0;
  tensor_ref param_copy;
};

// Whether oneDNN runs bf16 GEMMs on this CPU (asked once); false: bf16 mode
// rounds fp32 GEMMs' results instead (above).
bool bf16_gemms_native();

class muon_optimizer {
 public:
  // Throws user_error for lr < 0, weight_decay < 0, momentum outside [0, 1),
  // ns_steps outside [0, 100], eps <= 0, non-finite values or a gemm_dtype
  // other than bf16 / fp32.
  explicit muon_optimizer(const muon_options& options);
  ~muon_optimizer();
  muon_optimizer(muon_optimizer&&) noexcept;
  muon_optimizer& operator=(muon_optimizer&&) noexcept;

  const muon_options& options() const noexcept { return options_; }

  // Replaces the hyper-parameters (checked as the constructor checks them;
  // on a throw the old ones stay) and keeps the workspace: a stream of steps
  // whose learning rate or per-group settings change from one matrix to the
  // next reuses its buffers and GEMM plans.
  void set_options(const muon_options& options);

  // One step for one matrix. Validates first and throws user_error (nothing
  // written) for a shape that does not match the spans, null or misaligned
  // pointers, unsupported dtypes or a grad_scale that is not finite and > 0.
  // Not reentrant: one optimizer object keeps one workspace (sized by the
  // largest matrix seen); use one object per concurrent stream.
  void step(executor& ex, const muon_matrix& matrix, float grad_scale = 1.0f);

  // NS(in) into out (both rows × cols, fp32), as step() applies it.
  void orthogonalize(executor& ex, std::span<const float> in, std::size_t rows, std::size_t cols,
                     std::span<float> out);

  // Runs only the ns_steps × 3 GEMMs of orthogonalize() for this shape, on the
  // workspace's current contents: the "GEMMs alone" figure of the benchmark.
  void run_gemms_only(executor& ex, std::size_t rows, std::size_t cols);

  // The learning rate step() applies to a rows × cols matrix.
  static float adjusted_lr(const muon_options& options, std::size_t rows, std::size_t cols);

 private:
  struct workspace;
  void orthogonalize_into(executor& ex, const float* in, std::size_t rows, std::size_t cols, float* out);

  muon_options options_;
  std::unique_ptr<workspace> ws_;
};

}  // namespace tierflow::optim
