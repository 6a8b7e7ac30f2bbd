// The file-space manager on real directories: allocation and coalescing,
// modes, the symlink and ownership refusals, removal and keeping of files,
// checksums that catch a flipped byte, and a real ENOSPC on a small tmpfs.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include <gtest/gtest.h>

#include "io_test_support.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/io/aligned_buffer.hpp"
#include "tierflow/io/engine.hpp"
#include "tierflow/io/file_space.hpp"

namespace tierflow::io {
namespace {

using testing::backend_test;
using testing::random_bytes;
using testing::scratch_dir;

mode_t mode_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

std::size_t entries(const std::string& dir) {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

TEST(FileSpace, AllocatesAlignedExtentsAndCoalescesFreedOnes) {
  scratch_dir dir;
  file_space space({.directory = dir.file("offload"), .file_size = 1 << 20});
  EXPECT_EQ(mode_of(dir.file("offload")), 0700u);
  const extent a = space.allocate(1);
  const extent b = space.allocate(5000);
  const extent c = space.allocate(4096);
  EXPECT_EQ(a.offset, 0u);
  EXPECT_EQ(b.offset, 4096u);
  EXPECT_EQ(b.reserved(), 8192u);
  EXPECT_EQ(c.offset, 12288u);
  EXPECT_EQ(space.stats().files, 1u);
  for (const file* f : space.files()) EXPECT_EQ(mode_of(f->path()), 0600u);

  space.release(a);
  space.release(c);
  EXPECT_EQ(space.stats().free_ranges, 2u);  // [0,4K) and [12K,1M)
  space.release(b);
  EXPECT_EQ(space.stats().free_ranges, 1u);  // all one range again
  EXPECT_EQ(space.stats().free_bytes, 1u << 20);
  EXPECT_EQ(space.stats().allocated_bytes, 0u);

  // Lowest address first, reusing what was freed; a second file when full.
  std::vector<extent> held;
  for (int i = 0; i < 4; ++i) held.push_back(space.allocate(256 * 1024));
  EXPECT_EQ(held[0].offset, 0u);
  EXPECT_EQ(space.stats().files, 1u);
  const extent more = space.allocate(4096);
  EXPECT_EQ(more.file_index, 1u);
  EXPECT_EQ(space.stats().files, 2u);
  // Bigger than a file: a file of its own size.
  const extent big = space.allocate(3 << 20);
  EXPECT_EQ(space.file_of(big).size(), 3u << 20);
}

TEST(FileSpace, RemovesItsFilesUnlessKept) {
  scratch_dir dir;
  {
    file_space space({.directory = dir.path(), .file_size = 64 * 1024});
    space.allocate(100);
    space.allocate(64 * 1024);
    EXPECT_EQ(entries(dir.path()), 2u);
  }
  EXPECT_EQ(entries(dir.path()), 0u);
  {
    file_space space({.directory = dir.path(), .file_size = 64 * 1024});
    space.allocate(100);
    space.keep();
  }
  EXPECT_EQ(entries(dir.path()), 1u);
}

TEST(FileSpace, RefusesASymlinkedDirectory) {
  scratch_dir dir;
  ASSERT_EQ(::mkdir(dir.file("real").c_str(), 0700), 0);
  ASSERT_EQ(::symlink(dir.file("real").c_str(), dir.file("link").c_str()), 0);
  try {
    file_space space({.directory = dir.file("link")});
    FAIL();
  } catch (const user_error& e) {
    EXPECT_NE(std::string(e.what()).find("symlink"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(dir.file("link")), std::string::npos) << e.what();
  }
}

TEST(FileSpace, RefusesADirectoryHoldingASymlink) {
  scratch_dir dir;
  ASSERT_EQ(::symlink("/etc/passwd", dir.file("tierflow-1-0.nvme").c_str()), 0);
  try {
    file_space space({.directory = dir.path()});
    FAIL();
  } catch (const user_error& e) {
    EXPECT_NE(std::string(e.what()).find("holds a symlink"), std::string::npos) << e.what();
  }
}

TEST(FileSpace, RefusesADirectoryOfAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory to another user (uid 65534)";
  scratch_dir dir;
  const std::string theirs = dir.file("theirs");
  ASSERT_EQ(::mkdir(theirs.c_str(), 0700), 0);
  ASSERT_EQ(::chown(theirs.c_str(), 65534, 65534), 0);
  try {
    file_space space({.directory = theirs});
    FAIL();
  } catch (const user_error& e) {
    EXPECT_NE(std::string(e.what()).find("owned by uid 65534"), std::string::npos) << e.what();
  }
  // Ours, but holding another user's file.
  const std::string mine = dir.file("mine");
  ASSERT_EQ(::mkdir(mine.c_str(), 0700), 0);
  const std::string planted = mine + "/planted";
  ::close(::open(planted.c_str(), O_CREAT | O_WRONLY, 0600));
  ASSERT_EQ(::chown(planted.c_str(), 65534, 65534), 0);
  EXPECT_THROW(file_space({.directory = mine}), user_error);
}

TEST(FileSpace, RefusesAPathThatIsAFile) {
  scratch_dir dir;
  ::close(::open(dir.file("plain").c_str(), O_CREAT | O_WRONLY, 0600));
  try {
    file_space space({.directory = dir.file("plain")});
    FAIL();
  } catch (const user_error& e) {
    FAIL() << "an environment failure with its errno, not a user error: " << e.what();
  } catch (const tierflow::error& e) {
    EXPECT_EQ(e.errnum(), ENOTDIR);
    EXPECT_EQ(e.context().path, dir.file("plain"));
    EXPECT_EQ(std::string(e.what()), "offload directory " + dir.file("plain") + ": not a directory");
  }
}

// A missing parent and a read-only mount: errno and the path, not a user error
// (Python raises OSError for them).
TEST(FileSpace, AnUncreatableOrUnwritableDirectoryIsAnErrorWithItsErrno) {
  scratch_dir dir;
  const std::string missing = dir.file("no/such");
  try {
    file_space space({.directory = missing});
    FAIL();
  } catch (const user_error& e) {
    FAIL() << e.what();
  } catch (const tierflow::error& e) {
    EXPECT_EQ(e.errnum(), ENOENT);
    EXPECT_EQ(e.context().path, missing);
    EXPECT_NE(std::string(e.what()).find(missing + ": cannot be created"), std::string::npos) << e.what();
  }
  const std::string ro = dir.file("ro");
  ASSERT_EQ(::mkdir(ro.c_str(), 0700), 0);
  if (::mount("tierflow-test", ro.c_str(), "tmpfs", MS_RDONLY, "size=64k") != 0) {
    if (::geteuid() == 0) GTEST_SKIP() << "cannot mount a read-only tmpfs here: " << std::strerror(errno);
    ::chmod(ro.c_str(), 0500);  // refuses anyone but root
  }
  try {
    file_space space({.directory = ro});
    ADD_FAILURE() << "a read-only directory was accepted";
  } catch (const user_error& e) {
    ADD_FAILURE() << e.what();
  } catch (const tierflow::error& e) {
    EXPECT_TRUE(e.errnum() == EROFS || e.errnum() == EACCES) << e.errnum();
    EXPECT_EQ(e.context().path, ro);
    EXPECT_NE(std::string(e.what()).find(ro + ": cannot be written"), std::string::npos) << e.what();
  }
  if (::umount(ro.c_str()) != 0) ::chmod(ro.c_str(), 0700);
}

TEST(FileSpace, CapacityIsEnforcedWithAClearError) {
  scratch_dir dir;
  file_space space({.directory = dir.path(), .file_size = 64 * 1024, .capacity = 128 * 1024});
  space.allocate(64 * 1024);
  space.allocate(64 * 1024);
  try {
    space.allocate(1);
    FAIL();
  } catch (const tierflow::error& e) {
    EXPECT_EQ(e.errnum(), ENOSPC);
    EXPECT_NE(std::string(e.what()).find(dir.path()), std::string::npos) << e.what();
  }
}

// ---- through an engine, on both backends -----------------------------------------

class FileSpaceIo : public backend_test {};

TEST_P(FileSpaceIo, ChecksumCatchesOneFlippedByte) {
  scratch_dir dir;
  auto eng = make_engine(config());
  file_space space({.directory = dir.path(), .file_size = 1 << 20, .checksums = checksums::on});
  const extent e = space.allocate(100000);
  const auto data = random_bytes(e.length, 31);
  aligned_buffer b(e.reserved());
  std::memcpy(b.data(), data.data(), data.size());
  space.write(*eng, e, {b.data(), e.length});
  space.read(*eng, e, {b.data(), e.length});  // intact: no error

  // Flip one byte in the middle of the extent, behind the engine's back.
  const std::string path = space.file_of(e).path();
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::byte x{};
  ASSERT_EQ(::pread(fd, &x, 1, static_cast<off_t>(e.offset + 54321)), 1);
  x ^= std::byte{0x01};
  ASSERT_EQ(::pwrite(fd, &x, 1, static_cast<off_t>(e.offset + 54321)), 1);
  ::close(fd);
  try {
    space.read(*eng, e, {b.data(), e.length});
    FAIL() << "a flipped byte went unnoticed";
  } catch (const tierflow::error& err) {
    EXPECT_EQ(err.errnum(), EBADMSG);
    EXPECT_EQ(err.context().path, path);
    EXPECT_NE(err.context().block.find("extent 0:"), std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find("checksum mismatch"), std::string::npos) << err.what();
  }
}

// A real full disk: a 2 MiB tmpfs mounted by the test.
class small_filesystem {
 public:
  small_filesystem() {
    std::string tmpl = testing::scratch_dir::default_parent() + "/tierflow-enospc-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      reason_ = "mkdtemp failed";
      return;
    }
    path_ = tmpl;
    if (::mount("tierflow-test", path_.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "size=2m,mode=0700") != 0) {
      reason_ = std::string("cannot mount a tmpfs (") + std::strerror(errno) + "); needs root or CAP_SYS_ADMIN";
      return;
    }
    mounted_ = true;
  }
  ~small_filesystem() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
    if (!path_.empty()) ::rmdir(path_.c_str());
  }
  bool mounted() const { return mounted_; }
  const std::string& reason() const { return reason_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string reason_;
  bool mounted_ = false;
};

TEST_P(FileSpaceIo, RealEnospcIsClearAndKeepsEveryStoredBlock) {
  small_filesystem fs;
  if (!fs.mounted()) GTEST_SKIP() << fs.reason();
  auto eng = make_engine(config());
  const std::string dir = fs.path() + "/offload";
  file_space space({.directory = dir, .file_size = 256 * 1024, .checksums = checksums::on});
  std::vector<std::pair<extent, std::vector<std::byte>>> stored;
  aligned_buffer b(64 * 1024);
  bool full = false;
  for (int i = 0; i < 1000 && !full; ++i) {
    try {
      const extent e = space.allocate(60 * 1024 + i);
      auto data = random_bytes(e.length, 100 + i);
      std::memcpy(b.data(), data.data(), data.size());
      space.write(*eng, e, {b.data(), e.length});
      stored.emplace_back(e, std::move(data));
    } catch (const tierflow::error& e) {
      EXPECT_EQ(e.errnum(), ENOSPC) << e.what();
      EXPECT_NE(std::string(e.what()).find(dir), std::string::npos) << e.what();
      full = true;
    }
  }
  ASSERT_TRUE(full) << "a 2 MiB filesystem never filled up";
  ASSERT_GT(stored.size(), 10u);
  for (const auto& [e, data] : stored) {
    std::memset(b.data(), 0, b.size());
    space.read(*eng, e, {b.data(), e.length});
    ASSERT_EQ(std::memcmp(b.data(), data.data(), data.size()), 0) << "extent at " << e.offset;
  }

  // And a plain write that runs the disk out of space fails with ENOSPC, naming the file.
  file filler = file::open(dir + "/filler", {.creation = creation::if_missing});
  aligned_buffer big(4 << 20);
  operation op;
  op.prepare_write(filler, 0, big.span());
  eng->submit(op);
  op.wait_quietly();
  ASSERT_TRUE(op.failed());
  EXPECT_EQ(op.errnum(), ENOSPC);
  try {
    op.rethrow_if_failed();
  } catch (const tierflow::error& e) {
    EXPECT_EQ(e.context().path, filler.path());
    EXPECT_EQ(e.context().length, big.size());
  }
  for (const auto& [e, data] : stored) {
    space.read(*eng, e, {b.data(), e.length});
    ASSERT_EQ(std::memcmp(b.data(), data.data(), data.size()), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, FileSpaceIo, ::testing::ValuesIn(testing::backends()), testing::backend_name);

}  // namespace
}  // namespace tierflow::io
