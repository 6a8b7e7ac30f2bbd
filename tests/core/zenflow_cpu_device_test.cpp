// ZenFlow's CPU device over the trainer's own buffers against the stand-in,
// the host's state streamed from NVMe against the same state in memory, and
// the engine's checkpoints: a run resumed from one against the run that went
// on.
#include "tierflow/core/zenflow/cpu_device.hpp"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "../cli/temp_dir.hpp"
#include "small_store.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/core/zenflow/engine.hpp"
#include "tierflow/core/zenflow/standin.hpp"
#include "tierflow/core/zenflow/streamed_host_state.hpp"
#include "tierflow/tiers/checkpoint.hpp"
#include "zenflow_test_support.hpp"

namespace tierflow::zenflow {
namespace {

using testing::link_bytes;
using testing::small_store;

constexpr float beta1 = 0.9f, beta2 = 0.999f;

// Adam in fp32, the same arithmetic everywhere: agreement is exact or not at all.
class adam_rule final : public update_rule {
 public:
  granularity unit(std::size_t) const noexcept override { return granularity::columns; }
  std::size_t state_count() const noexcept override { return 2; }
  void apply(const update_args& a) override {
    if (a.where == side::host) {
      // The host's step count is announced before any update that uses it.
      EXPECT_EQ(a.step, begun) << "a host update at step " << a.step << " before begin_host_step";
    }
    const float lr = 1e-2f, eps = 1e-8f;
    const float c1 = 1.0f - std::pow(beta1, static_cast<float>(a.step));
    const float c2 = std::sqrt(1.0f - std::pow(beta2, static_cast<float>(a.step)));
    for (std::size_t i = 0; i < a.param.size(); ++i) {
      const float g = a.grad[i];
      a.state0[i] = beta1 * a.state0[i] + (1 - beta1) * g;
      a.state1[i] = beta2 * a.state1[i] + (1 - beta2) * g * g;
      a.param[i] -= lr / c1 * a.state0[i] / (std::sqrt(a.state1[i]) / c2 + eps);
    }
  }
  void rebase_state(const crossing_args& a) override { rebase_adam_moments(a, beta1, beta2); }
  void begin_host_step(std::int64_t host_step) override {
    EXPECT_EQ(host_step, begun + 1) << "host steps announced out of order";
    begun = host_step;
  }
  std::int64_t begun = 0;
};

std::vector<weight_shape> model() {
  return {{"w0", 8, 16}, {"b0", 7, 1}, {"w1", 5, 24}, {"w2", 12, 5}, {"ln", 3, 1}};
}

void fill_gradient(std::span<float> g, std::size_t w, std::uint64_t step) {
  std::mt19937 rng(static_cast<unsigned>(1000 * step + w));
  std::normal_distribution<float> normal(0, 1);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = normal(rng) * (((i / 5 + step / 3) % 7 == 0) ? 10.0f : 1.0f);
}

using snapshot = std::vector<std::vector<float>>;  // [weight]

// The stand-in, as the engine's own tests drive it.
struct standin_run {
  std::vector<weight_shape> weights = model();
  adam_rule rule;
  memory_host_state host{weights, 2};
  standin_device device{weights, rule};
  std::unique_ptr<engine> eng;
  explicit standin_run(const config& c) {
    for (std::size_t w = 0; w < weights.size(); ++w) {
      const auto init = initial(w, weights[w].elements());
      device.initialize(w, init);
      std::copy(init.begin(), init.end(), host.buffers(w).param.begin());
    }
    eng = std::make_unique<engine>(c, weights, device, host, rule);
  }
  snapshot step(std::uint64_t s) {
    for (std::size_t w = 0; w < weights.size(); ++w) fill_gradient(device.gradient(w), w, s);
    eng->step();
    snapshot out;
    for (std::size_t w = 0; w < weights.size(); ++w) {
      const auto p = device.parameters(w);
      out.emplace_back(p.begin(), p.end());
    }
    return out;
  }
};

// The CPU device over buffers this test owns, as a trainer's: the host's
// master values are the parameters themselves without overlap_step, its own
// copy with it, or blocks streamed from `store`'s NVMe tier when a store is
// given; each step's gradient is a new buffer.
struct cpu_run {
  std::vector<weight_shape> weights = model();
  adam_rule rule;
  std::vector<std::vector<float>> params;
  std::vector<std::vector<float>> grads;
  std::unique_ptr<host_state> host;
  memory_host_state* memory = nullptr;  // host, when it is in memory
  std::unique_ptr<cpu_device> device;
  std::unique_ptr<engine> eng;
  explicit cpu_run(const config& c, block_store* store = nullptr) {
    std::vector<std::span<float>> views;
    for (std::size_t w = 0; w < weights.size(); ++w) params.push_back(initial(w, weights[w].elements()));
    for (auto& p : params) views.emplace_back(p);
    if (store != nullptr) {
      const std::vector<std::span<const float>> values(views.begin(), views.end());
      host = std::make_unique<streamed_host_state>(*store, weights, 2, values);
    } else if (c.overlap_step) {
      auto own = std::make_unique<memory_host_state>(weights, 2);
      for (std::size_t w = 0; w < weights.size(); ++w)
        std::copy(params[w].begin(), params[w].end(), own->buffers(w).param.begin());
      memory = own.get();
      host = std::move(own);
    } else {
      auto over_params = std::make_unique<memory_host_state>(weights, 2, views);
      memory = over_params.get();
      host = std::move(over_params);
    }
    device = std::make_unique<cpu_device>(weights, rule, views);
    eng = std::make_unique<engine>(c, weights, *device, *host, rule);
  }
  snapshot step(std::uint64_t s) {
    // New buffers every step: the device reads the ones it is given now.
    grads.assign(weights.size(), {});
    for (std::size_t w = 0; w < weights.size(); ++w) {
      grads[w].assign(weights[w].elements(), 0.0f);
      fill_gradient(grads[w], w, s);
      device->set_gradient(w, grads[w]);
    }
    eng->step();
    device->clear_gradients();
    return params;
  }
  std::vector<host_buffers> buffers(std::vector<std::vector<float>>& m, std::vector<std::vector<float>>& v,
                                    std::vector<std::vector<float>>& p) {
    std::vector<host_buffers> out;
    for (std::size_t w = 0; w < weights.size(); ++w) {
      m.emplace_back(weights[w].elements());
      v.emplace_back(weights[w].elements());
      p.emplace_back(weights[w].elements());
      out.push_back({p.back(), m.back(), v.back()});
    }
    return out;
  }
};

std::vector<config> configs() {
  std::vector<config> out = {step_config(0.25, 4, 8, false), step_config(0.25, 4, 8, true),
                             step_config(0.25, 1, 3, false), step_config(1.0, 2, 4, true, 2)};
  config automatic;  // update_interval "auto", refreshes every 100 steps
  automatic.topk_ratio = 0.3;
  out.push_back(automatic);
  return out;
}

TEST(ZenflowCpuDevice, MatchesTheStandInBitForBitOnTheTrainersBuffers) {
  for (const config& c : configs()) {
    standin_run a(c);
    cpu_run b(c);
    for (std::uint64_t s = 0; s < 40; ++s) {
      const snapshot x = a.step(s), y = b.step(s);
      for (std::size_t w = 0; w < x.size(); ++w)
        ASSERT_EQ(x[w], y[w]) << "step " << s << " weight " << w << " overlap " << c.overlap_step;
      for (std::size_t w = 0; w < x.size(); ++w) {
        const auto sa = a.device.owned_columns(w), sb = b.device->owned_columns(w);
        ASSERT_TRUE(std::ranges::equal(sa, sb)) << "step " << s << " weight " << w;
      }
    }
    a.eng->finish();
    b.eng->finish();
    for (std::size_t w = 0; w < a.weights.size(); ++w) {
      const auto p = a.device.parameters(w);
      ASSERT_TRUE(std::ranges::equal(p, b.params[w])) << "after finish, weight " << w;
    }
  }
}

TEST(ZenflowCpuDevice, ComputesWhereTheTrainersParametersLie) {
  cpu_run r(step_config(0.25, 4, 8, false));
  const float* before = r.params[0].data();
  const std::vector<float> old = r.params[0];
  r.step(0);
  EXPECT_EQ(r.device->parameters(0).data(), before);
  EXPECT_NE(r.params[0], old);
  EXPECT_THROW(r.device->set_gradient(0, std::span<const float>(r.params[1])), user_error);
}

// The exported state is one optimizer's at the device's count: bias-corrected
// moments agree with what either side holds under its own count.
TEST(ZenflowCheckpoint, ReadStateRebasesTheHostsColumnsToTheDevicesCount) {
  cpu_run r(step_config(0.25, 4, 8, true));
  for (std::uint64_t s = 0; s < 22; ++s) r.step(s);
  r.eng->finish();
  const engine_checkpoint c = r.eng->checkpoint();
  EXPECT_EQ(c.steps, 22u);
  EXPECT_LT(c.host_steps, 22);
  EXPECT_GT(c.host_steps, 0);
  std::vector<std::vector<float>> m, v, p;
  const auto out = r.buffers(m, v, p);
  r.eng->read_state(out);
  const weight_shape& shape = r.weights[0];
  const auto host = r.memory->buffers(0);
  std::size_t host_columns = 0;
  for (std::uint32_t col = 0; col < shape.cols; ++col) {
    for (std::uint64_t row = 0; row < shape.rows; ++row) {
      const std::size_t i = col * shape.rows + row;
      EXPECT_EQ(p[0][i], r.params[0][i]);  // after finish() the parameters are the newest masters
      if (r.eng->device_owns(0, col)) continue;
      const double ours = m[0][i] / (1 - std::pow(0.9, static_cast<double>(c.steps)));
      const double theirs = host.state0[i] / (1 - std::pow(0.9, static_cast<double>(c.host_steps)));
      EXPECT_NEAR(ours, theirs, 1e-6 * std::fabs(theirs) + 1e-12);
      ++host_columns;
    }
  }
  EXPECT_GT(host_columns, 0u);

  // Read into the parameters themselves (where the CPU device keeps the
  // device-owned columns' master values), as a program that has no other
  // copy does: the same state, and the parameters unchanged, though the
  // host's own copy of those columns is stale.
  const std::vector<std::vector<float>> params = r.params;
  std::vector<std::vector<float>> m2, v2, unused;
  std::vector<host_buffers> into = r.buffers(m2, v2, unused);
  for (std::size_t w = 0; w < into.size(); ++w) into[w].param = r.params[w];
  r.eng->read_state(into);
  EXPECT_EQ(r.params, params);
  EXPECT_EQ(m2, m);
  EXPECT_EQ(v2, v);
}

// Each of model()'s three matrices takes one page for its master and Adam's
// two states: a budget of two of them holds less than the state.
constexpr std::uint64_t two_weights = 2 * 4096;

TEST(ZenflowStreamedHost, StepsBitForBitAsTheStateInMemory) {
  for (const config& c : configs()) {
    testing::temp_dir dir;
    auto store = small_store(dir.path(), two_weights);
    cpu_run a(c);
    cpu_run b(c, store.get());
    const auto& streamed = static_cast<const streamed_host_state&>(*b.host);
    ASSERT_EQ(streamed.largest_weight_bytes(), 4096u);
    ASSERT_GT(streamed.home_bytes(), two_weights);  // it cannot all be in host memory
    for (std::uint64_t s = 0; s < 40; ++s) {
      const snapshot x = a.step(s), y = b.step(s);
      for (std::size_t w = 0; w < x.size(); ++w)
        ASSERT_EQ(x[w], y[w]) << "step " << s << " weight " << w << " overlap " << c.overlap_step;
    }
    a.eng->finish();
    b.eng->finish();
    EXPECT_EQ(a.params, b.params);
    std::vector<std::vector<float>> ma, va, pa, mb, vb, pb;
    a.eng->read_state(a.buffers(ma, va, pa));
    b.eng->read_state(b.buffers(mb, vb, pb));
    EXPECT_EQ(ma, mb);
    EXPECT_EQ(va, vb);
    EXPECT_EQ(pa, pb);
    const store_telemetry t = store->telemetry();
    for (const auto& tier : t.tiers) {
      if (tier.kind == tier_kind::host) {
        EXPECT_LE(tier.high_water, two_weights);
      }
    }
    EXPECT_GT(link_bytes(*store, "nvme->host"), 0u) << "the state never came from NVMe";
    EXPECT_GT(streamed.totals().bytes, 0u);
  }
}

// Weights of 1, 12 and 48 KiB of master and states, and a stage tier of the
// largest exactly: every pass holds one lease, so whatever the smaller
// weights left behind is evicted for the next (a lease per buffer could find
// the room split by the buffers it already holds, and wait for ever).
const std::vector<weight_shape> mixed = {{"small", 8, 16}, {"b", 7, 1}, {"big", 64, 64}, {"mid", 32, 32}, {"big2", 64, 64}};

std::vector<std::vector<float>> mixed_values() {
  std::vector<std::vector<float>> values;
  for (std::size_t w = 0; w < mixed.size(); ++w) values.push_back(initial(w, mixed[w].elements()));
  return values;
}

TEST(ZenflowStreamedHost, AStageTierOfTheLargestWeightServesWeightsOfEverySize) {
  testing::temp_dir dir;
  auto store = small_store(dir.path(), 48 << 10);
  const auto values = mixed_values();
  const std::vector<std::span<const float>> spans(values.begin(), values.end());
  streamed_host_state host(*store, mixed, 2, spans);
  EXPECT_EQ(host.largest_weight_bytes(), 48u << 10);
  const std::vector<std::size_t> matrices = {0, 2, 3, 4, 2, 0};
  for (int pass = 0; pass < 3; ++pass) {
    host.for_each(matrices, [&](std::size_t w, const host_buffers& b) {
      ASSERT_EQ(b.param.size(), mixed[w].elements());
      ASSERT_EQ(b.state1.size(), mixed[w].elements());
      EXPECT_TRUE(std::ranges::equal(b.param, values[w])) << mixed[w].name;
      EXPECT_EQ(b.state0[0], 0.0f) << mixed[w].name;
    });
  }
  EXPECT_GT(link_bytes(*store, "nvme->host"), 0u);
}

TEST(ZenflowStreamedHost, RefusesAHostBudgetBelowTheLargestWeight) {
  testing::temp_dir dir;
  auto store = small_store(dir.path(), 32 << 10);
  const auto values = mixed_values();
  const std::vector<std::span<const float>> spans(values.begin(), values.end());
  try {
    streamed_host_state host(*store, mixed, 2, spans);
    FAIL() << "a budget of 32 KiB took a weight of 48 KiB";
  } catch (const user_error& e) {
    EXPECT_NE(std::string(e.what()).find("\"big\" needs 48.00 KiB"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("give at least 48.00 KiB"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store->block_count(), 0u);  // refused before any block was made
  auto short_values = spans;
  short_values[2] = short_values[2].first(3);
  testing::temp_dir other;
  auto roomy = small_store(other.path(), 64 << 10);
  EXPECT_THROW(streamed_host_state(*roomy, mixed, 2, short_values), user_error);
  EXPECT_THROW(streamed_host_state(*roomy, mixed, 3, spans), user_error);
}

void expect_resumes(const config& c, std::uint64_t before, std::uint64_t after, bool exact,
                    block_store* store = nullptr) {
  cpu_run a(c);
  for (std::uint64_t s = 0; s < before; ++s) a.step(s);
  a.eng->finish();
  const engine_checkpoint saved = a.eng->checkpoint();
  std::vector<std::vector<float>> m, v, p;
  const auto state = a.buffers(m, v, p);
  a.eng->read_state(state);

  // A new run over the same parameters, resumed from the checkpoint (which
  // writes the host's master values too).
  cpu_run b(c, store);
  for (std::size_t w = 0; w < a.weights.size(); ++w) b.params[w] = a.params[w];
  b.rule.begun = saved.host_steps;
  const std::vector<std::int64_t> counts(b.weights.size(), static_cast<std::int64_t>(saved.steps));
  b.eng->restore(saved, state, counts);
  EXPECT_EQ(b.eng->steps(), saved.steps);
  for (std::size_t w = 0; w < b.weights.size(); ++w)
    ASSERT_TRUE(std::ranges::equal(a.eng->selected(w), b.eng->selected(w))) << "weight " << w;

  double worst = 0;
  for (std::uint64_t s = before; s < before + after; ++s) {
    const snapshot x = a.step(s), y = b.step(s);
    for (std::size_t w = 0; w < x.size(); ++w) {
      for (std::size_t i = 0; i < x[w].size(); ++i) {
        if (exact) {
          ASSERT_EQ(x[w][i], y[w][i]) << "step " << s << " weight " << w << " element " << i;
        }
        worst = std::max(worst, static_cast<double>(std::fabs(x[w][i] - y[w][i])));
      }
    }
  }
  // The host-owned columns' state made one round trip through the device's
  // count: one rounding, which Adam's normalised step keeps far below lr
  // (measured: 7.5e-9 at most over these runs, parameters of order 1).
  EXPECT_LT(worst, 1e-7) << "overlap " << c.overlap_step;
}

TEST(ZenflowCheckpoint, AResumedRunMatchesTheOneThatWentOn) {
  expect_resumes(step_config(0.25, 1, 3, false), 10, 20, /*exact=*/true);   // the counts agree: bit for bit
  expect_resumes(step_config(0.25, 4, 8, false), 14, 30, /*exact=*/false);
  expect_resumes(step_config(0.25, 4, 8, true), 14, 30, /*exact=*/false);
  expect_resumes(step_config(0.3, 2, 4, true, 3), 2, 12, /*exact=*/false);  // from inside the warm-up
  // Into a run whose host state is on NVMe.
  testing::temp_dir dir, dir2;
  auto store = small_store(dir.path(), two_weights);
  expect_resumes(step_config(0.25, 1, 3, false), 10, 20, /*exact=*/true, store.get());
  auto other = small_store(dir2.path(), two_weights);
  expect_resumes(step_config(0.25, 4, 8, true), 14, 30, /*exact=*/false, other.get());
}

TEST(ZenflowCheckpoint, AStateWithoutSelectionStartsOneFreshAtItsCount) {
  // A plain optimizer's state (torch.optim.AdamW's): every weight at step 6,
  // no selection yet. The first step makes one, and with update_interval 1
  // the run is the plain optimizer's from there.
  const config c = step_config(0.25, 1, 3, false);
  cpu_run r(c);
  engine_checkpoint plain;
  plain.steps = 6;
  plain.host_steps = 6;
  for (const auto& w : r.weights) plain.selected.push_back(w.matrix() ? std::vector<std::uint32_t>{} : std::vector<std::uint32_t>{0});
  plain.trigger = {std::vector<double>(3, 0.0), std::vector<double>(3, 0.0), std::vector<std::uint8_t>(3, 0)};
  std::vector<std::vector<float>> m, v, p;
  auto in = r.buffers(m, v, p);
  for (std::size_t w = 0; w < r.weights.size(); ++w) {
    p[w] = r.params[w];
    in[w].param = p[w];
    std::fill(m[w].begin(), m[w].end(), 0.01f);
    std::fill(v[w].begin(), v[w].end(), 0.02f);
  }
  r.rule.begun = 6;
  r.eng->restore(plain, in, std::vector<std::int64_t>(r.weights.size(), 6));
  r.step(6);
  EXPECT_EQ(r.eng->steps(), 7u);
  EXPECT_FALSE(r.eng->selected(0).empty());
  // Nothing was rebased: both counts are 7 after the step. Each moment took
  // one step from the plain state.
  r.eng->finish();
  std::vector<std::vector<float>> m2, v2, p2;
  r.eng->read_state(r.buffers(m2, v2, p2));
  std::vector<float> g(r.weights[0].elements());
  fill_gradient(g, 0, 6);
  for (std::size_t i = 0; i < g.size(); ++i) EXPECT_EQ(m2[0][i], beta1 * 0.01f + (1 - beta1) * g[i]) << i;
}

TEST(ZenflowCheckpoint, RefusesWhatDoesNotFit) {
  const config c = step_config(0.25, 4, 8, false);
  cpu_run r(c);
  r.step(0);
  EXPECT_THROW(r.eng->checkpoint(), user_error);  // a window is open: finish() first
  r.eng->finish();
  const engine_checkpoint saved = r.eng->checkpoint();
  std::vector<std::vector<float>> m, v, p;
  const auto state = r.buffers(m, v, p);
  r.eng->read_state(state);
  const std::vector<std::int64_t> counts(r.weights.size(), 1);
  EXPECT_THROW(r.eng->restore(saved, state, counts), user_error);  // it has stepped

  auto fresh_refuses = [&](engine_checkpoint bad) {
    cpu_run f(c);
    EXPECT_THROW(f.eng->restore(bad, state, counts), user_error);
  };
  engine_checkpoint unordered = saved;
  std::reverse(unordered.selected[0].begin(), unordered.selected[0].end());
  fresh_refuses(unordered);
  engine_checkpoint out_of_range = saved;
  out_of_range.selected[0].back() = 99;
  fresh_refuses(out_of_range);
  engine_checkpoint too_many_hosts = saved;
  too_many_hosts.host_steps = 5;
  fresh_refuses(too_many_hosts);
  engine_checkpoint wrong_size = saved;
  wrong_size.selected.pop_back();
  fresh_refuses(wrong_size);
}

// The device-owned columns of a quiet engine, packed, as read_device_state
// gives them (the buffers sized first, so the views stay put).
struct device_columns {
  std::vector<std::vector<std::uint32_t>> columns;
  std::vector<std::vector<float>> param, state0, state1;
  std::vector<packed_columns> views;
  device_columns(const std::vector<weight_shape>& weights, const std::vector<std::vector<std::uint32_t>>& selected)
      : columns(selected) {
    for (std::size_t w = 0; w < weights.size(); ++w) {
      const std::size_t n = columns[w].size() * weights[w].rows;
      param.emplace_back(n);
      state0.emplace_back(n);
      state1.emplace_back(n);
    }
    for (std::size_t w = 0; w < weights.size(); ++w) views.push_back({columns[w], param[w], state0[w], state1[w]});
  }
};

// A checkpoint that leaves the host's state where it lies: the store's own
// checkpoint of the streamed blocks, and the device's columns packed.
// Nothing is rebased, so the resumed run is the one that went on, bit for
// bit, for every schedule (read_state()'s round trip is not, when the two
// counts differ).
void expect_resumes_in_place(const config& c, std::uint64_t before, std::uint64_t after) {
  testing::temp_dir dir, dir2, saved_dir;
  auto store = small_store(dir.path(), two_weights);
  cpu_run a(c, store.get());
  for (std::uint64_t s = 0; s < before; ++s) a.step(s);
  a.eng->finish();
  const engine_checkpoint saved = a.eng->checkpoint();
  device_columns device(a.weights, saved.selected);
  a.eng->read_device_state(device.views);
  tiers::write_checkpoint(*store, saved_dir.path() + "/state");

  auto store2 = small_store(dir2.path(), two_weights);
  cpu_run b(c, store2.get());
  for (std::size_t w = 0; w < a.weights.size(); ++w) b.params[w] = a.params[w];  // the model's values, loaded
  b.rule.begun = saved.host_steps;
  b.eng->restore_device_state(saved, device.views);
  tiers::restore_checkpoint(*store2, saved_dir.path() + "/state");
  EXPECT_EQ(b.eng->steps(), saved.steps);
  EXPECT_EQ(b.eng->host_steps(), saved.host_steps);
  for (std::uint64_t s = before; s < before + after; ++s) {
    const snapshot x = a.step(s), y = b.step(s);
    for (std::size_t w = 0; w < x.size(); ++w)
      ASSERT_EQ(x[w], y[w]) << "step " << s << " weight " << w << " overlap " << c.overlap_step;
  }
}

TEST(ZenflowCheckpoint, AStreamedHostStateResumesInPlaceBitForBit) {
  expect_resumes_in_place(step_config(0.25, 4, 8, false), 14, 30);
  expect_resumes_in_place(step_config(0.25, 4, 8, true), 14, 30);   // a window's CPU step was in flight
  expect_resumes_in_place(step_config(0.3, 2, 4, true, 3), 2, 12);  // from inside the warm-up
  config automatic;
  automatic.topk_ratio = 0.3;
  expect_resumes_in_place(automatic, 17, 25);
}

TEST(ZenflowCheckpoint, TheDeviceStateMustBeOfTheSelection) {
  const config c = step_config(0.25, 4, 8, false);
  testing::temp_dir dir;
  auto store = small_store(dir.path(), two_weights);
  cpu_run a(c, store.get());
  for (std::uint64_t s = 0; s < 12; ++s) a.step(s);
  engine_checkpoint saved;
  EXPECT_THROW(a.eng->read_device_state({}), user_error);  // a window is open: finish() first
  a.eng->finish();
  saved = a.eng->checkpoint();
  ASSERT_FALSE(saved.selected[0].empty());
  device_columns device(a.weights, saved.selected);
  device_columns short_one(a.weights, saved.selected);
  short_one.param[0].pop_back();
  short_one.views[0].param = short_one.param[0];
  EXPECT_THROW(a.eng->read_device_state(short_one.views), user_error);
  a.eng->read_device_state(device.views);
  EXPECT_THROW(a.eng->restore_device_state(saved, device.views), user_error);  // it has stepped

  cpu_run b(c);
  EXPECT_THROW(b.eng->restore_device_state(saved, short_one.views), user_error);
  engine_checkpoint other = saved;  // a selection the buffers are not of
  other.selected[0].pop_back();
  EXPECT_THROW(b.eng->restore_device_state(other, device.views), user_error);
  EXPECT_EQ(b.eng->steps(), 0u);  // refused: unchanged
  EXPECT_TRUE(b.eng->selected(0).empty());
  b.rule.begun = saved.host_steps;
  b.eng->restore_device_state(saved, device.views);
  EXPECT_EQ(b.eng->steps(), saved.steps);
}

}  // namespace
}  // namespace tierflow::zenflow
