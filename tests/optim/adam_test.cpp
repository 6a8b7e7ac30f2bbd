// Adam/AdamW against a double-precision reference, every SIMD target against
// the scalar path (differential), the inf/nan skip and the input checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "reference.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optim/adam.hpp"

namespace tierflow::optim {
namespace {

using test::typed_buffer;

// torch.optim.Adam/AdamW's update, in double, with the moments stored in
// `state` (rounded to it after every step, as the kernel stores them).
struct reference_adam {
  adam_options o;
  dtype state = dtype::fp32;
  std::vector<double> p, m, v, vmax;

  void step(const std::vector<float>& grad, dtype grad_type, double scale, std::int64_t t) {
    // The moments' weights as torch's fp32 tensors take its Python-float
    // scalars: fp32(1 - beta1), fp32(beta2), fp32(1 - beta2); the bias
    // corrections in double from the betas as given.
    const auto fp32 = [](double x) { return static_cast<double>(static_cast<float>(x)); };
    const double w1 = fp32(1 - o.beta1), b2 = fp32(o.beta2), w2 = fp32(1 - o.beta2);
    const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(t));
    const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(t));
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = static_cast<double>(test::round_to(grad_type, grad[i])) * scale;
      if (o.decay == weight_decay_mode::l2) g += fp32(o.weight_decay) * p[i];
      // AdamW's decay as torch documents and rounds it: p.mul_(1 - lr*wd), the
      // factor rounded to fp32 and p rounded to its fp32 storage before the
      // update. Exact arithmetic is not the model: torch's own fp32 AdamW
      // misses an unrounded decay by 6e-6 over these 100 steps, and the kernel
      // rounds as torch's does (the product of two fp32 values is exact in
      // double, so this is the kernel's multiply bit for bit).
      else p[i] = static_cast<float>(p[i] * static_cast<float>(1.0 - o.lr * o.weight_decay));
      const double mi = m[i] + w1 * (g - m[i]);
      const double vi = b2 * v[i] + w2 * g * g;
      double vh = vi;
      if (o.amsgrad == amsgrad::on) {
        vh = std::max(vmax[i], vi);
        vmax[i] = test::round_to(state, vh);
      }
      // The parameters are fp32 by contract: stored rounded, as the moments.
      p[i] = static_cast<float>(p[i] - o.lr / bc1 * mi / (std::sqrt(vh) / std::sqrt(bc2) + o.eps));
      m[i] = test::round_to(state, mi);
      v[i] = test::round_to(state, vi);
    }
  }
};

// Relative error per element, against the element or, for elements that
// cancelled to near zero, the RMS of the whole vector (fp32 storage bounds the
// absolute error by the magnitudes a value had on its way, not by its final one).
template <class T>
double max_rel_error(const std::vector<float>& got, const std::vector<T>& want) {
  double rms = 0;
  for (auto w : want) rms += static_cast<double>(w) * w;
  rms = std::sqrt(rms / static_cast<double>(std::max<std::size_t>(want.size(), 1)));
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(got[i] - static_cast<double>(want[i])) /
                                std::max(std::abs(static_cast<double>(want[i])), rms));
  return worst;
}

struct adam_case {
  adam_options options;
  dtype grad;
  dtype state;
};

class adam_reference_test : public ::testing::TestWithParam<std::tuple<weight_decay_mode, amsgrad>> {};

