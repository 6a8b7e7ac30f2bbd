// Muon against a double-precision reference of momentum + Newton–Schulz, the
// learning-rate rules, the grouping helper and the input checks.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <omp.h>

#include "reference.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optim/grouping.hpp"
#include "tierflow/optim/muon.hpp"

namespace tierflow::optim {
namespace {

using matrix = std::vector<double>;  // row-major

matrix matmul(const matrix& a, const matrix& b, std::size_t m, std::size_t k, std::size_t n) {
  matrix c(m * n, 0.0);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t p = 0; p < k; ++p)
      for (std::size_t j = 0; j < n; ++j) c[i * n + j] += a[i * k + p] * b[p * n + j];
  return c;
}
matrix transpose(const matrix& a, std::size_t rows, std::size_t cols) {
  matrix t(rows * cols);
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols; ++j) t[j * rows + i] = a[i * cols + j];
  return t;
}

// torch.optim.Muon's _zeropower_via_newtonschulz, in double.
matrix reference_ns(matrix x, std::size_t rows, std::size_t cols, const muon_options& o) {
  const bool tall = rows > cols;
  if (tall) x = transpose(x, rows, cols);
  const std::size_t m = tall ? cols : rows, n = tall ? rows : cols;
  double norm = 0;
  for (double v : x) norm += v * v;
  norm = std::max(std::sqrt(norm), static_cast<double>(o.eps));
  for (double& v : x) v /= norm;
  for (int s = 0; s < o.ns_steps; ++s) {
    const matrix a = matmul(x, transpose(x, m, n), m, n, m);
    matrix b = matmul(a, a, m, m, m);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = o.ns_b * a[i] + o.ns_c * b[i];
    const matrix bx = matmul(b, x, m, m, n);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = o.ns_a * x[i] + bx[i];
  }
  return tall ? transpose(x, m, n) : x;
}

