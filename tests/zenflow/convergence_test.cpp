// ZenFlow against plain AdamW on a small real model: a two-layer MLP learning
// a teacher network's labels, trained from the same initial weights on the
// same batches. The update arithmetic is tierflow's own AdamW (optim/) on both
// sides of ZenFlow; the device is the host stand-in.
//
// The inputs' features have scales spread over 1.5 decades, as activations
// with outlier features do, so the gradient's column mass is concentrated
// the way ZenFlow assumes (a few columns carry most of it).
//
// What the tolerance is and why. ZenFlow steps 90% of each matrix's columns
// once per window, from the window's mean gradient, one window late
// (overlap_step), so its loss trails AdamW's while the loss is falling. It is
// deterministic here (the lag is exactly one window whatever the timing), so
// these are the figures, not a sample:
//   fine-tuning, 480 steps          final loss vs AdamW   last-quarter mean
//     topk 0.1,  interval 4, overlap      +14.8%               +10.4%
//     topk 0.1,  interval 4, no overlap   +14.2%               +10.1%
//     topk 0.25, interval 2, overlap       +7.1%                +3.7%
//     control: host side never updates    +55.8%               +47.9%
//   from scratch, 960 steps
//     topk 0.1,  interval 4, overlap      +36.2%               +24.5%
//     control: host side never updates   +170.4%              +136.8%
// The bound asserted for fine-tuning is 1.25× AdamW's loss: the measured
// gaps with margin for a change of data or seed, and still well short of the
// control, so it tells a working host side from a broken one. From scratch
// the bound is looser (2×, and well below the control). How close ZenFlow
// comes is mostly topk_ratio and update_interval: the smaller the window and
// the larger the device's share, the closer.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "tierflow/core/zenflow/engine.hpp"
#include "tierflow/core/zenflow/standin.hpp"
#include "tierflow/optim/adam.hpp"
#include "tierflow/optim/executor.hpp"
#include "../core/zenflow_test_support.hpp"

namespace tierflow::zenflow {
namespace {

constexpr std::size_t in_dim = 32, hidden = 128, classes = 10;
constexpr std::size_t samples = 4096, batch = 64;

// The data: x with per-feature scales from 0.1 to 3, labels from a fixed
// random teacher MLP (tanh hidden layer).
// `shift` > 0 perturbs the teacher's output layer by that much relative
// noise: the same inputs, partly different labels (a fine-tuning task).
struct data_set {
  std::vector<float> x;             // samples × in_dim
  std::vector<int> label;           // samples
  explicit data_set(float shift = 0.0f) : x(samples * in_dim), label(samples) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0, 1);
    std::vector<float> scale(in_dim);
    for (std::size_t j = 0; j < in_dim; ++j)
      scale[j] = 0.1f * std::pow(30.0f, static_cast<float>(j) / static_cast<float>(in_dim - 1));
    std::shuffle(scale.begin(), scale.end(), rng);
    const std::size_t teacher_hidden = 48;
    std::vector<float> t1(teacher_hidden * in_dim), t2(classes * teacher_hidden);
    for (auto& w : t1) w = normal(rng) / std::sqrt(static_cast<float>(in_dim));
    for (auto& w : t2) w = normal(rng) / std::sqrt(static_cast<float>(teacher_hidden));
    std::mt19937 shift_rng(13);
    for (auto& w : t2) w += shift * normal(shift_rng) / std::sqrt(static_cast<float>(teacher_hidden));
    std::vector<float> h(teacher_hidden);
    for (std::size_t s = 0; s < samples; ++s) {
      float* xs = &x[s * in_dim];
      for (std::size_t j = 0; j < in_dim; ++j) xs[j] = normal(rng) * scale[j];
      for (std::size_t i = 0; i < teacher_hidden; ++i) {
        float a = 0;
        for (std::size_t j = 0; j < in_dim; ++j) a += t1[i * in_dim + j] * xs[j];
        h[i] = std::tanh(a);
      }
      int best = 0;
      float best_logit = -1e30f;
      for (std::size_t k = 0; k < classes; ++k) {
        float z = 0;
        for (std::size_t i = 0; i < teacher_hidden; ++i) z += t2[k * teacher_hidden + i] * h[i];
        if (z > best_logit) best_logit = z, best = static_cast<int>(k);
      }
      label[s] = best;
    }
  }
};

