// `tierflow bench optim` as a user runs it: the JSON it promises, and the exit
// codes for bad values (1, one line) and bad command lines (2).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "run_cli.hpp"

namespace tierflow {
namespace {

using testing::run_cli;

TEST(bench_optim, adamw_json_has_the_documented_keys) {
  const auto r = run_cli({"bench", "optim", "--params", "1M", "--threads", "2", "--steps", "2", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* key : {"optimizer", "params", "threads", "seconds_per_step", "params_per_second",
                          "bytes_per_second", "bound_bytes_per_second", "ratio_to_bound", "simd"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["optimizer"], "adamw");
  EXPECT_EQ(j["params"], 1 << 20);
  EXPECT_EQ(j["threads"], 2);
  EXPECT_EQ(j["bytes_per_param"], 28.0);
  EXPECT_GT(j["params_per_second"].get<double>(), 0.0);
}

TEST(bench_optim, bf16_modes_and_muon) {
  auto r = run_cli({"bench", "optim", "--optimizer", "adam", "--params", "256K", "--param-dtype", "bf16",
                    "--state-dtype", "bf16", "--steps", "1", "--no-bound", "--check-finite", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["state_dtype"], "bf16");
  EXPECT_EQ(j["bytes_per_param"], 4.0 + 4 + 2 + 8 + 2 + 2);  // p rw, g, m/v rw, copy, finite check
  EXPECT_FALSE(j.contains("bound_bytes_per_second"));

  r = run_cli({"bench", "optim", "--optimizer", "muon", "--shape", "96x64", "--matrices", "2", "--steps", "1",
               "--gemm-dtype", "fp32", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["params"], 2 * 96 * 64);
  EXPECT_GT(j["ns_seconds"].get<double>(), 0.0);
  EXPECT_GT(j["gemm_seconds"].get<double>(), 0.0);

  r = run_cli({"bench", "optim", "--params", "64K", "--steps", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("ratio to bound"), std::string::npos) << r.out;
}

TEST(bench_optim, bad_values_exit_1_with_one_line) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"bench", "optim", "--state-dtype", "fp8"},
        {"bench", "optim", "--threads", "0"},
        {"bench", "optim", "--params", "lots"},
        {"bench", "optim", "--simd", "avx9000"},
        {"bench", "optim", "--optimizer", "muon", "--shape", "12by4"}}) {
    const auto r = run_cli(args);
    EXPECT_EQ(r.exit_code, 1) << args.back() << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  const auto r = run_cli({"bench", "optim", "--optimizer", "sgd"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
}

}  // namespace
}  // namespace tierflow
