#include "tierflow/core/error.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include <gtest/gtest.h>

#include "tierflow/core/assert.hpp"

namespace tierflow {
namespace {

TEST(Error, CarriesErrnoAndEveryContextField) {
  try {
    throw error(EIO, error_context{"read"}.at("/data/state.0").range(4096, 1 << 20).in_tier("nvme").of_block(
                         "l3.exp_avg"));
  } catch (const std::system_error& e) {  // catchable as the standard type
    const auto& te = dynamic_cast<const error&>(e);
    EXPECT_EQ(te.errnum(), EIO);
    EXPECT_EQ(te.code(), std::error_code(EIO, std::generic_category()));
    EXPECT_EQ(te.context().operation, "read");
    EXPECT_EQ(te.context().path, "/data/state.0");
    EXPECT_EQ(te.context().offset, 4096u);
    EXPECT_EQ(te.context().length, 1u << 20);
    EXPECT_EQ(te.context().tier, "nvme");
    EXPECT_EQ(te.context().block, "l3.exp_avg");
    const std::string what = te.what();
    EXPECT_NE(what.find("read /data/state.0"), std::string::npos) << what;
    EXPECT_NE(what.find("offset 4096"), std::string::npos) << what;
    EXPECT_NE(what.find("length 1048576"), std::string::npos) << what;
    EXPECT_NE(what.find("tier nvme"), std::string::npos) << what;
    EXPECT_NE(what.find("block \"l3.exp_avg\""), std::string::npos) << what;
    EXPECT_NE(what.find(std::error_code(EIO, std::generic_category()).message()), std::string::npos)
        << what;
    EXPECT_NE(what.find("core/error_test.cpp:"), std::string::npos) << what;  // file:line
    return;
  }
  FAIL() << "nothing thrown";
}

TEST(Error, CheckSyscallCapturesErrnoOfTheFailedCall) {
  const std::string path = "/nonexistent-tierflow-dir/file";
  try {
    TF_CHECK_SYSCALL(::open(path.c_str(), O_RDONLY), error_context{"open"}.at(path));
    FAIL() << "open of a missing file succeeded";
  } catch (const error& e) {
    EXPECT_EQ(e.errnum(), ENOENT);
    EXPECT_EQ(e.context().path, path);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
  }
}

TEST(Error, CheckSyscallPassesTheResultThroughAndBuildsNoContextOnSuccess) {
  int built = 0;
  auto context = [&] {
    ++built;
    return error_context{"dup"};
  };
  const int fd = TF_CHECK_SYSCALL(::dup(STDERR_FILENO), context());
  EXPECT_GE(fd, 0);
  EXPECT_EQ(built, 0);
  ::close(fd);
}

TEST(Error, NegativeResultBecomesErrno) {
  try {
    TF_CHECK_ERRNO_RESULT(-ENOSPC, error_context{"write"}.at("/x").range(0, 512));
    FAIL();
  } catch (const error& e) {
    EXPECT_EQ(e.errnum(), ENOSPC);
    EXPECT_EQ(e.context().length, 512u);
  }
  EXPECT_NO_THROW(TF_CHECK_ERRNO_RESULT(4096, error_context{"write"}));
}

TEST(Error, UserErrorIsOneLineOfTheSameFamily) {
  try {
    throw user_error("--size: '12X' has an unknown suffix (use K, M, G or T)");
  } catch (const error& e) {
    EXPECT_STREQ(e.what(), "--size: '12X' has an unknown suffix (use K, M, G or T)");
    EXPECT_EQ(e.code(), std::errc::invalid_argument);
  }
}

TEST(Error, AWordedErrorKeepsItsLineAndItsErrnoAndPath) {
  try {
    throw error(EROFS, error_context{"create a file in"}.at("/mnt/ro"),
                "directory /mnt/ro: cannot be written (Read-only file system)");
  } catch (const user_error&) {
    FAIL() << "an environment failure, not a user error";
  } catch (const error& e) {
    EXPECT_STREQ(e.what(), "directory /mnt/ro: cannot be written (Read-only file system)");
    EXPECT_EQ(e.errnum(), EROFS);
    EXPECT_EQ(e.context().path, "/mnt/ro");
    EXPECT_NE(e.where().find("error_test.cpp:"), std::string::npos) << e.where();
  }
}

TEST(ErrorDeathTest, BrokenInvariantAbortsWithFileAndLine) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(TF_ASSERT(1 + 1 == 3, "arithmetic"),
               "assertion `1 \\+ 1 == 3` failed at .*error_test.cpp:[0-9]+: arithmetic");
}

}  // namespace
}  // namespace tierflow