// The student: weights stored as ZenFlow lays them out, a 2-D weight
// transposed so that column j (input feature j) is contiguous.
//   0: W1ᵀ, rows = hidden, cols = in_dim      1: b1 (hidden)
//   2: W2ᵀ, rows = classes, cols = hidden     3: b2 (classes)
std::vector<weight_shape> shapes() {
  return {{"w1", hidden, in_dim}, {"b1", hidden, 1}, {"w2", classes, hidden}, {"b2", classes, 1}};
}

std::vector<std::vector<float>> initial_weights() {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0, 1);
  std::vector<std::vector<float>> w;
  for (const auto& s : shapes()) {
    std::vector<float> v(s.elements(), 0.0f);
    if (s.matrix()) {
      for (auto& e : v) e = normal(rng) / std::sqrt(static_cast<float>(s.cols));
    }
    w.push_back(std::move(v));
  }
  return w;
}

// Forward and backward over samples [first, first+count): mean cross-entropy,
// and the gradient of each weight into `grad` (same layout), when given.
double loss_and_gradient(const data_set& d, const std::vector<std::span<const float>>& w, std::size_t first,
                         std::size_t count, const std::vector<std::span<float>>* grad) {
  const float* w1 = w[0].data();  // [j][i]: feature j, hidden unit i
  const float* b1 = w[1].data();
  const float* w2 = w[2].data();  // [i][k]: hidden unit i, class k
  const float* b2 = w[3].data();
  if (grad) {
    for (auto& g : *grad) std::fill(g.begin(), g.end(), 0.0f);
  }
  std::vector<float> a(hidden), h(hidden), z(classes), dz(classes), dh(hidden);
  double loss = 0;
  for (std::size_t s = first; s < first + count; ++s) {
    const float* x = &d.x[s * in_dim];
    for (std::size_t i = 0; i < hidden; ++i) a[i] = b1[i];
    for (std::size_t j = 0; j < in_dim; ++j)
      for (std::size_t i = 0; i < hidden; ++i) a[i] += w1[j * hidden + i] * x[j];
    for (std::size_t i = 0; i < hidden; ++i) h[i] = std::max(a[i], 0.0f);
    for (std::size_t k = 0; k < classes; ++k) z[k] = b2[k];
    for (std::size_t i = 0; i < hidden; ++i)
      for (std::size_t k = 0; k < classes; ++k) z[k] += w2[i * classes + k] * h[i];
    const float zmax = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (std::size_t k = 0; k < classes; ++k) sum += std::exp(static_cast<double>(z[k] - zmax));
    const int y = d.label[s];
    loss += std::log(sum) - static_cast<double>(z[static_cast<std::size_t>(y)] - zmax);
    if (!grad) continue;
    const float inv = 1.0f / static_cast<float>(count);
    for (std::size_t k = 0; k < classes; ++k)
      dz[k] = (static_cast<float>(std::exp(static_cast<double>(z[k] - zmax)) / sum) -
               (static_cast<int>(k) == y ? 1.0f : 0.0f)) * inv;
    float* g1 = (*grad)[0].data();
    float* gb1 = (*grad)[1].data();
    float* g2 = (*grad)[2].data();
    float* gb2 = (*grad)[3].data();
    for (std::size_t k = 0; k < classes; ++k) gb2[k] += dz[k];
    for (std::size_t i = 0; i < hidden; ++i) {
      float back = 0;
      for (std::size_t k = 0; k < classes; ++k) {
        g2[i * classes + k] += h[i] * dz[k];
        back += w2[i * classes + k] * dz[k];
      }
      dh[i] = a[i] > 0 ? back : 0.0f;
      gb1[i] += dh[i];
    }
    for (std::size_t j = 0; j < in_dim; ++j)
      for (std::size_t i = 0; i < hidden; ++i) g1[j * hidden + i] += x[j] * dh[i];
  }
  return loss / static_cast<double>(count);
}

