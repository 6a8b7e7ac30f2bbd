// `tierflow bench offload` run as a user would: its refusals before any work,
// and short real runs with the state on NVMe files.
#include <sys/mount.h>

#include <cerrno>
#include <cstring>
#include <string>

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
      {{"--update-interval", "8", "--select-interval", "4"}, "--select-interval: 4 is less than update_interval 8"},
      {{"--host-memory", "1M"}, "it needs at least"},
      {{"--host-memory", "lots"}, "--host-memory: 'lots'"},
      {{"--device", "gpu"}, "--device: 'gpu' is not sim, cuda or cuda:N"},
      // No such device here: no driver, no CUDA build, or fewer than 100 devices.
      {{"--device", "cuda:99", "--strategy", "sync"}, "--device cuda"},
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
  const auto r = run_cli({"bench", "offload", "--model", "gpt2-small", "--host-memory", "1G", "--strategy", "sync"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--nvme-dir"), std::string::npos) << r.err;
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
  const auto r = run_cli({"bench", "offload", "--model", "gpt2-small", "--strategy", "sync", "--nvme-dir",
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
  for (const char* strategy : {"sync", "zenflow"}) {
    auto args = small_run(dir.path(), strategy);
    args.insert(args.begin() + 2, {"--device", "cuda"});
    const auto r = run_cli(args);
    ASSERT_EQ(r.exit_code, 0) << strategy << ": " << r.err;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["device"], "cuda:0");
    EXPECT_NE(j["device_model"].get<std::string>().find("measured"), std::string::npos) << j["device_model"];
    EXPECT_GT(j["compute_seconds_per_step"].get<double>(), 0) << strategy;
    EXPECT_GE(j["stall_fraction"].get<double>(), 0) << strategy;
    EXPECT_LE(j["stall_fraction"].get<double>(), 1) << strategy;
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
  EXPECT_GE(j["stall_fraction"].get<double>(), 0);
  EXPECT_LE(j["stall_fraction"].get<double>(), 1);
  ASSERT_EQ(j["steps"].size(), 6u);
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
  auto args = small_run(dir.path(), "sync,pipelined,zenflow");
  args.push_back("--trace");
  args.push_back(dir.path() + "/trace");
  const auto r = run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j["runs"].size(), 3u);
  EXPECT_TRUE(j["step_ratio_vs_sync"].contains("zenflow"));
  EXPECT_GT(j["runs"][1]["optimizer_step_seconds"].get<double>(), 0);
  EXPECT_GT(j["runs"][1]["io_alone_seconds"].get<double>(), 0);
  for (const char* s : {"sync", "pipelined", "zenflow"}) {
    const json trace = json::parse(testing::slurp(dir.path() + "/trace." + s + ".json"));
    EXPECT_GT(trace["traceEvents"].size(), 10u) << s;
  }
}

}  // namespace
}  // namespace tierflow