TEST_P(adam_reference_test, fp32_matches_double_reference_over_100_steps) {
  const auto [decay, ams] = GetParam();
  const std::size_t n = 5000;
  adam_options o;
  o.lr = 1e-3f;
  o.weight_decay = 0.01f;
  o.decay = decay;
  o.amsgrad = ams;
  adam_optimizer opt(o);
  executor ex(2);

  std::vector<float> p = test::normal_values(n, 1, 1.0f, 0.5f);
  std::vector<float> m(n, 0.0f), v(n, 0.0f), vmax(n, 0.0f);
  reference_adam ref{o, dtype::fp32, {p.begin(), p.end()}, std::vector<double>(n), std::vector<double>(n),
                     std::vector<double>(n)};
  for (std::int64_t t = 1; t <= 100; ++t) {
    const std::vector<float> g = test::normal_values(n, 100 + static_cast<unsigned>(t), 0.1f);
    adam_sub_group grp{p, fp32_ref(std::span<const float>(g)), fp32_ref(std::span<float>(m)),
                       fp32_ref(std::span<float>(v)),
                       ams == amsgrad::on ? fp32_ref(std::span<float>(vmax)) : tensor_ref{}, {}};
    ASSERT_EQ(opt.step(ex, grp, {.step = t, .grad_scale = 0.5f}), step_outcome::applied);
    ref.step(g, dtype::fp32, 0.5, t);
  }
  EXPECT_LT(max_rel_error(p, ref.p), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(modes, adam_reference_test,
                         ::testing::Combine(::testing::Values(weight_decay_mode::l2, weight_decay_mode::decoupled),
                                            ::testing::Values(amsgrad::off, amsgrad::on)));

// bf16 moments and bf16/fp16 gradients: each step's stored moments equal the
// reference's rounding up to one unit in the last place (the rounding of a
// value computed in fp32 vs double can fall on either side of a tie), and the
// parameters stay within bf16 rounding of the reference.
TEST(adam, bf16_state_within_bf16_rounding) {
  for (dtype grad_type : {dtype::fp32, dtype::bf16, dtype::fp16}) {
    const std::size_t n = 3000;
    adam_options o = adam_options::adamw();
    adam_optimizer opt(o);
    executor ex(1);
    std::vector<float> p = test::normal_values(n, 7, 1.0f, 0.5f);
    typed_buffer m(dtype::bf16, std::vector<float>(n, 0.0f)), v(dtype::bf16, std::vector<float>(n, 0.0f));
    std::vector<std::uint16_t> copy(n);
    reference_adam ref{o, dtype::bf16, {p.begin(), p.end()}, std::vector<double>(n), std::vector<double>(n), {}};
    for (std::int64_t t = 1; t <= 20; ++t) {
      const std::vector<float> gv = test::normal_values(n, 300 + static_cast<unsigned>(t), 0.1f);
      typed_buffer g(grad_type, gv);
      adam_sub_group grp{p, {g.data(), n, grad_type}, {m.data(), n, dtype::bf16}, {v.data(), n, dtype::bf16}, {},
                         half_ref(std::span<std::uint16_t>(copy), dtype::bf16)};
      ASSERT_EQ(opt.step(ex, grp, {.step = t}), step_outcome::applied);
      ref.step(gv, grad_type, 1.0, t);
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(m.at(i), ref.m[i], std::abs(ref.m[i]) * 0x1p-7 + 1e-30) << "m[" << i << "] step " << t;
        ASSERT_NEAR(v.at(i), ref.v[i], std::abs(ref.v[i]) * 0x1p-7 + 1e-30) << "v[" << i << "] step " << t;
        // Once the moments were rounded differently the runs diverge by bf16
        // rounding of the update: tiny next to the parameter.
        ASSERT_NEAR(p[i], ref.p[i], 1e-4 * std::max(1.0, std::abs(ref.p[i]))) << "p[" << i << "] step " << t;
        ASSERT_EQ(copy[i], test::ref_to_bf16(p[i])) << "param_copy[" << i << "]";
      }
      // Follow the kernel's stored state, so rounding differences do not accumulate.
      for (std::size_t i = 0; i < n; ++i) {
        ref.m[i] = m.at(i);
        ref.v[i] = v.at(i);
        ref.p[i] = p[i];
      }
    }
  }
}

// ---- differential: every compiled target against the scalar path ----------

struct run_result {
  std::vector<float> p;
  typed_buffer m, v, vmax;
  std::vector<std::uint16_t> copy;
};

// The inputs of the differential runs, made once (generating them dominates
// the test's time under the sanitizers otherwise).
struct differential_inputs {
  std::vector<float> p, m, v;
  std::vector<std::vector<float>> grads;
  explicit differential_inputs(std::size_t n)
      : p(test::normal_values(n, 11, 1.0f, 0.25f)), m(test::normal_values(n, 12, 0.01f)),
        v(test::normal_values(n, 13, 0.001f)) {
    for (auto& e : v) e = e * e;
    for (unsigned t = 1; t <= 3; ++t) grads.push_back(test::normal_values(n, 20 + t, 0.05f));
  }
};

run_result run_case(const differential_inputs& in, const std::string& simd, int threads, const adam_options& o,
                    dtype grad_type, dtype state, dtype copy_type, bool with_copy) {
  const std::size_t n = in.p.size();
  executor ex(threads, simd);
  adam_optimizer opt(o);
  run_result r{in.p, typed_buffer(state, in.m), typed_buffer(state, in.v),
               typed_buffer(state, std::vector<float>(n, 1e-6f)), std::vector<std::uint16_t>(n)};
  // bf16 moments: one step, since once a target's FMA and the scalar path's
  // multiply-add round a moment to neighbouring bf16 values the runs part.
  const std::int64_t steps = state == dtype::bf16 ? 1 : 3;
  for (std::int64_t t = 1; t <= steps; ++t) {
    typed_buffer g(grad_type, in.grads[static_cast<std::size_t>(t - 1)]);
    adam_sub_group grp{r.p,
                       {g.data(), n, grad_type},
                       {r.m.data(), n, state},
                       {r.v.data(), n, state},
                       o.amsgrad == amsgrad::on ? tensor_ref{r.vmax.data(), n, state} : tensor_ref{},
                       with_copy ? tensor_ref{r.copy.data(), n, copy_type} : tensor_ref{}};
    EXPECT_EQ(opt.step(ex, grp, {.step = t, .grad_scale = 0.75f}), step_outcome::applied);
  }
  return r;
}

// Within `tol` relative to the element or, for elements that cancelled to
// near zero, to the RMS of the array; plus `abs_tol`. One assertion per array.
void expect_close(const typed_buffer& a, const typed_buffer& b, const std::string& what, double abs_tol = 0) {
  ASSERT_EQ(a.size(), b.size());
  // fp32: FMA vs separate multiply-add differ in the last bits; bf16: the
  // same few bits can move a value across a rounding boundary.
  const double tol = a.type == dtype::fp32 ? 2e-6 : 0x1p-6;
  double rms = 0;
  for (std::size_t i = 0; i < b.size(); ++i) rms += static_cast<double>(b.at(i)) * b.at(i);
  rms = std::sqrt(rms / static_cast<double>(b.size()));
  std::size_t worst = 0;
  double worst_excess = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double allowed = tol * std::max<double>(std::abs(b.at(i)), rms) + abs_tol;
    const double excess = std::abs(static_cast<double>(a.at(i)) - b.at(i)) - allowed;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  EXPECT_EQ(worst_excess, 0.0) << what << "[" << worst << "]: " << a.at(worst) << " vs " << b.at(worst);
}

TEST(adam, every_simd_target_matches_scalar) {
  const std::vector<std::string> targets = simd_targets();
  ASSERT_FALSE(targets.empty());
  ASSERT_EQ(targets.back(), "scalar");
  // Two tiles (so two threads split the work) and a ragged tail.
  const differential_inputs in(16384 + 37);
  const std::size_t n = in.p.size();
  for (auto decay : {weight_decay_mode::l2, weight_decay_mode::decoupled}) {
    for (auto ams : {amsgrad::off, amsgrad::on}) {
      for (dtype g : {dtype::fp32, dtype::bf16, dtype::fp16}) {
        for (dtype s : {dtype::fp32, dtype::bf16}) {
          for (int copy = 0; copy < 3; ++copy) {
            const dtype copy_type = copy == 2 ? dtype::fp16 : dtype::bf16;
            adam_options o{.lr = 1e-2f, .weight_decay = 0.1f, .decay = decay, .amsgrad = ams};
            const run_result want = run_case(in, "scalar", 1, o, g, s, copy_type, copy != 0);
            for (const std::string& simd : targets) {
              SCOPED_TRACE(simd + " grad " + std::string(name(g)) + " state " + std::string(name(s)) + " copy " +
                           std::to_string(copy) + " ams " + std::to_string(int(ams)) + " decay " +
                           std::to_string(int(decay)));
              // The scalar target itself runs on two threads: tiling must not change results.
              const run_result got = run_case(in, simd, simd == "scalar" ? 2 : 1 + (copy & 1), o, g, s, copy_type,
                                              copy != 0);
              // With bf16 moments, a moment one ulp apart moves p by lr · 2^-8 per step.
              expect_close(typed_buffer(dtype::fp32, got.p), typed_buffer(dtype::fp32, want.p), "p",
                           s == dtype::bf16 ? 3 * o.lr * 0x1p-6 : 0.0);
              expect_close(got.m, want.m, "m");
              expect_close(got.v, want.v, "v");
              if (ams == amsgrad::on) expect_close(got.vmax, want.vmax, "vmax");
              if (copy != 0) {
                std::size_t mismatches = 0;
                for (std::size_t i = 0; i < n; ++i) {
                  // The copy is exactly the rounding of the kernel's own fp32 result.
                  const std::uint16_t r =
                      copy_type == dtype::bf16 ? test::ref_to_bf16(got.p[i]) : test::ref_to_fp16(got.p[i]);
                  mismatches += got.copy[i] != r;
                }
                EXPECT_EQ(mismatches, 0u) << "param_copy";
              }
            }
          }
        }
      }
    }
  }
}

TEST(adam, bound_kernel_adds_gradient) {
  for (const std::string& simd : simd_targets()) {
    executor ex(2, simd);
    const std::size_t n = 40000 + 3;
    std::vector<float> p(n, 1.0f), g(n, 0.5f), m(n, 2.0f), v(n, 3.0f);
    adam_shaped_stream(ex, p, g, m, v);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(p[i], 1.5f);
      ASSERT_EQ(m[i], 2.5f);
      ASSERT_EQ(v[i], 3.5f);
    }
  }
}

