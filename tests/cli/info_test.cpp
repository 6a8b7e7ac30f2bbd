// `tierflow info` run as a user would, its answers checked against the same
// facts probed independently here.
#include <fcntl.h>
#include <liburing.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "run_cli.hpp"

namespace tierflow {
namespace {

using nlohmann::json;
using testing::run_cli;
using testing::temp_dir;

json info_json(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"info", "--json"};
  args.insert(args.end(), extra.begin(), extra.end());
  const auto r = run_cli(args);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return json::parse(r.out);  // throws (and fails the test) unless it is one JSON object
}

TEST(Info, JsonHasTheDocumentedKeysWithTheirTypes) {
  const json j = info_json();
  ASSERT_TRUE(j.is_object());
  EXPECT_TRUE(j["cpus"].is_number_integer());
  EXPECT_GE(j["cpus"].get<int>(), 1);
  EXPECT_EQ(j["cpus"].get<long>(), ::sysconf(_SC_NPROCESSORS_ONLN));
  EXPECT_TRUE(j["numa_nodes"].is_number_integer());
  EXPECT_GE(j["numa_nodes"].get<int>(), 1);
  EXPECT_EQ(j["numa"].size(), j["numa_nodes"].get<std::size_t>());
  EXPECT_TRUE(j["simd"].is_string());
  EXPECT_TRUE(j["io_uring"]["available"].is_boolean());
  EXPECT_TRUE(j["cuda"]["available"].is_boolean());
  EXPECT_TRUE(j["cuda"]["devices"].is_array());
  EXPECT_TRUE(j["memory"]["total_bytes"].is_number_unsigned());
  EXPECT_GT(j["memory"]["total_bytes"].get<std::uint64_t>(), 0u);
  EXPECT_FALSE(j.contains("path"));
  if (!j["cuda"]["available"].get<bool>()) {
    EXPECT_FALSE(j["cuda"]["reason"].get<std::string>().empty());
    EXPECT_TRUE(j["cuda"]["devices"].empty());
  }
}

TEST(Info, IoUringAnswerMatchesARealRingSetUp) {
  io_uring ring;
  const int rc = io_uring_queue_init(8, &ring, 0);
  if (rc == 0) io_uring_queue_exit(&ring);
  const json j = info_json();
  EXPECT_EQ(j["io_uring"]["available"].get<bool>(), rc == 0)
      << "direct set-up returned " << rc;
  if (rc == 0) {
    EXPECT_TRUE(j["io_uring"]["opcodes"]["read"].get<bool>());
    EXPECT_TRUE(j["io_uring"]["opcodes"]["write"].get<bool>());
  } else {
    EXPECT_FALSE(j["io_uring"]["reason"].get<std::string>().empty());
  }
}

TEST(Info, MemlockLimitMatchesGetrlimit) {
  rlimit lim{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &lim), 0);
  const json j = info_json();
  if (lim.rlim_cur == RLIM_INFINITY) EXPECT_TRUE(j["memory"]["memlock_limit_bytes"].is_null());
  else EXPECT_EQ(j["memory"]["memlock_limit_bytes"].get<std::uint64_t>(), lim.rlim_cur);
}

// O_DIRECT as the probe reports it, compared with a real open() + aligned I/O
// here, on the filesystems this machine has at hand.
bool o_direct_works(const std::string& dir) {
  const std::string file = dir + "/direct-check";
  const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd < 0) return false;
  void* buf = nullptr;
  bool ok = posix_memalign(&buf, 4096, 4096) == 0;
  if (ok) {
    std::memset(buf, 1, 4096);
    ok = ::pwrite(fd, buf, 4096, 0) == 4096 && ::pread(fd, buf, 4096, 0) == 4096;
  }
  std::free(buf);
  ::close(fd);
  ::unlink(file.c_str());
  return ok;
}

