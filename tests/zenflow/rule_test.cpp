// optim::zenflow_rule: hyper-parameters that change between steps reach the
// device's next update and the CPU step of the window that step ends, and
// no other.
#include "tierflow/optim/zenflow_rule.hpp"

#include <algorithm>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "tierflow/core/error.hpp"
#include "tierflow/core/zenflow/cpu_device.hpp"
#include "tierflow/core/zenflow/engine.hpp"
#include "tierflow/core/zenflow/standin.hpp"
#include "../core/zenflow_test_support.hpp"

namespace tierflow::optim {
namespace {

using zenflow::weight_shape;

std::vector<weight_shape> shapes() { return {{"w", 6, 10}, {"b", 6, 1}, {"m", 4, 8}}; }

// Trains over the CPU device with lr 1e-2 until step `change`, then `lr_after`;
// returns the parameters after `steps` steps and finish().
std::vector<std::vector<float>> train(const zenflow::config& cfg, std::uint64_t steps, std::uint64_t change,
                                      float lr_after, bool muon) {
  const auto s = shapes();
  executor ex(1);
  zenflow_rule rule({optimizer_kind::adamw, optimizer_kind::adamw, muon ? optimizer_kind::muon : optimizer_kind::adamw},
                    ex, ex);
  std::vector<std::vector<float>> params, grads(s.size());
  std::vector<std::span<float>> views;
  for (std::size_t w = 0; w < s.size(); ++w) params.push_back(zenflow::initial(w, s[w].elements()));
  for (auto& p : params) views.emplace_back(p);
  zenflow::memory_host_state host(s, 2);
  for (std::size_t w = 0; w < s.size(); ++w) std::copy(params[w].begin(), params[w].end(), host.buffers(w).param.begin());
  zenflow::cpu_device device(s, rule, views);
  zenflow::engine eng(cfg, s, device, host, rule);
  auto set_lr = [&](float lr) {
    for (std::size_t w = 0; w < s.size(); ++w) {
      if (rule.kind(w) == optimizer_kind::muon) {
        muon_options m = rule.muon(w);
        m.lr = lr;
        m.weight_decay = 0.0f;
        rule.set_muon(w, m);
      } else {
        adam_options a = rule.adam(w);
        a.lr = lr;
        rule.set_adam(w, a);
      }
    }
  };
  set_lr(1e-2f);
  for (std::uint64_t step = 0; step < steps; ++step) {
    if (step == change) set_lr(lr_after);
    for (std::size_t w = 0; w < s.size(); ++w) {
      grads[w].assign(s[w].elements(), 0.0f);
      std::mt19937 rng(static_cast<unsigned>(100 * step + w));
      std::normal_distribution<float> normal(0, 1);
      for (auto& g : grads[w]) g = normal(rng);
      device.set_gradient(w, grads[w]);
    }
    eng.step();
  }
  eng.finish();
  return params;
}

TEST(ZenflowRule, ALearningRateChangeTakesEffectFromTheNextStepOnBothSides) {
  // update_interval 2: windows end after steps 1, 3, 5, ... A learning rate
  // of 0 from step 4 on freezes the parameters: every update from then on
  // (the device's from step 4, the host's windows ending at 5 and 7)
  // changes nothing, so the run equals one stopped after step 3. The
  // window that ended at step 3 ran (without overlap) or runs (with it,
  // on the engine's thread while step 4 sets lr 0) with the lr of step 3.
  for (const bool overlap : {false, true}) {
    for (const bool muon : {false, true}) {
      const zenflow::config cfg = zenflow::step_config(0.3, 2, 4, overlap);
      const auto frozen = train(cfg, 8, 4, 0.0f, muon);
      const auto stopped = train(cfg, 4, 99, 0.0f, muon);
      const auto went_on = train(cfg, 8, 99, 0.0f, muon);
      for (std::size_t w = 0; w < frozen.size(); ++w) {
        EXPECT_EQ(frozen[w], stopped[w]) << "weight " << w << " overlap " << overlap << " muon " << muon;
        EXPECT_NE(went_on[w], stopped[w]) << "weight " << w;
      }
    }
  }
}

TEST(ZenflowRule, TheHostSideAppliesTheValuesFixedAtItsStepsBeginning) {
  executor ex(1);
  zenflow_rule rule({optimizer_kind::adamw}, ex, ex);
  const weight_shape shape{"w", 4, 1};
  adam_options a = adam_options::adamw();
  a.lr = 0.5f;
  rule.set_adam(0, a);
  rule.begin_host_step(1);
  a.lr = 0.0f;
  a.weight_decay = 0.0f;
  rule.set_adam(0, a);  // the trainer's next step, while the host's step 1 has yet to run
  std::vector<float> p_host(4, 1.0f), p_device(4, 1.0f), g(4, 1.0f), m(4), v(4), m2(4), v2(4);
  zenflow::update_args args;
  args.weight = &shape;
  args.columns = 1;
  args.grad = g;
  args.step = 1;
  args.param = p_host;
  args.state0 = m;
  args.state1 = v;
  args.where = zenflow::side::host;
  rule.apply(args);
  args.param = p_device;
  args.state0 = m2;
  args.state1 = v2;
  args.where = zenflow::side::device;
  rule.apply(args);
  EXPECT_LT(p_host[0], 0.6f);    // lr 0.5: one Adam step moves it by about 0.5
  EXPECT_EQ(p_device[0], 1.0f);  // lr 0, no decay
}

TEST(ZenflowRule, RefusesAmsgradAndBadValuesKeepingTheOldOnes) {
  executor ex(1);
  zenflow_rule rule({optimizer_kind::adamw, optimizer_kind::muon}, ex, ex);
  adam_options a = adam_options::adamw();
  a.amsgrad = amsgrad::on;
  EXPECT_THROW(rule.set_adam(0, a), user_error);
  a = adam_options::adamw();
  a.lr = -1.0f;
  EXPECT_THROW(rule.set_adam(0, a), user_error);
  EXPECT_EQ(rule.adam(0).lr, adam_options::adamw().lr);
  muon_options m;
  m.momentum = 1.5f;
  EXPECT_THROW(rule.set_muon(1, m), user_error);
  EXPECT_EQ(rule.unit(0), zenflow::granularity::columns);
  EXPECT_EQ(rule.unit(1), zenflow::granularity::matrix);
}

}  // namespace
}  // namespace tierflow::optim