// tierflow's AdamW over the spans the engine hands it, on either side; a
// control may switch the host side off.
class adamw_rule final : public update_rule {
 public:
  explicit adamw_rule(bool host_updates = true) : host_updates_(host_updates) {}
  granularity unit(std::size_t) const noexcept override { return granularity::columns; }
  std::size_t state_count() const noexcept override { return 2; }
  void apply(const update_args& a) override {
    if (a.where == side::host && !host_updates_) return;
    optim::adam_sub_group g{a.param, optim::fp32_ref(a.grad), optim::fp32_ref(a.state0), optim::fp32_ref(a.state1),
                            {}, {}};
    adam_.step(ex_, g, {.step = a.step});
  }
  void rebase_state(const crossing_args& a) override {
    rebase_adam_moments(a, static_cast<double>(options_.beta1), static_cast<double>(options_.beta2));
  }

 private:
  bool host_updates_;
  optim::executor ex_{1};
  optim::adam_options options_{.lr = 3e-3f, .weight_decay = 1e-4f};
  optim::adam_optimizer adam_{options_};
};


struct curve {
  std::vector<double> batch_loss;  // per step, before the step's update
  double final_loss = 0;           // over the whole data set after training
  double tail_mean(std::size_t from) const {
    return std::accumulate(batch_loss.begin() + static_cast<std::ptrdiff_t>(from), batch_loss.end(), 0.0) /
           static_cast<double>(batch_loss.size() - from);
  }
};

std::vector<std::span<const float>> views(const std::vector<std::vector<float>>& w) {
  return {w.begin(), w.end()};
}

// AdamW over every weight, every step, from `w` (updated in place).
curve train_adamw(const data_set& d, std::vector<std::vector<float>>& w, std::size_t steps) {
  const auto s = shapes();
  std::vector<std::vector<float>> g, m, v;
  for (const auto& x : w) g.emplace_back(x.size()), m.emplace_back(x.size()), v.emplace_back(x.size());
  std::vector<std::span<float>> gs(g.begin(), g.end());
  adamw_rule rule;
  curve c;
  for (std::size_t step = 0; step < steps; ++step) {
    c.batch_loss.push_back(loss_and_gradient(d, views(w), (step * batch) % samples, batch, &gs));
    for (std::size_t k = 0; k < w.size(); ++k) {
      update_args a;
      a.weight = &s[k];
      a.weight_index = k;
      a.columns = static_cast<std::uint32_t>(s[k].cols);
      a.param = w[k];
      a.grad = g[k];
      a.state0 = m[k];
      a.state1 = v[k];
      a.step = static_cast<std::int64_t>(step) + 1;
      rule.apply(a);
    }
  }
  c.final_loss = loss_and_gradient(d, views(w), 0, samples, nullptr);
  return c;
}

curve train_zenflow(const data_set& d, const std::vector<std::vector<float>>& init, std::size_t steps,
                    const config& cfg, bool host_updates = true) {
  const auto s = shapes();
  adamw_rule rule(host_updates);
  memory_host_state host(s, 2);
  standin_device device(s, rule);
  for (std::size_t k = 0; k < s.size(); ++k) {
    device.initialize(k, init[k]);
    std::copy(init[k].begin(), init[k].end(), host.buffers(k).param.begin());
  }
  engine eng(cfg, s, device, host, rule);
  curve c;
  for (std::size_t step = 0; step < steps; ++step) {
    std::vector<std::span<const float>> w;
    std::vector<std::span<float>> g;
    for (std::size_t k = 0; k < s.size(); ++k) {
      w.push_back(device.parameters(k));
      g.push_back(device.gradient(k));
    }
    c.batch_loss.push_back(loss_and_gradient(d, w, (step * batch) % samples, batch, &g));
    eng.step();
  }
  eng.finish();
  std::vector<std::span<const float>> w;
  for (std::size_t k = 0; k < s.size(); ++k) w.push_back(device.parameters(k));
  c.final_loss = loss_and_gradient(d, w, 0, samples, nullptr);
  return c;
}

// The bound on ZenFlow's loss relative to AdamW's when fine-tuning (see the
// file's comment for what was measured).
constexpr double tolerance = 1.25;

// The optimizer threads are the test's own (one): no core split.
config zenflow_config(double topk, std::uint64_t update, std::uint64_t select, bool overlap) {
  config c = step_config(topk, update, select, overlap);
  c.pt_reserved_cores_perc = 0.0;
  return c;
}

