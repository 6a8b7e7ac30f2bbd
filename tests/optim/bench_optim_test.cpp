// `tierflow bench optim` as a user runs it: the JSON it promises, and the exit
// codes for bad values (1, one line) and bad command lines (2).
#include <algorithm>
#include <string>
#include <vector>

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

// The bytes each parameter moves, in closed form for every dtype combination,
// and the bound's figures derived from what the JSON itself reports: the
// plain loop moves exactly the step's streams, memcpy the same bytes (read
// plus write), and the ratio is taken against the higher of the two.
TEST(bench_optim, bytes_per_param_and_bounds_in_closed_form) {
  struct combo {
    const char *param, *grad, *state;
    bool check_finite;
    double bytes;  // p read + write (8), g (read twice with the check), m and v read + write, copy
  };
  const std::size_t n = 256 << 10;
  for (const combo& c : {combo{"fp32", "fp32", "fp32", false, 8 + 4 + 16},
                         combo{"bf16", "bf16", "fp32", false, 8 + 2 + 16 + 2},
                         combo{"bf16", "bf16", "bf16", false, 8 + 2 + 8 + 2},
                         combo{"fp16", "fp16", "fp32", true, 8 + 2 * 2 + 16 + 2},
                         combo{"bf16", "fp32", "bf16", false, 8 + 4 + 8 + 2},
                         combo{"fp32", "fp32", "bf16", true, 8 + 2 * 4 + 8}}) {
    std::vector<std::string> args = {"bench", "optim", "--params", "256K", "--steps", "1", "--param-dtype", c.param,
                                     "--grad-dtype", c.grad, "--state-dtype", c.state, "--json"};
    if (c.check_finite) args.push_back("--check-finite");
    const auto r = run_cli(args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    const std::string what = std::string(c.param) + "/" + c.grad + "/" + c.state + (c.check_finite ? "+check" : "");
    EXPECT_EQ(j["bytes_per_param"].get<double>(), c.bytes) << what;
    EXPECT_EQ(j["bound_stream_bytes_per_param"].get<double>(), c.bytes) << what;
    const auto copy_length = (static_cast<std::size_t>(c.bytes) * n / 2 + 63) / 64 * 64;
    EXPECT_EQ(j["bound_memcpy_bytes"].get<std::size_t>(), 2 * copy_length) << what;

    const double step = j["seconds_per_step"], stream_s = j["bound_stream_seconds_per_pass"],
                 memcpy_s = j["bound_memcpy_seconds_per_pass"];
    const double stream_rate = j["bound_stream_bytes_per_second"], memcpy_rate = j["bound_memcpy_bytes_per_second"];
    EXPECT_DOUBLE_EQ(j["bytes_per_second"].get<double>(), c.bytes * static_cast<double>(n) / step) << what;
    EXPECT_DOUBLE_EQ(stream_rate, c.bytes * static_cast<double>(n) / stream_s) << what;
    EXPECT_DOUBLE_EQ(memcpy_rate, static_cast<double>(2 * copy_length) / memcpy_s) << what;
    EXPECT_DOUBLE_EQ(j["bound_bytes_per_second"].get<double>(), std::max(stream_rate, memcpy_rate)) << what;
    EXPECT_EQ(j["bound"], stream_rate >= memcpy_rate ? "stream" : "memcpy") << what;
    EXPECT_DOUBLE_EQ(j["ratio_to_bound"].get<double>(),
                     j["bytes_per_second"].get<double>() / std::max(stream_rate, memcpy_rate))
        << what;
  }
}

TEST(bench_optim, human_output_names_both_bounds) {
  const auto r = run_cli({"bench", "optim", "--params", "64K", "--steps", "1", "--threads", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("bound: plain loop"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bound: memcpy"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the higher"), std::string::npos) << r.out;
}

// A list of tensors is stepped one after another: their total is the
// step's parameter count, and the bound covers the same bytes.
TEST(bench_optim, tensors_are_stepped_in_turn) {
  const auto r = run_cli({"bench", "optim", "--tensors", "65536,1000,300000", "--steps", "2", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["params"], 65536 + 1000 + 300000);
  EXPECT_EQ(j["tensors"], 3);
  EXPECT_EQ(j["bytes_per_param"], 28.0);
  EXPECT_GT(j["ratio_to_bound"].get<double>(), 0.0);
}

TEST(bench_optim, bad_values_exit_1_with_one_line) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"bench", "optim", "--state-dtype", "fp8"},
        {"bench", "optim", "--threads", "0"},
        {"bench", "optim", "--params", "lots"},
        {"bench", "optim", "--tensors", "100,,3"},
        {"bench", "optim", "--tensors", "100,0"},
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