// ---- inf / nan: the whole step is skipped -----------------------------------

TEST(adam, nonfinite_gradient_skips_step_and_writes_nothing) {
  const std::size_t n = 2 * 16384 + 5;
  const std::vector<float> base_grad = test::normal_values(n, 5, 0.1f), base_param = test::normal_values(n, 6);
  for (const std::string& simd : simd_targets()) {
    for (dtype gt : {dtype::fp32, dtype::bf16, dtype::fp16}) {
      for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN()}) {
        for (std::size_t where : {std::size_t{0}, n / 2, n - 1}) {
          executor ex(2, simd);
          adam_optimizer opt(adam_options::adamw());
          std::vector<float> gv = base_grad;
          gv[where] = bad;
          typed_buffer g(gt, gv);
          std::vector<float> p = base_param, m(n, 0.5f), v(n, 0.25f);
          std::vector<std::uint16_t> copy(n, 7);
          const auto p0 = p, m0 = m, v0 = v;
          const auto copy0 = copy;
          adam_sub_group grp{p, {g.data(), n, gt}, fp32_ref(std::span<float>(m)), fp32_ref(std::span<float>(v)), {},
                             half_ref(std::span<std::uint16_t>(copy), dtype::bf16)};
          EXPECT_EQ(opt.step(ex, grp, {.step = 1, .check = finite_check::skip_step}),
                    step_outcome::skipped_nonfinite);
          ASSERT_EQ(p, p0);
          ASSERT_EQ(m, m0);
          ASSERT_EQ(v, v0);
          ASSERT_EQ(copy, copy0);
        }
      }
    }
  }
}

