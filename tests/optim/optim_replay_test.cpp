// tierflow_optim_replay, which bench/optim_vs_torch.py drives: one known step
// computed from files, and its refusals of bad inputs.
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "run_cli.hpp"

namespace tierflow {
namespace {

using testing::run_cli;
using testing::temp_dir;

void write_floats(const std::string& path, const std::vector<float>& v) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v.data()),
                                              static_cast<std::streamsize>(v.size() * sizeof(float)));
}

std::vector<float> read_floats(const std::string& path) {
  const std::string bytes = testing::slurp(path);
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

const char* adamw_case = R"({"optimizer": "adamw", "elements": 3, "steps": 1, "lr": 0.1, "beta1": 0.9,
  "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.5})";

// The first AdamW step moves each parameter by lr against its gradient's sign
// (m̂ = g, v̂ = g²), after decaying it by lr · weight_decay.
TEST(optim_replay, first_adamw_step_from_files) {
  temp_dir dir;
  std::ofstream(dir.path() + "/case.json") << adamw_case;
  write_floats(dir.path() + "/param.bin", {1.0f, -2.0f, 0.5f});
  write_floats(dir.path() + "/grad.bin", {3.0f, -0.25f, 1e-3f});
  const auto r = run_cli({dir.path()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto p = read_floats(dir.path() + "/param_out.bin");
  ASSERT_EQ(p.size(), 3u);
  const float decay = 1.0f - 0.1f * 0.5f;
  EXPECT_NEAR(p[0], 1.0f * decay - 0.1f, 1e-6f);
  EXPECT_NEAR(p[1], -2.0f * decay + 0.1f, 1e-6f);
  EXPECT_NEAR(p[2], 0.5f * decay - 0.1f, 1e-5f);
  const auto m = read_floats(dir.path() + "/exp_avg_out.bin");
  ASSERT_EQ(m.size(), 3u);
  EXPECT_NEAR(m[0], 0.3f, 1e-6f);
}

TEST(optim_replay, refuses_files_that_do_not_match_the_case) {
  temp_dir dir;
  std::ofstream(dir.path() + "/case.json") << adamw_case;
  write_floats(dir.path() + "/param.bin", {1.0f, 2.0f, 3.0f});
  write_floats(dir.path() + "/grad.bin", {1.0f, 2.0f});  // one value short
  auto r = run_cli({dir.path()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("grad.bin: shorter than the 12 bytes"), std::string::npos) << r.err;
  std::ofstream(dir.path() + "/case.json") << R"({"optimizer": "sgd", "elements": 3, "steps": 1})";
  r = run_cli({dir.path()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("optimizer: 'sgd'"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace tierflow
