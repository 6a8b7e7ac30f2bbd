// `tierflow bench offload` run as a user would: its refusals before any work,
// and short real runs with the state on NVMe files.
#include <sys/mount.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "run_cli.hpp"
#include "tierflow/tiers/cuda_probe.hpp"

namespace tierflow {
namespace {

using nlohmann::json;
using testing::run_cli;
using testing::temp_dir;

std::vector<std::string> small_run(const std::string& dir, const std::string& strategy) {
  return {"bench", "offload", "--model", "2x128x1000", "--nvme-dir", dir, "--host-memory", "16M",
          "--steps", "6", "--update-interval", "2", "--batch-tokens", "100000", "--strategy", strategy,
          "--sub-group", "64K", "--json"};
}

// ZeRO-Offload's device waits for every whole CPU step and the upload after
// it: each step's stall is at least the host's optimizer step, the last
// step's too (its wait is the step after it's).
void expect_device_waits_for_each_cpu_step(const json& run) {
  for (const auto& s : run["steps"])
    EXPECT_GE(s["stall_seconds"].get<double>(), s["host_seconds"].get<double>()) << s.dump();
}

TEST(BenchOffload, RefusesBadInputBeforeAnyWorkWithOneLine) {
  temp_dir dir;
  struct refusal {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<refusal> cases = {
      {{"--model=gpt5"}, "--model: 'gpt5' is not a preset"},
      {{"--strategy", "eager"}, "--strategy: 'eager'"},
      {{"--strategy", "sync,bogus"}, "--strategy: 'bogus'"},
      {{"--topk-ratio", "0"}, "--topk-ratio"},
      {{"--topk-ratio", "1.5"}, "--topk-ratio"},
      {{"--update-interval", "8", "--select-interval", "4", "--steps", "16"},
       "--select-interval: 4 is less than update_interval 8"},
      {{"--select-interval", "0"}, "--select-interval: must be at least 1"},
      {{"--update-interval", "0"}, "--update-interval: '0' is not a whole number"},
      {{"--update-interval", "often"}, "--update-interval: 'often'"},
      {{"--update-interval", "4", "--steps", "6"}, "--steps: 6 steps hold fewer than two update windows of 4"},
      {{"--hbm-gbps", "0"}, "--hbm-gbps: must be a positive number"},
      {{"--host-memory", "1M"}, "it needs at least"},
      {{"--host-memory", "lots"}, "--host-memory: 'lots'"},
      {{"--device", "gpu"}, "--device: 'gpu' is not sim, cuda or cuda:N"},
      // No such device here: no driver, no CUDA build, or fewer than 100 devices.
      {{"--device", "cuda:99", "--strategy", "zero-offload"}, "--device cuda"},
      {{"--device", "cuda", "--optimizer", "muon"}, "ZenFlow with Muon runs on the simulated device only"},
      {{"--device", "cuda", "--pcie-gbps", "10"}, "--pcie-gbps: describes the simulated device"},
      {{"--device-memory", "1M"}, "--device-memory: the device's 1.00 MiB cannot hold"},
      {{"--optimizer", "sgd"}, "--optimizer: 'sgd'"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {"bench", "offload", "--nvme-dir", dir.path()};
    args.insert(args.end(), c.args.begin(), c.args.end());
    if (c.args[0].rfind("--model", 0) != 0) args.push_back("--model=2x128x1000");
    const auto r = run_cli(args);
    EXPECT_EQ(r.exit_code, 1) << c.says << ": " << r.err;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(r.out.empty()) << "work started before the refusal: " << r.out;
  }
  // The state does not fit in host memory and no NVMe directory is given.
  const auto r = run_cli({"bench", "offload", "--model", "gpt2-small", "--host-memory", "1200M"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--nvme-dir"), std::string::npos) << r.err;
  // ZeRO-Infinity swaps its state from NVMe: without a directory it has none.
  const auto no_nvme = run_cli({"bench", "offload", "--model", "2x128x1000", "--strategy", "zero-infinity"});
  EXPECT_EQ(no_nvme.exit_code, 1);
  EXPECT_NE(no_nvme.err.find("--strategy zero-infinity: swaps the optimizer state from NVMe; give --nvme-dir"),
            std::string::npos)
      << no_nvme.err;
  // More than the machine has, with the default --host-memory.
  const auto too_big = run_cli({"bench", "offload", "--model", "llama-13b"});
  EXPECT_EQ(too_big.exit_code, 1);
  EXPECT_NE(too_big.err.find("--host-memory: this run needs"), std::string::npos) << too_big.err;
  // The NVMe directory does not exist.
  const auto missing = run_cli({"bench", "offload", "--model", "2x128x1000", "--nvme-dir", dir.path() + "/none"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("--nvme-dir: cannot use"), std::string::npos) << missing.err;
  // A flag without its value does not parse.
  EXPECT_EQ(run_cli({"bench", "offload", "--steps"}).exit_code, 2);
}

// The state does not fit on the NVMe directory's file system: refused with
// what it has and needs, before a file is made.
TEST(BenchOffload, RefusesAnNvmeDirectoryTooSmallForTheState) {
  temp_dir dir;
  if (::mount("tierflow-test", dir.path().c_str(), "tmpfs", 0, "size=64m") != 0)
    GTEST_SKIP() << "cannot mount a small tmpfs here: " << std::strerror(errno);
  const auto r = run_cli({"bench", "offload", "--model", "gpt2-small", "--strategy", "zero-infinity", "--nvme-dir",
                          dir.path()});
  const bool left_nothing = std::system(("test -z \"$(ls -A '" + dir.path() + "')\"").c_str()) == 0;
  ::umount(dir.path().c_str());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--nvme-dir: '" + dir.path() + "' has 64.00 MiB free; the optimizer state needs 1.4"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(left_nothing);
}

// On a CUDA GPU (skipped elsewhere): the model's matmuls and the copies run
// for real, and the report says what the device measured.
TEST(BenchOffload, CudaDeviceRunsTheStepsOnTheGpu) {
  if (!tiers::probe_cuda().available) GTEST_SKIP() << "no CUDA device here";
  temp_dir dir;
  for (const char* strategy : {"zero-offload", "zenflow"}) {
    auto args = small_run(dir.path(), strategy);
    args.insert(args.begin() + 2, {"--device", "cuda"});
    const auto r = run_cli(args);
    ASSERT_EQ(r.exit_code, 0) << strategy << ": " << r.err;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["device"], "cuda:0");
    EXPECT_NE(j["device_model"].get<std::string>().find("measured"), std::string::npos) << j["device_model"];
    EXPECT_GT(j["compute_seconds_per_step"].get<double>(), 0) << strategy;
    if (j["strategy"] == "zero-offload") expect_device_waits_for_each_cpu_step(j);
    EXPECT_GT(j["bytes"]["pcie_d2h"].get<std::uint64_t>(), 0u) << strategy;
    EXPECT_GT(j["bytes"]["pcie_h2d"].get<std::uint64_t>(), 0u) << strategy;
    ASSERT_EQ(j["steps"].size(), 6u);
    double total = 0;
    for (const auto& s : j["steps"]) total += s["seconds"].get<double>();
    EXPECT_GT(total, 0) << strategy;
  }
}

TEST(BenchOffload, ZenflowRunReportsTheDocumentedJson) {
  temp_dir dir;
  const auto r = run_cli(small_run(dir.path(), "zenflow"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["strategy"], "zenflow");
  EXPECT_EQ(j["device"], "sim");
  EXPECT_GT(j["step_seconds"].get<double>(), 0);
  ASSERT_EQ(j["steps"].size(), 6u);
  // Whole windows after the first: steps 2-5, and the trainer's waits for
  // the CPU steps reported per step.
  EXPECT_EQ(j["warm_up_steps"], 2);
  EXPECT_EQ(j["counted_steps"], 4);
  EXPECT_EQ(j["windows"], 2);
  double cpu_wait = 0;
  for (std::size_t s = 2; s < 6; ++s) cpu_wait += j["steps"][s]["cpu_wait_seconds"].get<double>();
  EXPECT_DOUBLE_EQ(j["cpu_wait_per_step_seconds"].get<double>(), cpu_wait / 4);
  EXPECT_GE(j["refreshes"].get<int>(), 2);  // the first selection and one refresh (every two windows)
  EXPECT_TRUE(j["state_on_nvme"].get<bool>());
  // The state really moved through the NVMe files, and the gradient down the link.
  EXPECT_GT(j["bytes"]["host->nvme"].get<std::uint64_t>(), j["state_bytes"].get<std::uint64_t>());
  EXPECT_GT(j["bytes"]["nvme->host"].get<std::uint64_t>(), 0u);
  EXPECT_GT(j["bytes"]["pcie_d2h"].get<std::uint64_t>(), 0u);
  int boundaries = 0;
  for (const auto& s : j["steps"]) boundaries += s["boundary"].get<bool>();
  EXPECT_EQ(boundaries, 3);  // update interval 2 over 6 steps
  EXPECT_TRUE(j.contains("hideability"));
  // Nothing is left in the NVMe directory.
  EXPECT_EQ(std::system(("test -z \"$(ls -A '" + dir.path() + "')\"").c_str()), 0);
}

TEST(BenchOffload, SeveralStrategiesSideBySideWithATrace) {
  temp_dir dir;
  auto args = small_run(dir.path(), "zero-offload,zero-infinity,zenflow");
  args.push_back("--trace");
  args.push_back(dir.path() + "/trace");
  const auto r = run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j["runs"].size(), 3u);
  EXPECT_TRUE(j["step_ratio_vs_zero_offload"].contains("zenflow"));
  EXPECT_TRUE(j["step_ratio_vs_zero_offload"].contains("zero-infinity"));
  // What each models: ZeRO-Offload's state in host memory, ZeRO-Infinity's on NVMe.
  EXPECT_EQ(j["runs"][0]["strategy"], "zero-offload");
  EXPECT_FALSE(j["runs"][0]["state_on_nvme"].get<bool>());
  EXPECT_EQ(j["runs"][1]["strategy"], "zero-infinity");
  EXPECT_TRUE(j["runs"][1]["state_on_nvme"].get<bool>());
  for (int k = 0; k < 2; ++k) expect_device_waits_for_each_cpu_step(j["runs"][k]);
  EXPECT_GT(j["runs"][1]["optimizer_step_seconds"].get<double>(), 0);
  EXPECT_GT(j["runs"][1]["io_alone_seconds"].get<double>(), 0);
  for (const char* s : {"zero-offload", "zero-infinity", "zenflow"}) {
    const json trace = json::parse(testing::slurp(dir.path() + "/trace." + s + ".json"));
    EXPECT_GT(trace["traceEvents"].size(), 10u) << s;
  }
}

// --repeat 3: each run in the JSON with its repeat and its slowest counted
// step, the strategies' order alternating, one trace per run, and every
// figure over the runs the median of the runs' own with their range.
TEST(BenchOffload, RepeatedRunsShowEachRunAndTheSpreadOverThem) {
  temp_dir dir;
  auto args = small_run(dir.path(), "zero-offload,zenflow");
  for (const char* a : {"--repeat", "3", "--trace"}) args.push_back(a);
  args.push_back(dir.path() + "/trace");
  const auto r = run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["repeats"], 3);
  ASSERT_EQ(j["runs"].size(), 6u);
  const char* order[] = {"zero-offload", "zenflow", "zenflow", "zero-offload", "zero-offload", "zenflow"};
  std::vector<double> ratios, maxima;
  for (std::size_t k = 0; k < 6; ++k) {
    const json& run = j["runs"][k];
    EXPECT_EQ(run["strategy"], order[k]) << k;
    EXPECT_EQ(run["repeat"], k / 2 + 1);
    const json& slow = run["slowest_step"];
    EXPECT_DOUBLE_EQ(slow["seconds"].get<double>(), run["max_step_seconds"].get<double>()) << k;
    EXPECT_GE(slow["step"].get<int>(), run["warm_up_steps"].get<int>());
    EXPECT_FALSE(slow["waited_for"].get<std::string>().empty());
    const std::string strategy = order[k];
    EXPECT_GT(testing::slurp(dir.path() + "/trace." + strategy + ".run" + std::to_string(k / 2 + 1) + ".json").size(),
              100u);
    if (strategy == "zenflow") {
      const json& peer = j["runs"][k % 2 ? k - 1 : k + 1];
      ratios.push_back(run["step_seconds"].get<double>() / peer["step_seconds"].get<double>());
      maxima.push_back(run["max_step_seconds"].get<double>());
    }
  }
  std::sort(ratios.begin(), ratios.end());
  std::sort(maxima.begin(), maxima.end());
  const json& over = j["over_runs"]["zenflow"];
  EXPECT_EQ(over["runs"], 3);
  EXPECT_DOUBLE_EQ(over["step_ratio_vs_zero_offload"]["median"].get<double>(), ratios[1]);
  EXPECT_DOUBLE_EQ(over["step_ratio_vs_zero_offload"]["min"].get<double>(), ratios[0]);
  EXPECT_DOUBLE_EQ(j["step_ratio_vs_zero_offload"]["zenflow"].get<double>(), ratios[1]);
  EXPECT_DOUBLE_EQ(over["max_step_seconds"]["max"].get<double>(), maxima[2]);
  EXPECT_FALSE(j["over_runs"]["zero-offload"].contains("step_ratio_vs_zero_offload"));

  const auto zero = run_cli({"bench", "offload", "--repeat", "0"});
  EXPECT_EQ(zero.exit_code, 2);
  EXPECT_NE(zero.err.find("--repeat"), std::string::npos) << zero.err;
}

}  // namespace
}  // namespace tierflow

namespace tierflow {
namespace {

// A newcomer's first command: nothing but the verb. The defaults fit this
// machine and make a short run (a Release build's; sanitizers slow it past use).
TEST(BenchOffload, RunsWithNoFlags) {
#ifndef NDEBUG
  GTEST_SKIP() << "the default run is sized for a Release build";
#endif
  const auto r = testing::run_cli({"bench", "offload"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("zenflow — gpt2-small"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("mean step"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace tierflow