TEST(adam, gradient_that_overflows_when_scaled_is_nonfinite) {
  executor ex(1);
  adam_optimizer opt(adam_options::adamw());
  std::vector<float> p(64, 1.0f), g(64, 1.0f), m(64, 0.0f), v(64, 0.0f);
  g[3] = 3e38f;
  adam_sub_group grp{p, fp32_ref(std::span<const float>(g)), fp32_ref(std::span<float>(m)),
                     fp32_ref(std::span<float>(v)), {}, {}};
  EXPECT_EQ(opt.step(ex, grp, {.step = 1, .grad_scale = 10.0f, .check = finite_check::skip_step}),
            step_outcome::skipped_nonfinite);
  EXPECT_EQ(opt.step(ex, grp, {.step = 1, .grad_scale = 1.0f, .check = finite_check::skip_step}),
            step_outcome::applied);
}

// ---- bad input: user_error, nothing written ------------------------------------

TEST(adam, bad_hyper_parameters_are_user_errors) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(adam_optimizer({.lr = -1e-3f}), user_error);
  EXPECT_THROW(adam_optimizer({.lr = nan}), user_error);
  EXPECT_THROW(adam_optimizer({.beta1 = 1.0f}), user_error);
  EXPECT_THROW(adam_optimizer({.beta1 = -0.1f}), user_error);
  EXPECT_THROW(adam_optimizer({.beta2 = 1.5f}), user_error);
  EXPECT_THROW(adam_optimizer({.eps = -1.0f}), user_error);
  EXPECT_THROW(adam_optimizer({.weight_decay = std::numeric_limits<float>::infinity()}), user_error);
  EXPECT_NO_THROW(adam_optimizer({.lr = 0.0f, .beta1 = 0.0f}));
  EXPECT_THROW(executor(0), user_error);
  EXPECT_THROW(executor(1, "avx9000"), user_error);
}

