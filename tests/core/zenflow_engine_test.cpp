// The ZenFlow engine on the device stand-in, against a plain optimizer run
// over the same gradients.
#include "tierflow/core/zenflow/engine.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <random>
#include <thread>
#include <utility>

#include <gtest/gtest.h>

#include "tierflow/core/affinity.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/zenflow/standin.hpp"
#include "zenflow_test_support.hpp"

namespace tierflow::zenflow {
namespace {

constexpr float beta1 = 0.9f, beta2 = 0.999f;

// Adam in fp32 over `n` elements at step `step`: the same arithmetic on
// either side and in the sequential reference, so exact agreement is the
// expected result, not a tolerance.
void adam_math(float* p, float* m, float* v, const float* grad, std::size_t n, std::int64_t step) {
  const float lr = 1e-2f, eps = 1e-8f;
  const float c1 = 1.0f - std::pow(beta1, static_cast<float>(step));
  const float c2 = std::sqrt(1.0f - std::pow(beta2, static_cast<float>(step)));
  for (std::size_t i = 0; i < n; ++i) {
    const float g = grad[i];
    m[i] = beta1 * m[i] + (1 - beta1) * g;
    v[i] = beta2 * v[i] + (1 - beta2) * g * g;
    p[i] -= lr / c1 * m[i] / (std::sqrt(v[i]) / c2 + eps);
  }
}

class adam_rule final : public update_rule {
 public:
  granularity unit(std::size_t) const noexcept override { return granularity::columns; }
  std::size_t state_count() const noexcept override { return 2; }
  void apply(const update_args& a) override {
    ++calls[a.where == side::device ? 0 : 1];
    adam_math(a.param.data(), a.state0.data(), a.state1.data(), a.grad.data(), a.param.size(), a.step);
  }
  void rebase_state(const crossing_args& a) override { rebase_adam_moments(a, beta1, beta2); }
  // Atomic: a test may share one rule between engines whose CPU steps overlap.
  std::atomic<int> calls[2] = {0, 0};
};

// Momentum SGD over whole matrices: the shape of Muon's unit.
class matrix_rule final : public update_rule {
 public:
  granularity unit(std::size_t) const noexcept override { return granularity::matrix; }
  std::size_t state_count() const noexcept override { return 1; }
  void apply(const update_args& a) override {
    if (a.weight->matrix()) {
      EXPECT_EQ(a.columns, a.weight->cols);
    }
    for (std::size_t i = 0; i < a.param.size(); ++i) {
      a.state0[i] = 0.9f * a.state0[i] + a.grad[i];
      a.param[i] -= 0.01f * a.state0[i];
    }
  }
};

std::vector<weight_shape> model() {
  return {{"w0", 8, 16}, {"b0", 7, 1}, {"w1", 5, 24}, {"w2", 12, 5}, {"ln", 3, 1}};
}

// The gradient of step `step` for weight `w`: independent of the parameters,
// so every schedule sees the same gradients.
void fill_gradient(std::span<float> g, std::size_t w, std::uint64_t step) {
  std::mt19937 rng(static_cast<unsigned>(1000 * step + w));
  std::normal_distribution<float> normal(0, 1);
  for (std::size_t i = 0; i < g.size(); ++i) {
    // A few columns stand out, and which ones changes over time.
    g[i] = normal(rng) * (((i / 5 + step / 3) % 7 == 0) ? 10.0f : 1.0f);
  }
}

// The plain optimizer over whole weights, step after step.
struct reference_run {
  std::vector<weight_shape> weights = model();
  memory_host_state state{weights, 2};
  explicit reference_run(update_rule& rule, std::uint64_t steps) {
    for (std::size_t w = 0; w < weights.size(); ++w) {
      auto b = state.buffers(w);
      auto init = initial(w, weights[w].elements());
      std::copy(init.begin(), init.end(), b.param.begin());
    }
    for (std::uint64_t s = 0; s < steps; ++s) {
      std::vector<float> g;
      params.emplace_back();
      for (std::size_t w = 0; w < weights.size(); ++w) {
        g.assign(weights[w].elements(), 0);
        fill_gradient(g, w, s);
        auto b = state.buffers(w);
        update_args a;
        a.weight = &weights[w];
        a.weight_index = w;
        a.columns = static_cast<std::uint32_t>(weights[w].cols);
        a.param = b.param;
        a.grad = g;
        a.state0 = b.state0;
        a.state1 = b.state1;
        a.step = static_cast<std::int64_t>(s) + 1;
        rule.apply(a);
        params.back().emplace_back(b.param.begin(), b.param.end());
      }
    }
  }
  std::vector<std::vector<std::vector<float>>> params;  // [step][weight]
};

// ZenFlow over the stand-in: trains `steps` steps and records the device's
// compute copy after each.
struct zenflow_run {
  std::vector<weight_shape> weights = model();
  memory_host_state host;
  standin_device device;
  engine eng;
  std::vector<std::vector<std::vector<float>>> params;  // [step][weight]
  std::vector<step_report> reports;

