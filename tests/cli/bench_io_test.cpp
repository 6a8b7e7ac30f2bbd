// `tierflow bench io` and `tierflow tune io` run as a user would: the JSON
// keys and their types, the bytes really landing in the file, the one-line
// errors for bad values, and the snippet tune writes being one the engine reads.
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <liburing.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "run_cli.hpp"

namespace tierflow {
namespace {

using nlohmann::json;
using testing::run_cli;
using testing::temp_dir;

std::string scratch_parent() { return ::access("/var/tmp", W_OK) == 0 ? "/var/tmp" : "/tmp"; }

std::uint64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
}

class BenchIo : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (std::string(GetParam()) != "uring") return;
    io_uring ring;
    const int rc = io_uring_queue_init(4, &ring, 0);
    if (rc != 0) GTEST_SKIP() << "io_uring unavailable here (io_uring_queue_init: " << rc << ")";
    io_uring_queue_exit(&ring);
  }
};

TEST_P(BenchIo, JsonIsOneObjectWithTheDocumentedKeys) {
  temp_dir dir(scratch_parent());
  const std::string file = dir.path() + "/bench.dat";
  for (const char* pattern : {"write", "read", "randwrite", "randread"}) {
    const auto r = run_cli({"bench", "io", "--path", file, "--size", "8M", "--block-size", "64K", "--queue-depth",
                            "8", "--pattern", pattern, "--backend", GetParam(), "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["pattern"], pattern);
    EXPECT_EQ(j["bytes"].get<std::uint64_t>(), 8u << 20);
    EXPECT_GT(j["seconds"].get<double>(), 0);
    EXPECT_GT(j["bytes_per_second"].get<double>(), 0);
    EXPECT_NEAR(j["iops"].get<double>(), j["bytes_per_second"].get<double>() / 65536, 1);
    EXPECT_GT(j["latency_us"]["p50"].get<double>(), 0);
    EXPECT_GE(j["latency_us"]["p99"].get<double>(), j["latency_us"]["p50"].get<double>());
    EXPECT_EQ(j["backend"], GetParam());
  }
  EXPECT_EQ(file_size(file), 8u << 20);
}

TEST_P(BenchIo, HumanOutputIsATable) {
  temp_dir dir(scratch_parent());
  const auto r = run_cli({"bench", "io", "--path", dir.path() + "/f", "--size", "4M", "--block-size", "1M",
                          "--backend", GetParam(), "--threads", "2", "--buffered"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("bandwidth"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("latency p99"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("page cache"), std::string::npos) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Backends, BenchIo, ::testing::Values("uring", "threads"),
                         [](const auto& param_info) { return std::string(param_info.param); });

TEST(BenchIoCli, BadValuesAreOneLineAndExit1) {
  temp_dir dir(scratch_parent());
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--size", "lots"},
           {"--block-size", "1000"},
           {"--size", "64K", "--block-size", "1M"}}) {
    std::vector<std::string> full = {"bench", "io", "--path", dir.path() + "/f"};
    full.insert(full.end(), args.begin(), args.end());
    const auto r = run_cli(full);
    EXPECT_EQ(r.exit_code, 1) << args[0] << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.rfind("tierflow: ", 0), 0u) << r.err;
  }
  const auto is_dir = run_cli({"bench", "io", "--path", dir.path()});
  EXPECT_EQ(is_dir.exit_code, 1);
  EXPECT_NE(is_dir.err.find("is a directory"), std::string::npos) << is_dir.err;
}

// A file that cannot be created: the one line says why (a missing directory,
// or a filesystem that makes no files), never the bare "No such file or
// directory" both return.
TEST(BenchIoCli, UncreatableFileNamesTheCause) {
  const auto missing = run_cli({"bench", "io", "--path", "/nonexistent-tierflow-dir/bench.dat", "--size", "1M"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_EQ(std::count(missing.err.begin(), missing.err.end(), '\n'), 1) << missing.err;
  EXPECT_NE(missing.err.find("its directory /nonexistent-tierflow-dir does not exist"), std::string::npos)
      << missing.err;

  struct stat st {};
  if (::stat("/proc/self", &st) != 0) GTEST_SKIP() << "no /proc here";
  const auto proc = run_cli({"bench", "io", "--path", "/proc/tierflow-bench.dat", "--size", "1M"});
  EXPECT_EQ(proc.exit_code, 1);
  EXPECT_EQ(std::count(proc.err.begin(), proc.err.end(), '\n'), 1) << proc.err;
  EXPECT_NE(proc.err.find("--path /proc/tierflow-bench.dat: cannot be created: /proc is on a filesystem that does "
                          "not let files be created"),
            std::string::npos)
      << proc.err;
  EXPECT_EQ(proc.err.find("No such file or directory"), std::string::npos) << proc.err;
}

TEST(BenchIoCli, UnknownPatternOrMissingPathIsAUsageError) {
  EXPECT_EQ(run_cli({"bench", "io", "--path", "/tmp/x", "--pattern", "sideways"}).exit_code, 2);
  EXPECT_EQ(run_cli({"bench", "io"}).exit_code, 2);
  EXPECT_EQ(run_cli({"bench"}).exit_code, 2);
  const auto help = run_cli({"bench", "io", "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("--queue-depth"), std::string::npos);
}

TEST(TuneIoCli, RanksTrialsAndWritesASnippetBenchIoReads) {
  temp_dir dir(scratch_parent());
  const std::string snippet = dir.path() + "/best.json";
  const auto r = run_cli({"tune", "io", "--path", dir.path(), "--size", "4M", "--block-sizes", "64K,256K",
                          "--queue-depths", "2,8", "--threads", "1", "--output", snippet, "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j["trials"].size(), 4u);
  for (std::size_t i = 1; i < j["trials"].size(); ++i) {
    EXPECT_GE(j["trials"][i - 1]["score"].get<double>(), j["trials"][i]["score"].get<double>());
  }
  EXPECT_EQ(j["best"], j["trials"][0]);
  std::ifstream in(snippet);
  const json written = json::parse(in);
  EXPECT_EQ(written["aio"]["block_size"], j["best"]["block_size"]);
  EXPECT_EQ(written["aio"]["queue_depth"], j["best"]["queue_depth"]);
  EXPECT_EQ(written["aio"]["intra_op_parallelism"], j["best"]["threads"]);
  // Only the snippet is left behind: the scratch file is gone.
  EXPECT_EQ(std::system(("test $(ls -A '" + dir.path() + "' | wc -l) -eq 1").c_str()), 0);

  const auto bench = run_cli({"bench", "io", "--path", dir.path() + "/f", "--size", "4M", "--config", snippet, "--json"});
  ASSERT_EQ(bench.exit_code, 0) << bench.err;
  const json b = json::parse(bench.out);
  EXPECT_EQ(b["block_size"], j["best"]["block_size"]);
  EXPECT_EQ(b["queue_depth"], j["best"]["queue_depth"]);
}

// Refuses io_uring_setup with ENOSYS through a seccomp filter (as a container
// whose profile blocks io_uring does); exits 126 where no filter can be set.
void refuse_io_uring() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
      ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) != 0) {
    ::_exit(126);
  }
}

testing::cli_result run_cli_without_io_uring(const std::vector<std::string>& args) {
  return run_cli(args, &refuse_io_uring);
}

TEST(BenchIoCli, FallsBackToThreadsWhereIoUringIsRefused) {
  temp_dir dir(scratch_parent());
  const std::string file = dir.path() + "/f";
  const auto r = run_cli_without_io_uring({"bench", "io", "--path", file, "--size", "4M", "--json"});
  if (r.exit_code == 126) GTEST_SKIP() << "cannot install a seccomp filter here";
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["backend"], "threads");
  // Forcing io_uring there is a clear one-line error.
  const auto forced = run_cli_without_io_uring({"bench", "io", "--path", file, "--size", "4M", "--backend", "uring"});
  EXPECT_EQ(forced.exit_code, 1);
  EXPECT_NE(forced.err.find("io_uring"), std::string::npos) << forced.err;
  EXPECT_EQ(std::count(forced.err.begin(), forced.err.end(), '\n'), 1) << forced.err;
}

TEST(TuneIoCli, MissingDirectoryIsOneLine) {
  const auto r = run_cli({"tune", "io", "--path", "/nonexistent-tierflow-dir"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("/nonexistent-tierflow-dir"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace tierflow