TEST(adam, bad_spans_are_user_errors_and_write_nothing) {
  const std::size_t n = 1000;
  executor ex(2);
  adam_optimizer opt(adam_options::adamw());
  std::vector<float> p(n, 1.0f), g(n, 0.5f), m(n, 0.25f), v(n, 0.125f), vmax(n, 0.0f);
  std::vector<std::uint16_t> h(n + 1, 3);
  const auto p0 = p, m0 = m, v0 = v;
  const auto h0 = h;
  auto good = [&] {
    return adam_sub_group{p, fp32_ref(std::span<const float>(g)), fp32_ref(std::span<float>(m)),
                          fp32_ref(std::span<float>(v)), {}, {}};
  };
  auto expect_refused = [&](adam_sub_group grp, adam_step_args args, const char* what) {
    EXPECT_THROW(opt.step(ex, grp, args), user_error) << what;
    EXPECT_EQ(p, p0) << what;
    EXPECT_EQ(m, m0) << what;
    EXPECT_EQ(v, v0) << what;
    EXPECT_EQ(h, h0) << what;
  };
  adam_sub_group grp = good();
  grp.grad.size = n - 1;
  expect_refused(grp, {}, "short grad");
  grp = good();
  grp.exp_avg_sq.size = n + 1;
  expect_refused(grp, {}, "long exp_avg_sq");
  grp = good();
  grp.grad.data = nullptr;
  expect_refused(grp, {}, "null grad");
  grp = good();
  grp.exp_avg = {reinterpret_cast<char*>(m.data()) + 1, n, dtype::fp32};
  expect_refused(grp, {}, "misaligned exp_avg");
  grp = good();
  grp.exp_avg = {h.data(), n, dtype::fp16};
  expect_refused(grp, {}, "fp16 moments");
  grp = good();
  grp.exp_avg = {h.data(), n, dtype::bf16};
  expect_refused(grp, {}, "moments of two dtypes");
  grp = good();
  grp.param_copy = {h.data(), n, dtype::fp32};
  expect_refused(grp, {}, "fp32 param copy");
  grp = good();
  grp.param_copy = {h.data(), n + 1, dtype::bf16};
  expect_refused(grp, {}, "param copy of another length");
  grp = good();
  grp.max_exp_avg_sq = fp32_ref(std::span<float>(vmax));
  expect_refused(grp, {}, "max_exp_avg_sq without amsgrad");
  expect_refused(good(), {.step = 0}, "step 0");
  expect_refused(good(), {.grad_scale = 0.0f}, "zero grad_scale");
  expect_refused(good(), {.grad_scale = std::numeric_limits<float>::quiet_NaN()}, "nan grad_scale");

  adam_optimizer ams({.amsgrad = amsgrad::on});
  EXPECT_THROW(ams.step(ex, good(), {}), user_error) << "amsgrad without max_exp_avg_sq";
  EXPECT_EQ(p, p0);
}