  zenflow_run(const config& c, update_rule& rule)
      : host(weights, rule.state_count()), device(weights, rule), eng(c, weights, device, host, rule) {
    for (std::size_t w = 0; w < weights.size(); ++w) {
      const auto init = initial(w, weights[w].elements());
      device.initialize(w, init);
      std::copy(init.begin(), init.end(), host.buffers(w).param.begin());
    }
  }
  void train(std::uint64_t steps, bool apply_early = false) {
    for (std::uint64_t s = 0; s < steps; ++s) {
      // A trainer that applies the previous window during the backward.
      if (apply_early && eng.will_update()) eng.apply_previous_window();
      for (std::size_t w = 0; w < weights.size(); ++w) fill_gradient(device.gradient(w), w, s);
      reports.push_back(eng.step());
      check_ownership();
      snapshot();
    }
  }
  // A trainer that overlaps the host's part of each step with the next
  // forward: the device's update first, then the next forward may start —
  // unless the engine says it must wait — then the rest of the step. Checks
  // that the rest changes nothing the next forward reads when it need not
  // wait; returns on how many steps it had to.
  std::uint64_t train_split(std::uint64_t steps, bool apply_early) {
    std::uint64_t waited = 0;
    for (std::uint64_t s = 0; s < steps; ++s) {
      if (apply_early && eng.will_update()) eng.apply_previous_window();
      for (std::size_t w = 0; w < weights.size(); ++w) fill_gradient(device.gradient(w), w, s);
      eng.update_device();
      const bool waits = eng.device_waits_for_step();
      waited += waits;
      snapshot();
      const auto forward_reads = params.back();
      params.pop_back();
      reports.push_back(eng.step());
      check_ownership();
      snapshot();
      if (!waits) expect_same(params.back(), forward_reads, s);
    }
    return waited;
  }
  static void expect_same(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b,
                          std::uint64_t step) {
    for (std::size_t w = 0; w < a.size(); ++w)
      ASSERT_EQ(a[w], b[w]) << "step " << step << ": step() changed weight " << w << " after update_device()";
  }
  void snapshot() {
    params.emplace_back();
    for (std::size_t w = 0; w < weights.size(); ++w) {
      const auto p = device.parameters(w);
      params.back().emplace_back(p.begin(), p.end());
    }
  }
  // Every column is owned by exactly one side: the device's packed state holds
  // exactly the engine's selection, and the engine's split agrees.
  void check_ownership() {
    for (std::size_t w = 0; w < weights.size(); ++w) {
      const auto sel = eng.selected(w);
      const auto owned = device.owned_columns(w);
      ASSERT_EQ(std::vector<std::uint32_t>(sel.begin(), sel.end()),
                std::vector<std::uint32_t>(owned.begin(), owned.end()))
          << weights[w].name;
      std::size_t on_device = 0;
      for (std::uint32_t c = 0; c < weights[w].cols; ++c) on_device += eng.device_owns(w, c);
      ASSERT_EQ(on_device, sel.size());
    }
  }
};


void expect_identical(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b,
                      std::uint64_t step) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t w = 0; w < a.size(); ++w) {
    ASSERT_EQ(a[w].size(), b[w].size());
    for (std::size_t i = 0; i < a[w].size(); ++i)
      ASSERT_EQ(a[w][i], b[w][i]) << "step " << step << " weight " << w << " element " << i;
  }
}