TEST(Info, ODirectDetectionMatchesARealOpen) {
  int checked = 0;
  for (const char* parent : {"/tmp", "/dev/shm", "/var/tmp"}) {
    temp_dir dir(parent);
    if (!dir.ok()) continue;
    const json j = info_json({"--path", dir.path()});
    ASSERT_TRUE(j.contains("path"));
    const json& p = j["path"];
    EXPECT_EQ(p["o_direct"].get<bool>(), o_direct_works(dir.path())) << parent;
    EXPECT_FALSE(p["filesystem"].get<std::string>().empty());
    EXPECT_GT(p["total_bytes"].get<std::uint64_t>(), 0u);
    if (!p["o_direct"].get<bool>()) {
      EXPECT_FALSE(p["o_direct_reason"].get<std::string>().empty());
    }
    // The probe leaves nothing behind.
    EXPECT_EQ(std::system(("test -z \"$(ls -A '" + dir.path() + "')\"").c_str()), 0);
    ++checked;
  }
  EXPECT_GE(checked, 1);
}

TEST(Info, HumanOutputIsATable) {
  const auto r = run_cli({"info"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("io_uring"), std::string::npos);
  EXPECT_NE(r.out.find("simd"), std::string::npos);
  EXPECT_NE(r.out.find("cuda"), std::string::npos);
}

TEST(Cli, MissingPathIsOneLineNamingItAndExit1) {
  const std::string missing = "/nonexistent-tierflow-path/deeper";
  const auto r = run_cli({"info", "--path", missing});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(r.out.empty());
  EXPECT_NE(r.err.find(missing), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(Cli, PathThatIsAFileIsRefused) {
  temp_dir dir;
  const std::string file = dir.path() + "/plain-file";
  ::close(::open(file.c_str(), O_CREAT | O_WRONLY, 0600));
  const auto r = run_cli({"info", "--path", file});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("not a directory"), std::string::npos) << r.err;
}

TEST(Cli, ReadOnlyPathIsRefused) {
  temp_dir dir;
  // A read-only filesystem refuses root too; a 0500 directory refuses others.
  const bool mounted = ::mount("tierflow-test", dir.path().c_str(), "tmpfs", MS_RDONLY, "size=64k") == 0;
  if (!mounted) {
    if (::geteuid() == 0) GTEST_SKIP() << "cannot mount a read-only tmpfs here: " << std::strerror(errno);
    ::chmod(dir.path().c_str(), 0500);
  }
  const auto r = run_cli({"info", "--path", dir.path()});
  if (mounted) ::umount(dir.path().c_str());
  else ::chmod(dir.path().c_str(), 0700);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(dir.path()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("cannot be written"), std::string::npos) << r.err;
}

// A directory that exists on a filesystem that creates no files: the error
// names that cause, not the "No such file or directory" creating one returned.
TEST(Cli, PathOnAFilesystemThatCreatesNoFilesNamesIt) {
  struct stat st {};
  if (::stat("/proc/self", &st) != 0) GTEST_SKIP() << "no /proc here";
  for (const char* verb : {"info", "tune"}) {
    const auto r = verb == std::string("info") ? run_cli({"info", "--path", "/proc"})
                                               : run_cli({"tune", "io", "--path", "/proc"});
    EXPECT_EQ(r.exit_code, 1) << verb;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("directory /proc: cannot be written"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("proc filesystem does not let files be created"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("No such file or directory"), std::string::npos) << r.err;
  }
}

TEST(Cli, UnknownSubcommandOrFlagPrintsUsageAndExits2) {
  for (const auto& args : std::vector<std::vector<std::string>>{{"frobnicate"}, {"info", "--bogus"}, {}}) {
    const auto r = run_cli(args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("Usage"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("terminate"), std::string::npos) << r.err;  // no abort
  }
}

TEST(Cli, HelpAndVersion) {
  const auto help = run_cli({"info", "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("--path"), std::string::npos);
  const auto version = run_cli({"--version"});
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_EQ(version.out.rfind("tierflow ", 0), 0u) << version.out;
}

}  // namespace
}  // namespace tierflow