void print_curves(const char* name, const curve& adam, const curve& zen) {
  const std::size_t steps = adam.batch_loss.size();
  std::printf("%s: step  adamw  zenflow (batch loss, mean of 40 steps)\n", name);
  for (std::size_t s = 0; s + 40 <= steps; s += steps / 8) {
    auto mean = [&](const curve& c) {
      return std::accumulate(c.batch_loss.begin() + static_cast<std::ptrdiff_t>(s),
                             c.batch_loss.begin() + static_cast<std::ptrdiff_t>(s + 40), 0.0) / 40.0;
    };
    std::printf("  %4zu  %.4f  %.4f\n", s, mean(adam), mean(zen));
  }
  std::printf("  final loss on all %zu samples: adamw %.4f, zenflow %.4f (%+.1f%%); last quarter's mean %+.1f%%\n",
              samples, adam.final_loss, zen.final_loss, 100.0 * (zen.final_loss / adam.final_loss - 1.0),
              100.0 * (zen.tail_mean(steps * 3 / 4) / adam.tail_mean(steps * 3 / 4) - 1.0));
}

config standard() { return zenflow_config(0.1, 4, 40, true); }

// Fine-tuning, ZenFlow's use: a model trained on one task is tuned to a
// related one (the teacher's output layer moved), with fresh optimizer state.
struct fine_tuning {
  data_set task{0.5f};
  std::vector<std::vector<float>> pretrained = initial_weights();
  curve adam;
  static constexpr std::size_t steps = 480;
  fine_tuning() {
    const data_set base;
    train_adamw(base, pretrained, 800);
    auto w = pretrained;
    adam = train_adamw(task, w, steps);
  }
};

TEST(ZenflowConvergence, FineTuningLossStaysCloseToAdamW) {
  const fine_tuning ft;
  const std::size_t tail = fine_tuning::steps * 3 / 4;
  struct run {
    const char* name;
    config cfg;
  };
  for (const run& r : {run{"fine-tuning: topk 0.1, interval 4, overlap", standard()},
                       run{"fine-tuning: topk 0.1, interval 4, no overlap", zenflow_config(0.1, 4, 40, false)},
                       run{"fine-tuning: topk 0.25, interval 2, overlap", zenflow_config(0.25, 2, 20, true)}}) {
    const curve zen = train_zenflow(ft.task, ft.pretrained, fine_tuning::steps, r.cfg);
    print_curves(r.name, ft.adam, zen);
    EXPECT_LT(zen.tail_mean(tail), tolerance * ft.adam.tail_mean(tail)) << r.name;
    EXPECT_LT(zen.final_loss, tolerance * ft.adam.final_loss) << r.name;
  }
}

TEST(ZenflowConvergence, AHostSideThatNeverUpdatesFallsOutsideTheTolerance) {
  const fine_tuning ft;
  const curve broken = train_zenflow(ft.task, ft.pretrained, fine_tuning::steps, standard(), /*host_updates=*/false);
  print_curves("fine-tuning control: host side off", ft.adam, broken);
  EXPECT_GT(broken.final_loss, tolerance * ft.adam.final_loss);
}

// From scratch the loss keeps falling fast for the whole run, and ZenFlow's
// host columns take one step per window: it trails AdamW by more. Recorded,
// with a looser bound: it must still clearly beat the device side alone.
TEST(ZenflowConvergence, FromScratchTrailsAdamWButLearns) {
  const data_set d;
  const std::size_t steps = 960;
  auto w = initial_weights();
  const curve adam = train_adamw(d, w, steps);
  ASSERT_LT(adam.final_loss, 0.3 * std::log(10.0));  // the model learns: well below chance (ln 10)
  const curve zen = train_zenflow(d, initial_weights(), steps, standard());
  const curve device_only = train_zenflow(d, initial_weights(), steps, standard(), /*host_updates=*/false);
  print_curves("from scratch: topk 0.1, interval 4, overlap", adam, zen);
  print_curves("from scratch control: host side off", adam, device_only);
  EXPECT_LT(zen.final_loss, 2.0 * adam.final_loss);
  EXPECT_LT(zen.final_loss, 0.6 * device_only.final_loss);
}

}  // namespace
}  // namespace tierflow::zenflow