// maximize is the step on the negated gradient, bit for bit, on every SIMD
// target (torch negates the gradient first; the kernel negates its scale).
TEST(adam, maximize_is_the_step_on_the_negated_gradient) {
  const std::size_t n = 4096 + 19;
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = std::sin(static_cast<float>(i)) * 1e-2f;
  std::vector<float> negated(g);
  for (float& x : negated) x = -x;
  for (const std::string& simd : simd_targets()) {
    executor ex(2, simd);
    adam_optimizer opt({.lr = 1e-2f, .weight_decay = 0.1f, .decay = weight_decay_mode::l2, .amsgrad = amsgrad::on});
    std::vector<float> p1(n, 0.5f), m1(n, 0.0f), v1(n, 0.0f), x1(n, 0.0f);
    std::vector<float> p2(p1), m2(m1), v2(v1), x2(x1);
    for (std::int64_t t = 1; t <= 3; ++t) {
      adam_sub_group up{p1, fp32_ref(std::span<const float>(g)), fp32_ref(std::span<float>(m1)),
                        fp32_ref(std::span<float>(v1)), fp32_ref(std::span<float>(x1)), {}};
      adam_sub_group down{p2, fp32_ref(std::span<const float>(negated)), fp32_ref(std::span<float>(m2)),
                          fp32_ref(std::span<float>(v2)), fp32_ref(std::span<float>(x2)), {}};
      opt.step(ex, up, {.step = t, .grad_scale = 0.5f, .objective = objective::maximize});
      opt.step(ex, down, {.step = t, .grad_scale = 0.5f});
    }
    EXPECT_EQ(p1, p2) << simd;
    EXPECT_EQ(m1, m2) << simd;
    EXPECT_EQ(v1, v2) << simd;
    EXPECT_EQ(x1, x2) << simd;
  }
}

TEST(adam, empty_sub_group_is_a_no_op) {
  executor ex(2);
  adam_optimizer opt(adam_options::adamw());
  EXPECT_EQ(opt.step(ex, adam_sub_group{}, {}), step_outcome::applied);
}

TEST(adam, bytes_per_param) {
  std::vector<float> p(4), g(4), m(4), v(4);
  adam_sub_group grp{p, fp32_ref(std::span<const float>(g)), fp32_ref(std::span<float>(m)),
                     fp32_ref(std::span<float>(v)), {}, {}};
  EXPECT_EQ(adam_optimizer::bytes_per_param(grp, amsgrad::off), 28u);
  grp.grad.type = dtype::bf16;
  grp.exp_avg.type = grp.exp_avg_sq.type = dtype::bf16;
  grp.param_copy = {p.data(), 4, dtype::bf16};
  EXPECT_EQ(adam_optimizer::bytes_per_param(grp, amsgrad::off), 8u + 2 + 8 + 2);
}

TEST(adam, first_touch_zeroes) {
  executor ex(2);
  std::vector<float> buf(100000, 3.0f);
  first_touch(ex, fp32_ref(std::span<float>(buf)));
  EXPECT_TRUE(std::all_of(buf.begin(), buf.end(), [](float x) { return x == 0.0f; }));
}

}  // namespace
}  // namespace tierflow::optim