double max_abs_diff(const std::vector<float>& a, const matrix& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

TEST(muon, orthogonalize_matches_double_reference) {
  for (dtype gemm : {dtype::fp32, dtype::bf16}) {
    // 300 x 320 and its transpose: m = 300 spans two block rows of the
    // symmetric products (256 + 44), so the triangle and its mirror are checked.
    for (auto [rows, cols] :
         {std::pair<std::size_t, std::size_t>{24, 40}, {40, 24}, {32, 32}, {1, 17}, {300, 320}, {320, 300}}) {
      muon_options o;
      o.gemm_dtype = gemm;
      muon_optimizer opt(o);
      executor ex(2);
      const std::vector<float> in = test::normal_values(rows * cols, 3);
      std::vector<float> out(rows * cols);
      opt.orthogonalize(ex, in, rows, cols, out);
      const matrix want = reference_ns({in.begin(), in.end()}, rows, cols, o);
      // NS output entries are O(1/sqrt(min(rows, cols))). fp32: accumulation
      // order only; bf16: every operand rounded to 8 bits, through 5 iterations.
      const double tol = gemm == dtype::fp32 ? 2e-4 : 6e-2;
      EXPECT_LT(max_abs_diff(out, want), tol) << rows << "x" << cols << " " << name(gemm);
    }
  }
}

TEST(muon, step_matches_reference_for_each_momentum_form) {
  const std::size_t rows = 48, cols = 20;
  for (auto form : {muon_momentum::ema, muon_momentum::sgd}) {
    for (auto nest : {nesterov::on, nesterov::off}) {
      for (auto adjust : {lr_adjustment::original, lr_adjustment::match_rms_adamw,
                          lr_adjustment::spectral_unclamped}) {
        muon_options o{.lr = 0.02f, .weight_decay = 0.1f, .momentum = 0.9f, .nesterov = nest,
                       .momentum_form = form, .adjust_lr = adjust, .gemm_dtype = dtype::fp32};
        muon_optimizer opt(o);
        executor ex(2);
        std::vector<float> p = test::normal_values(rows * cols, 1), buf = test::normal_values(rows * cols, 2, 0.1f);
        const std::vector<float> g = test::normal_values(rows * cols, 4);
        std::vector<std::uint16_t> copy(rows * cols);
        matrix rp(p.begin(), p.end()), rbuf(buf.begin(), buf.end());
        const float scale = 0.5f;
        opt.step(ex, {p, fp32_ref(std::span<const float>(g)), buf, rows, cols,
                      half_ref(std::span<std::uint16_t>(copy), dtype::bf16)},
                 scale);
        // Reference: momentum, NS, decoupled decay, adjusted lr.
        matrix u(rows * cols);
        const double mu = o.momentum;
        for (std::size_t i = 0; i < u.size(); ++i) {
          const double gi = g[i] * double{scale};
          if (form == muon_momentum::ema) {
            rbuf[i] = rbuf[i] + (1 - mu) * (gi - rbuf[i]);
            u[i] = nest == nesterov::on ? gi + mu * (rbuf[i] - gi) : rbuf[i];
          } else {
            rbuf[i] = mu * rbuf[i] + gi;
            u[i] = nest == nesterov::on ? gi + mu * rbuf[i] : rbuf[i];
          }
        }
        const matrix o_ns = reference_ns(u, rows, cols, o);
        const double lr = adjust == lr_adjustment::match_rms_adamw ? 0.02 * 0.2 * std::sqrt(48.0)
                                                                   : 0.02 * std::sqrt(48.0 / 20.0);
        EXPECT_NEAR(muon_optimizer::adjusted_lr(o, rows, cols), lr, 1e-6);
        for (std::size_t i = 0; i < rp.size(); ++i) rp[i] = rp[i] * (1 - 0.02 * 0.1) - lr * o_ns[i];
        EXPECT_LT(max_abs_diff(buf, rbuf), 1e-6);
        EXPECT_LT(max_abs_diff(p, rp), 2e-4 * lr + 1e-6);
        for (std::size_t i = 0; i < p.size(); ++i) ASSERT_EQ(copy[i], test::ref_to_bf16(p[i]));
      }
    }
  }
}

TEST(muon, adjusted_lr_follows_each_rule_on_wide_and_tall_matrices) {
  muon_options o{.lr = 0.01f};
  // original clamps the ratio at 1 for a wide matrix; spectral_unclamped does not.
  const double tall = std::sqrt(48.0 / 20.0), wide = std::sqrt(20.0 / 48.0);
  o.adjust_lr = lr_adjustment::original;
  EXPECT_NEAR(muon_optimizer::adjusted_lr(o, 48, 20), 0.01 * tall, 1e-9);
  EXPECT_NEAR(muon_optimizer::adjusted_lr(o, 20, 48), 0.01, 1e-9);
  o.adjust_lr = lr_adjustment::spectral_unclamped;
  EXPECT_NEAR(muon_optimizer::adjusted_lr(o, 48, 20), 0.01 * tall, 1e-9);
  EXPECT_NEAR(muon_optimizer::adjusted_lr(o, 20, 48), 0.01 * wide, 1e-9);
  o.adjust_lr = lr_adjustment::match_rms_adamw;
  EXPECT_NEAR(muon_optimizer::adjusted_lr(o, 20, 48), 0.01 * 0.2 * std::sqrt(48.0), 1e-9);
}

TEST(muon, set_options_steps_as_a_new_optimizer_would_and_refuses_bad_values) {
  const std::size_t rows = 24, cols = 40;
  const std::vector<float> g = test::normal_values(rows * cols, 5);
  const muon_options first{.lr = 0.02f, .gemm_dtype = dtype::fp32};
  const muon_options second{.lr = 0.005f, .weight_decay = 0.0f, .momentum = 0.8f, .nesterov = nesterov::off,
                            .adjust_lr = lr_adjustment::spectral_unclamped, .gemm_dtype = dtype::bf16};
  executor ex(2);
  muon_optimizer reused(first), fresh(second);
  std::vector<float> p1 = test::normal_values(rows * cols, 1), b1(rows * cols, 0.0f);
  std::vector<float> p2 = p1, b2 = b1;
  reused.step(ex, {p1, fp32_ref(std::span<const float>(g)), b1, rows, cols, {}});  // plans and buffers made
  p1 = p2;
  b1 = b2;
  reused.set_options(second);
  EXPECT_EQ(reused.options().adjust_lr, lr_adjustment::spectral_unclamped);
  reused.step(ex, {p1, fp32_ref(std::span<const float>(g)), b1, rows, cols, {}});
  fresh.step(ex, {p2, fp32_ref(std::span<const float>(g)), b2, rows, cols, {}});
  EXPECT_EQ(p1, p2);
  EXPECT_EQ(b1, b2);

  EXPECT_THROW(reused.set_options({.momentum = 1.5f}), user_error);
  EXPECT_THROW(reused.set_options({.gemm_dtype = dtype::fp16}), user_error);
  EXPECT_EQ(reused.options().lr, second.lr);  // the old options stay
}

TEST(muon, a_step_gives_the_caller_its_openmp_team_size_back) {
  // Inside PyTorch the OpenMP runtime is torch's intra-op pool as well: a
  // one-thread step must not leave the caller with one thread.
  const int before = omp_get_max_threads();
  omp_set_num_threads(3);
  muon_optimizer opt(muon_options{.gemm_dtype = dtype::fp32});
  executor ex(1);
  const std::size_t rows = 16, cols = 8;
  std::vector<float> p(rows * cols, 1.0f), buf(rows * cols, 0.0f);
  const std::vector<float> g = test::normal_values(rows * cols, 6);
  opt.step(ex, {p, fp32_ref(std::span<const float>(g)), buf, rows, cols, {}});
  EXPECT_EQ(omp_get_max_threads(), 3);
  omp_set_num_threads(before);
}

TEST(muon, bf16_gradient_and_default_bf16_gemms) {
  const std::size_t rows = 64, cols = 96;
  muon_optimizer opt(muon_options{});
  executor ex(1);
  std::vector<float> p(rows * cols, 0.0f), buf(rows * cols, 0.0f);
  test::typed_buffer g(dtype::bf16, test::normal_values(rows * cols, 9));
  opt.step(ex, {p, {g.data(), rows * cols, dtype::bf16}, buf, rows, cols, {}});
  // From zero parameters one step is -lr · NS(g·(1-mu)·(1+mu)...) : compare with the reference.
  matrix u(rows * cols);
  const double mu = 0.95;
  for (std::size_t i = 0; i < u.size(); ++i) {
    const double gi = g.at(i);
    const double b = (1 - mu) * gi;
    u[i] = gi + mu * (b - gi);
  }
  const matrix want = reference_ns(u, rows, cols, opt.options());
  double worst = 0;
  for (std::size_t i = 0; i < p.size(); ++i) worst = std::max(worst, std::abs(p[i] / -1e-3 - want[i]));
  EXPECT_LT(worst, 6e-2);
}

TEST(muon, bad_input_is_a_user_error_and_writes_nothing) {
  EXPECT_THROW(muon_optimizer({.lr = -1.0f}), user_error);
  EXPECT_THROW(muon_optimizer({.momentum = 1.0f}), user_error);
  EXPECT_THROW(muon_optimizer({.ns_steps = -1}), user_error);
  EXPECT_THROW(muon_optimizer({.eps = 0.0f}), user_error);
  EXPECT_THROW(muon_optimizer({.gemm_dtype = dtype::fp16}), user_error);
  EXPECT_THROW(muon_optimizer({.weight_decay = std::numeric_limits<float>::quiet_NaN()}), user_error);

  muon_optimizer opt(muon_options{});
  executor ex(1);
  const std::size_t rows = 8, cols = 4;
  std::vector<float> p(rows * cols, 1.0f), buf(rows * cols, 2.0f), g(rows * cols, 3.0f);
  const auto p0 = p, buf0 = buf;
  EXPECT_THROW(opt.step(ex, {p, fp32_ref(std::span<const float>(g)), buf, rows, cols + 1, {}}), user_error);
  EXPECT_THROW(opt.step(ex, {p, fp32_ref(std::span<const float>(g).first(5)), buf, rows, cols, {}}), user_error);
  EXPECT_THROW(opt.step(ex, {p, fp32_ref(std::span<const float>(g)), std::span<float>(buf).first(3), rows, cols, {}}),
               user_error);
  EXPECT_THROW(opt.step(ex, {p, fp32_ref(std::span<const float>(g)), buf, rows, cols, {}}, 0.0f), user_error);
  EXPECT_THROW(opt.step(ex, {p, fp32_ref(std::span<const float>(g)), buf, 0, 0, {}}), user_error);
  EXPECT_THROW(opt.step(ex, {p, fp32_ref(std::span<const float>(g)), buf, rows, cols, {p.data(), rows * cols, dtype::fp32}}),
               user_error);
  EXPECT_EQ(p, p0);
  EXPECT_EQ(buf, buf0);
}

TEST(grouping, muon_for_hidden_matrices_adamw_for_the_rest) {
  const std::vector<std::int64_t> mat{1024, 4096}, vec{4096}, conv{64, 3, 3, 3}, row{1, 4096};
  const std::vector<parameter_desc> params = {
      {"model.embed_tokens.weight", mat}, {"model.layers.0.mlp.up_proj.weight", mat},
      {"model.layers.0.input_layernorm.weight", vec}, {"model.layers.0.self_attn.q_proj.bias", vec},
      {"lm_head.weight", mat}, {"transformer.wte.weight", mat}, {"encoder.conv1.weight", conv},
      {"layers.1.attn.out_proj.weight", mat}, {"cls.weight", row}, {"Model.Output.weight", mat}};
  const parameter_groups g = group_parameters(params);
  EXPECT_EQ(g.muon, (std::vector<std::size_t>{1, 7}));
  EXPECT_EQ(g.adamw, (std::vector<std::size_t>{0, 2, 3, 4, 5, 6, 8, 9}));
}

}  // namespace
}  // namespace tierflow::optim
