#include "offload/model.hpp"

#include <gtest/gtest.h>

#include "offload/sim_device.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::bench {
namespace {

// The published parameter counts of the models the presets stand for.
TEST(OffloadModel, PresetsHaveTheRealParameterCounts) {
  EXPECT_EQ(make_model("gpt2-small").parameters(), 124'439'808u);
  EXPECT_EQ(make_model("gpt2-medium").parameters(), 354'823'168u);
  EXPECT_EQ(make_model("gpt2-large").parameters(), 774'030'080u);
  EXPECT_EQ(make_model("gpt2-xl").parameters(), 1'557'611'200u);
  EXPECT_EQ(make_model("llama-1b").parameters(), 1'235'814'400u);
  EXPECT_EQ(make_model("llama-7b").parameters(), 6'738'415'616u);
  EXPECT_EQ(make_model("llama-13b").parameters(), 13'015'864'320u);
}

TEST(OffloadModel, CustomSpecIsGpt2Style) {
  EXPECT_EQ(make_model("24x1024x50257").parameters(), make_model("gpt2-medium").parameters());
  const model_shape m = make_model("2x64x1000");
  EXPECT_EQ(m.layers.size(), 2u);
  EXPECT_EQ(m.hidden, 64u);
  for (const auto& w : m.layers[0]) {
    if (w.matrix()) {
      EXPECT_GT(w.rows, 1u);
    }
  }
}

TEST(OffloadModel, StepFlopsAreSixPerParameterPerToken) {
  const model_shape m = make_model("llama-7b");
  EXPECT_DOUBLE_EQ(m.step_flops(1000), 6.0 * static_cast<double>(m.compute_parameters()) * 1000);
}

// The matmuls a GPU runs per step carry all the step's FLOPs but the 1-D
// weights' (norms and biases, under 0.1%).
TEST(OffloadModel, MatmulsCarryTheStepFlops) {
  for (const char* name : {"gpt2-small", "llama-7b"}) {
    const model_shape m = make_model(name);
    double flops = 0;
    for (const auto& w : m.matmuls()) {
      EXPECT_TRUE(w.matrix()) << w.name;
      flops += 6.0 * static_cast<double>(w.elements()) * 1000;
    }
    EXPECT_LT(flops, m.step_flops(1000)) << name;
    EXPECT_GT(flops, 0.999 * m.step_flops(1000)) << name;
  }
  // gpt2 ties its head to the token embedding: that matmul is there too.
  const auto mm = make_model("gpt2-small").matmuls();
  EXPECT_EQ(mm.back().name, "wte");
}

TEST(OffloadModel, UnknownSpecNamesThePresets) {
  for (const char* bad : {"gpt5", "24x1024", "0x1x1", "axbxc", "24x1024x50257x1"}) {
    try {
      make_model(bad);
      ADD_FAILURE() << bad;
    } catch (const user_error& e) {
      EXPECT_NE(std::string(e.what()).find("gpt2-medium"), std::string::npos) << e.what();
    }
  }
}

TEST(SimDevice, TimesFollowTheStatedModel) {
  sim_device d;
  d.tflops = 100;
  d.pcie_bytes_per_second = 10e9;
  d.pcie_latency_seconds = 1e-5;
  EXPECT_DOUBLE_EQ(d.compute_seconds(1e14), 1.0);
  EXPECT_DOUBLE_EQ(d.transfer_seconds(10'000'000'000ull), 1.0 + 1e-5);
  EXPECT_NE(d.describe().find("100 TFLOP/s"), std::string::npos);
}

}  // namespace
}  // namespace tierflow::bench
