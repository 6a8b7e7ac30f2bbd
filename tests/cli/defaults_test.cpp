// Each verb run with nothing but its required flags, as a newcomer's first
// commands are: it succeeds, prints its table, and runs the documented
// defaults (sized so that each finishes in seconds on a laptop's NVMe).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "run_cli.hpp"

namespace tierflow {
namespace {

using testing::run_cli;
using testing::temp_dir;

// Scratch space on a disk where there is one (/tmp may be a small tmpfs).
std::string scratch_parent() { return ::access("/var/tmp", W_OK) == 0 ? "/var/tmp" : "/tmp"; }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Defaults, InfoNeedsNoFlags) {
  const auto r = run_cli({"info"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "io_uring")) << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;
}

TEST(Defaults, BenchIoNeedsOnlyPath) {
  temp_dir dir(scratch_parent());
  const std::string file = dir.path() + "/bench.dat";
  const auto r = run_cli({"bench", "io", "--path", file});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // --size 1G read in 1 MiB blocks at queue depth 32 on one thread.
  EXPECT_TRUE(contains(r.out, "read " + file + ", 1.00 GiB in 1.00 MiB blocks, queue depth 32, 1 thread(s)")) << r.out;
  EXPECT_EQ(std::filesystem::file_size(file), std::uintmax_t{1} << 30);
}

TEST(Defaults, BenchOptimNeedsNoFlags) {
  const auto r = run_cli({"bench", "optim"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // AdamW over 16M fp32 parameters on one thread, beside both bounds.
  EXPECT_TRUE(contains(r.out, "bench optim: adamw, 16777216 parameters, 1 thread(s)")) << r.out;
  EXPECT_TRUE(contains(r.out, "param fp32, grad fp32, state fp32")) << r.out;
  EXPECT_TRUE(contains(r.out, "bound: plain loop")) << r.out;
  EXPECT_TRUE(contains(r.out, "ratio to bound")) << r.out;
}

TEST(Defaults, TuneIoNeedsOnlyPath) {
  temp_dir dir(scratch_parent());
  const auto r = run_cli({"tune", "io", "--path", dir.path()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // 4 block sizes x 5 queue depths x 2 thread counts, 64 MiB written and read each.
  EXPECT_TRUE(contains(r.out, "64.00 MiB per trial, 40 trials")) << r.out;
  const std::string snippet = dir.path() + "/tierflow-io.json";
  const auto j = nlohmann::json::parse(testing::slurp(snippet));
  EXPECT_TRUE(j.contains("aio") && j.contains("io")) << j.dump();
  // The scratch file is gone; only the snippet is left.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator{}), 1);
}

}  // namespace
}  // namespace tierflow