// ZenFlow written out plainly, one step after another, for fixed update and
// select intervals: what the engine must compute, through refreshes, with or
// without overlap. It shares only the Adam arithmetic (adam_math) and the
// gradients with the engine's tests; scheduling, selection, accumulation and
// the crossing of columns are its own.
//
// Every column's master value and moments live in one place whichever side
// owns it; `compute` is what forward reads. The device counts its steps
// (one a step), the host its windows; a column's moments crossing sides are
// rescaled so that Adam's bias-corrected moments stay what they were.
struct sequential_zenflow {
  std::vector<weight_shape> weights = model();
  std::uint64_t update_interval, select_interval, warm;
  double topk;
  bool overlap;
  std::vector<std::vector<float>> master, m, v, sum, compute;
  std::vector<std::vector<bool>> on_device;
  std::vector<std::pair<std::size_t, std::uint32_t>> staged;  // (weight, column) whose compute copy lags a window
  std::int64_t host_count = 0;
  std::uint64_t window_steps = 0;
  bool selected = false;
  std::vector<std::vector<bool>> decided;  // chosen at a select boundary, made at the next window's end
  std::uint64_t crossings = 0;  // columns that changed sides at a refresh (not the first selection)
  std::vector<std::vector<std::vector<float>>> params;  // [step][weight]: compute after each step

  sequential_zenflow(double topk_, std::uint64_t update, std::uint64_t select, bool overlap_, std::uint64_t warm_)
      : update_interval(update), select_interval(select), warm(warm_), topk(topk_), overlap(overlap_) {
    for (std::size_t w = 0; w < weights.size(); ++w) {
      const std::size_t n = weights[w].elements();
      master.push_back(initial(w, n));
      compute.push_back(master.back());
      m.emplace_back(n, 0.0f);
      v.emplace_back(n, 0.0f);
      sum.emplace_back(n, 0.0f);
      on_device.emplace_back(weights[w].cols, !weights[w].matrix());
    }
  }
  float* at(std::vector<std::vector<float>>& x, std::size_t w, std::uint32_t c) {
    return x[w].data() + c * weights[w].rows;
  }
  void adam_column(std::size_t w, std::uint32_t c, const float* grad, std::int64_t step) {
    adam_math(at(master, w, c), at(m, w, c), at(v, w, c), grad, weights[w].rows, step);
  }
  void rescale(std::size_t w, std::uint32_t c, std::int64_t from, std::int64_t to) {
    if (from == 0 || from == to) return;
    auto ratio = [&](float beta) {
      const double b = beta;
      return static_cast<float>((1 - std::pow(b, static_cast<double>(to))) /
                                (1 - std::pow(b, static_cast<double>(from))));
    };
    const float f1 = ratio(beta1), f2 = ratio(beta2);
    for (std::uint64_t r = 0; r < weights[w].rows; ++r) at(m, w, c)[r] *= f1, at(v, w, c)[r] *= f2;
  }
  // The window's mean gradient of one host column, applied at `step`; the sum is consumed.
  void host_update(std::size_t w, std::uint32_t c, std::int64_t step) {
    float* s = at(sum, w, c);
    const float scale = 1.0f / static_cast<float>(window_steps);
    if (window_steps > 1)
      for (std::uint64_t r = 0; r < weights[w].rows; ++r) s[r] *= scale;
    adam_column(w, c, s, step);
    std::fill_n(s, weights[w].rows, 0.0f);
  }
  void show(std::size_t w, std::uint32_t c) { std::copy_n(at(master, w, c), weights[w].rows, at(compute, w, c)); }

  // The top topk of each matrix's columns by Σ|g| of this step's gradient,
  // ties to the lower column.
  std::vector<std::vector<bool>> choose(const std::vector<std::vector<float>>& g) const {
    std::vector<std::vector<bool>> next(weights.size());
    for (std::size_t w = 0; w < weights.size(); ++w) {
      if (!weights[w].matrix()) continue;
      const std::uint64_t rows = weights[w].rows, cols = weights[w].cols;
      std::vector<std::pair<float, std::uint32_t>> score;
      for (std::uint32_t c = 0; c < cols; ++c) {
        double l1 = 0;
        for (std::uint64_t r = 0; r < rows; ++r) l1 += std::fabs(static_cast<double>(g[w][c * rows + r]));
        score.push_back({static_cast<float>(l1), c});
      }
      std::sort(score.begin(), score.end(),
                [](auto a, auto b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
      next[w].assign(cols, false);
      const auto keep = static_cast<std::size_t>(std::ceil(topk * static_cast<double>(cols) - 1e-9));
      for (std::size_t i = 0; i < std::max<std::size_t>(1, keep); ++i) next[w][score[i].second] = true;
    }
    return next;
  }
  // The columns of `next` the device lacks join it; `device_count` is the
  // device's steps so far.
  void enter(const std::vector<std::vector<bool>>& next, std::int64_t device_count, bool first) {
    for (std::size_t w = 0; w < weights.size(); ++w) {
      if (!weights[w].matrix()) continue;
      for (std::uint32_t c = 0; c < weights[w].cols; ++c) {
        if (!next[w][c] || on_device[w][c]) continue;
        std::int64_t count = host_count;  // the window's gradient so far first, on the host
        if (window_steps > 0) {
          count = host_count + 1;
          host_update(w, c, count);
        }
        rescale(w, c, count, device_count);
        show(w, c);
        on_device[w][c] = true;
        if (!first) ++crossings;
      }
    }
  }
  // The device's columns outside `next` leave it, to be updated first by the
  // next window's CPU step.
  void leave(const std::vector<std::vector<bool>>& next, std::int64_t device_count) {
    for (std::size_t w = 0; w < weights.size(); ++w) {
      if (!weights[w].matrix()) continue;
      for (std::uint32_t c = 0; c < weights[w].cols; ++c) {
        if (next[w][c] || !on_device[w][c]) continue;
        rescale(w, c, device_count, host_count + 1);
        on_device[w][c] = false;
        ++crossings;
      }
    }
  }

  void step(std::uint64_t s) {
    std::vector<std::vector<float>> g;
    for (std::size_t w = 0; w < weights.size(); ++w) {
      g.emplace_back(weights[w].elements());
      fill_gradient(g.back(), w, s);
    }
    const bool warming = s < warm;
    if (!warming && !selected) {
      enter(choose(g), static_cast<std::int64_t>(s), true);  // the first selection, at once
      selected = true;
    }
    // A selection chosen a window ago: at the end of the next window, its
    // columns join the device before the device's update, and the others
    // leave after the host's part of the step.
    const std::uint64_t since = s + 1 - warm;
    const bool boundary = warming || since % update_interval == 0;
    if (boundary && !decided.empty()) enter(decided, static_cast<std::int64_t>(s), false);
    // The device: its columns, every step, at its own count.
    for (std::size_t w = 0; w < weights.size(); ++w)
      for (std::uint32_t c = 0; c < weights[w].cols; ++c)
        if (on_device[w][c]) {
          adam_column(w, c, &g[w][c * weights[w].rows], static_cast<std::int64_t>(s) + 1);
          show(w, c);
        }
    // The host: its columns' gradients, summed over the window.
    for (std::size_t w = 0; w < weights.size(); ++w)
      for (std::uint64_t i = 0; i < weights[w].elements(); ++i)
        if (!on_device[w][i / weights[w].rows]) sum[w][i] += g[w][i];
    ++window_steps;
    if (boundary) close(g, !warming && since % select_interval == 0, static_cast<std::int64_t>(s) + 1, !warming);
    snapshot();
  }
  // The end of a window: the previous window's result becomes visible, the
  // selection chosen a window ago takes effect, the next one is chosen (if
  // due), this window's CPU step runs.
  void close(const std::vector<std::vector<float>>& g, bool select, std::int64_t device_count, bool may_overlap) {
    for (const auto& [w, c] : staged) show(w, c);
    staged.clear();
    std::vector<std::vector<bool>> host_before(weights.size());
    for (std::size_t w = 0; w < weights.size(); ++w) {
      host_before[w].resize(weights[w].cols);
      for (std::uint32_t c = 0; c < weights[w].cols; ++c) host_before[w][c] = !on_device[w][c];
    }
    if (!decided.empty()) leave(decided, device_count);
    decided.clear();
    if (select) decided = choose(g);
    ++host_count;
    for (std::size_t w = 0; w < weights.size(); ++w)
      for (std::uint32_t c = 0; c < weights[w].cols; ++c)
        if (host_before[w][c] && !on_device[w][c]) {
          host_update(w, c, host_count);
          if (overlap && may_overlap) staged.push_back({w, c});
          else show(w, c);
        }
    window_steps = 0;
  }
  void finish() {
    for (const auto& [w, c] : staged) show(w, c);
    staged.clear();
    decided.clear();  // a selection chosen and not yet made is dropped
    if (window_steps > 0) {
      ++host_count;
      for (std::size_t w = 0; w < weights.size(); ++w)
        for (std::uint32_t c = 0; c < weights[w].cols; ++c)
          if (!on_device[w][c]) {
            host_update(w, c, host_count);
            show(w, c);
          }
      window_steps = 0;
    }
    snapshot();
  }
  void snapshot() { params.push_back(compute); }
};

// The engine against the plain sequential ZenFlow above, element by element
// after every step and after finish(): windows of 2 and 4 steps, refreshes
// every few windows (columns cross both ways), with and without overlap and
// warm-up. A column's moments crossing sides without their rebasing onto the
// other side's step count would be off by the ratio of the bias corrections.
TEST(ZenflowEngine, MatchesAPlainSequentialZenflowThroughRefreshesWithOverlap) {
  const std::uint64_t steps = 38;  // ends inside a window: finish() closes it
  struct schedule_case {
    std::uint64_t update, select;
  };
  for (const schedule_case sc : {schedule_case{4, 8}, schedule_case{2, 6}}) {
    for (const bool overlap : {false, true}) {
      for (const std::uint64_t warm : {0u, 2u}) {
        SCOPED_TRACE(testing::Message() << "update_interval " << sc.update << ", select_interval " << sc.select
                                        << ", overlap " << overlap << ", warm-up " << warm);
        adam_rule rule;
        sequential_zenflow ref(0.25, sc.update, sc.select, overlap, warm);
        for (std::uint64_t s = 0; s < steps; ++s) ref.step(s);
        ref.finish();
        // The trainer may apply the previous window early, during the
        // boundary step's backward: the same values.
        for (const bool apply_early : {false, true}) {
          zenflow_run z(step_config(0.25, sc.update, sc.select, overlap, warm), rule);
          z.train(steps, apply_early);
          for (std::uint64_t s = 0; s < steps; ++s) expect_identical(z.params[s], ref.params[s], s);
          z.eng.finish();
          z.snapshot();
          expect_identical(z.params.back(), ref.params.back(), steps);
          EXPECT_GE(z.eng.stats().refreshes, (steps - warm) / sc.select);
        }
        EXPECT_GT(ref.crossings, 10u);  // the refreshes moved columns
      }
    }
  }
}

// Rebased moments give the bias-corrected values they had: what Adam divides
// by is the same on the side a column enters as on the side it left.
TEST(ZenflowEngine, RebasedAdamMomentsKeepTheirBiasCorrectedValues) {
  std::vector<float> m = {0.5f, -2.0f, 1e-3f}, v = {0.25f, 4.0f, 1e-6f};
  const auto m0 = m, v0 = v;
  crossing_args a;
  a.columns = 1;
  a.state0 = m;
  a.state1 = v;
  a.from_step = 101;  // a host column after 101 windows ...
  a.to_step = 404;    // ... entering a device that has run 404 steps
  rebase_adam_moments(a, beta1, beta2);
  for (std::size_t i = 0; i < m.size(); ++i) {
    auto corrected = [](float x, float beta, std::int64_t t) {
      return static_cast<double>(x) / (1 - std::pow(static_cast<double>(beta), static_cast<double>(t)));
    };
    EXPECT_NEAR(corrected(m[i], beta1, 404), corrected(m0[i], beta1, 101), 1e-6 * std::fabs(corrected(m0[i], beta1, 101)));
    EXPECT_NEAR(corrected(v[i], beta2, 404), corrected(v0[i], beta2, 101), 1e-6 * std::fabs(corrected(v0[i], beta2, 101)));
    EXPECT_GT(v[i], 3.0f * v0[i]);  // v's correction at 101 steps is (1 - 0.999^101) ≈ 0.096, at 404 ≈ 0.33
  }
}

TEST(ZenflowEngine, TopkOneReproducesTheOptimizerExactly) {
  for (bool overlap : {false, true}) {
    for (std::uint64_t warm : {0u, 2u}) {
      adam_rule rule;
      const reference_run ref(rule, 12);
      zenflow_run z(step_config(1.0, 4, 8, overlap, warm), rule);
      z.train(12);
      for (std::uint64_t s = 0; s < 12; ++s) expect_identical(z.params[s], ref.params[s], s);
    }
  }
}

TEST(ZenflowEngine, IntervalOneWithoutOverlapReproducesTheOptimizerExactlyThroughRefreshes) {
  adam_rule rule;
  const reference_run ref(rule, 15);
  // A refresh after every step: columns change hands all the time.
  zenflow_run z(step_config(0.3, 1, 1, false, 1), rule);
  z.train(15);
  for (std::uint64_t s = 0; s < 15; ++s) expect_identical(z.params[s], ref.params[s], s);
  EXPECT_GE(z.eng.stats().refreshes, 12u);  // hand-overs that moved columns: most of the 13 before the last step
  EXPECT_GT(rule.calls[0], 0);  // both sides did work
  EXPECT_GT(rule.calls[1], 0);
}

TEST(ZenflowEngine, WholeMatrixRuleSelectsWholeMatricesAndStaysExact) {
  matrix_rule rule;
  const reference_run ref(rule, 10);
  zenflow_run z(step_config(0.5, 1, 3, false), rule);
  z.train(10);
  for (std::uint64_t s = 0; s < 10; ++s) expect_identical(z.params[s], ref.params[s], s);
  std::size_t whole = 0;
  for (std::size_t w = 0; w < z.weights.size(); ++w) {
    if (!z.weights[w].matrix()) continue;
    const std::size_t n = z.eng.selected(w).size();
    EXPECT_TRUE(n == 0 || n == z.weights[w].cols);
    whole += n == z.weights[w].cols;
  }
  EXPECT_EQ(whole, 2u);  // half of the three matrices, rounded up
}

// With overlap the host-owned columns the device computes with are exactly one
// window behind the synchronous run, the device-owned ones not at all, and
// finish() brings both runs to the same parameters.
TEST(ZenflowEngine, OverlapLagsByExactlyOneWindowAndCatchesUpAtFinish) {
  adam_rule rule;
  const std::uint64_t window = 3, steps = 12;
  zenflow_run sync(step_config(0.25, window, 1000, false), rule);
  zenflow_run async(step_config(0.25, window, 1000, true), rule);
  sync.train(steps);
  async.train(steps);
  for (std::uint64_t s = 0; s < steps; ++s) {
    for (std::size_t w = 0; w < sync.weights.size(); ++w) {
      const std::uint64_t rows = sync.weights[w].rows;
      for (std::uint32_t c = 0; c < sync.weights[w].cols; ++c) {
        // Windows end at steps 2, 5, 8, 11: the async run applies window k at
        // the end of window k+1, so it shows the sync state of one window earlier.
        const bool device_side = async.eng.device_owns(w, c);
        std::int64_t lagged = static_cast<std::int64_t>(s) - static_cast<std::int64_t>(window);
        for (std::uint64_t r = 0; r < rows; ++r) {
          const float got = async.params[s][w][c * rows + r];
          if (device_side) {
            ASSERT_EQ(got, sync.params[s][w][c * rows + r]) << "step " << s;
          } else if (lagged >= 0) {
            ASSERT_EQ(got, sync.params[static_cast<std::size_t>(lagged)][w][c * rows + r]) << "step " << s;
          }
        }
      }
    }
  }
  // Applying the previous window early, during the boundary step's backward,
  // changes no value.
  zenflow_run early(step_config(0.25, window, 1000, true), rule);
  early.train(steps, true);
  for (std::uint64_t s = 0; s < steps; ++s) expect_identical(early.params[s], async.params[s], s);

  sync.eng.finish();
  async.eng.finish();
  sync.snapshot();
  async.snapshot();
  expect_identical(async.params.back(), sync.params.back(), steps);
  EXPECT_EQ(async.eng.stats().cpu_steps, steps / window);
}

// update_device() then step() computes what step() alone does, and the next
// forward waits for step() only where step() changes the device's values.
TEST(ZenflowEngine, SplitStepMatchesStepAndTheNextForwardWaitsOnlyWhenItMust) {
  adam_rule rule;
  const std::uint64_t steps = 14;
  struct setup {
    config c;
    bool apply_early;
    std::uint64_t fewest_waits, most_waits;  // of 14 steps
  };
  const setup setups[] = {
      // Windows of 2, selections chosen every 6 steps (after steps 5 and 11)
      // and made a window later (in update_device() of steps 7 and 13),
      // overlap, the previous window applied early: no step waits.
      {step_config(0.25, 2, 6, true), true, 0, 0},
      // The same without applying early: the boundaries that apply a window
      // in step() (after steps 3, 5, 9 and 11; the first has none) wait;
      // at steps 7 and 13 update_device() applied it, to hand columns over.
      {step_config(0.25, 2, 6, true), false, 4, 4},
      // No overlap: every boundary applies its window at once.
      {step_config(0.25, 2, 6, false), false, 7, 7},
      // Two warm-up steps, then windows of 3 with overlap applied early.
      {step_config(0.25, 3, 1000, true, 2), true, 2, 2},
  };
  for (const auto& su : setups) {
    zenflow_run plain(su.c, rule), split(su.c, rule);
    plain.train(steps, su.apply_early);
    const std::uint64_t waited = split.train_split(steps, su.apply_early);
    EXPECT_GE(waited, su.fewest_waits) << "setup " << (&su - setups);
    EXPECT_LE(waited, su.most_waits) << "setup " << (&su - setups);
    for (std::uint64_t s = 0; s < steps; ++s) expect_identical(split.params[s], plain.params[s], s);
    for (std::uint64_t s = 0; s < steps; ++s) {
      EXPECT_EQ(split.reports[s].refreshed, plain.reports[s].refreshed) << s;
      EXPECT_EQ(split.reports[s].update_boundary, plain.reports[s].update_boundary) << s;
    }
  }
}

TEST(ZenflowEngine, AutomaticUpdateIntervalClosesWindowsFromGradientMass) {
  adam_rule rule;
  config c;
  c.topk_ratio = 0.2;
  c.strategy = select_strategy::step;
  c.select_interval = 50;
  c.auto_ratio = 0.6;
  zenflow_run z(c, rule);
  z.train(30);
  const auto windows = z.eng.stats().cpu_steps;
  EXPECT_GT(windows, 1u);
  EXPECT_LT(windows, 30u);  // the unimportant mass takes more than a step to catch up
}

// Records the CPUs each host-side apply() ran on.
class affinity_rule final : public update_rule {
 public:
  granularity unit(std::size_t) const noexcept override { return granularity::columns; }
  std::size_t state_count() const noexcept override { return 2; }
  void apply(const update_args& a) override {
    if (a.where == side::host) seen.push_back(current_affinity());
  }
  std::vector<std::vector<int>> seen;  // written by one thread at a time (the engine's CPU step)
};

TEST(ZenflowEngine, OverlappedCpuStepRunsOnTheOptimizerShareOfTheCores) {
  affinity_rule rule;
  config c = step_config(0.25, 2, 1000, true);
  c.pt_reserved_cores_perc = 0.5;
  {
    zenflow_run z(c, rule);
    EXPECT_EQ(z.eng.cores().optimizer, split_cores(0.5).optimizer);
    z.train(6);
    z.eng.finish();
    ASSERT_FALSE(rule.seen.empty());
    for (const auto& cpus : rule.seen) EXPECT_EQ(cpus, z.eng.cores().optimizer);
  }
  // The trainer's own thread is left as it was.
  EXPECT_EQ(current_affinity().size(), split_cores(0.0).optimizer.size());
}

// A host state that reports the pace of each paced pass and, when asked to,
// holds the pass until hurried (a state streamed from storage would spread
// its I/O over it), then runs it over a state in memory.
class paced_host_state final : public host_state {
 public:
  paced_host_state(const std::vector<weight_shape>& weights, std::size_t states, bool hold)
      : inner(weights, states), hold_(hold) {}
  void for_each(std::span<const std::size_t> weights,
                const std::function<void(std::size_t, const host_buffers&)>& fn) override {
    inner.for_each(weights, fn);
  }
  void for_each_paced(std::span<const std::size_t> weights,
                      const std::function<void(std::size_t, const host_buffers&)>& fn, stream_pace& pace) override {
    spreads.push_back(pace.spread_over());
    if (hold_) pace.wait_until(std::chrono::steady_clock::now() + std::chrono::minutes(1));
    inner.for_each(weights, fn);
  }
  memory_host_state inner;
  std::vector<std::chrono::nanoseconds> spreads;  // written by the engine's CPU-step thread
 private:
  bool hold_;
};

// Overlapped with a fixed update_interval, the CPU step is paced over 3/4 of
// the window the steps so far measure (here at least 4 × 10 ms); a trainer
// that waits for it (a boundary, finish(), the engine's end) hurries it.
TEST(ZenflowEngine, OverlappedCpuStepIsPacedOverTheWindowAndHurriedWhenWaitedFor) {
  using namespace std::chrono_literals;
  adam_rule rule;
  const auto weights = model();
  for (const bool hold : {false, true}) {
    SCOPED_TRACE(hold ? "a pass held until hurried" : "a pass in memory");
    paced_host_state host(weights, rule.state_count(), hold);
    standin_device device(weights, rule);
    for (std::size_t w = 0; w < weights.size(); ++w) {
      const auto init = initial(w, weights[w].elements());
      device.initialize(w, init);
      std::copy(init.begin(), init.end(), host.inner.buffers(w).param.begin());
    }
    const auto started = std::chrono::steady_clock::now();
    {
      engine eng(step_config(0.25, 4, 1000, true), weights, device, host, rule);
      for (std::uint64_t s = 0; s < 12; ++s) {
        for (std::size_t w = 0; w < weights.size(); ++w) fill_gradient(device.gradient(w), w, s);
        std::this_thread::sleep_for(10ms);  // the forward and backward
        eng.step();
      }
      eng.finish();
      ASSERT_GE(host.spreads.size(), 3u);
      // The first window may end before two steps were timed; the later ones
      // are paced. (The last may be hurried by finish() before its pass asks.)
      for (std::size_t k = 1; k + 1 < host.spreads.size(); ++k)
        EXPECT_GE(host.spreads[k], 30ms) << "window " << k;
      EXPECT_GE(eng.stats().cpu_step_pace, 30ms);
    }
    // Held passes end when the trainer waits (each boundary, finish()), not after a minute each.
    EXPECT_LT(std::chrono::steady_clock::now() - started, 30s);
  }
}

TEST(ZenflowEngine, RefusesBadSetups) {
  adam_rule rule;
  std::vector<weight_shape> weights = model();
  memory_host_state host(weights, 2);
  standin_device device(weights, rule);
  config bad;
  bad.topk_ratio = 0;
  EXPECT_THROW(engine(bad, weights, device, host, rule), user_error);
  EXPECT_THROW(engine(config{}, {}, device, host, rule), user_error);
  EXPECT_THROW(engine(config{}, {{"empty", 0, 4}}, device, host, rule), user_error);
}

}  // namespace
}  // namespace tierflow::zenflow
