#include "tierflow/io/probe.hpp"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "tierflow/core/error.hpp"

namespace tierflow::io {
namespace {

// Tries to set up a small ring with `flags`; returns 0 or -errno.
int try_setup(unsigned flags) {
  io_uring ring;
  io_uring_params params{};
  params.flags = flags;
  if (flags & IORING_SETUP_SQPOLL) params.sq_thread_idle = 10;
  const int rc = io_uring_queue_init_params(4, &ring, &params);
  if (rc == 0) io_uring_queue_exit(&ring);
  return rc;
}

uring_capabilities probe_uring_uncached() {
  uring_capabilities caps;
  if (const int rc = try_setup(0); rc < 0) {
    caps.reason = std::string("io_uring_setup: ") + std::strerror(-rc);
    if (rc == -EPERM) caps.reason += " (kernel.io_uring_disabled or a seccomp filter)";
    if (rc == -ENOSYS) caps.reason += " (kernel without io_uring, or a seccomp filter)";
    return caps;
  }
  caps.available = true;
  caps.setup_flags["single_issuer"] = try_setup(IORING_SETUP_SINGLE_ISSUER) == 0;
  caps.setup_flags["coop_taskrun"] = try_setup(IORING_SETUP_COOP_TASKRUN) == 0;
  caps.setup_flags["defer_taskrun"] =
      try_setup(IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN) == 0;
  caps.setup_flags["sqpoll"] = try_setup(IORING_SETUP_SQPOLL) == 0;
  caps.setup_flags["submit_all"] = try_setup(IORING_SETUP_SUBMIT_ALL) == 0;

  // Exactly the opcodes the engine prepares: READ and WRITE (unregistered
  // buffers, and the wake eventfd's read), READ_FIXED and WRITE_FIXED
  // (registered buffers). A ring lacking one would fail requests, so it
  // counts as unavailable and automatic falls back to the thread pool.
  io_uring_probe* probe = io_uring_get_probe();
  if (probe == nullptr) {
    caps.available = false;
    caps.reason = "io_uring cannot list its opcodes (IORING_REGISTER_PROBE; kernels before 5.6 lack IORING_OP_READ)";
    return caps;
  }
  const std::pair<const char*, int> ops[] = {{"read", IORING_OP_READ},
                                             {"write", IORING_OP_WRITE},
                                             {"read_fixed", IORING_OP_READ_FIXED},
                                             {"write_fixed", IORING_OP_WRITE_FIXED}};
  for (auto [name, op] : ops) {
    const bool supported = io_uring_opcode_supported(probe, op) != 0;
    caps.opcodes[name] = supported;
    if (!supported && caps.available) {
      caps.available = false;
      caps.reason = std::string("io_uring without the ") + name + " opcode, which the engine submits";
    }
  }
  io_uring_free_probe(probe);

  // Registration: one ring, one page-aligned buffer, one file descriptor.
  io_uring ring;
  if (io_uring_queue_init(4, &ring, 0) == 0) {
    void* page = nullptr;
    if (posix_memalign(&page, 4096, 4096) == 0) {
      iovec iov{page, 4096};
      caps.register_buffers = io_uring_register_buffers(&ring, &iov, 1) == 0;
      std::free(page);
    }
    const int fd = STDERR_FILENO;
    caps.register_files = io_uring_register_files(&ring, &fd, 1) == 0;
    io_uring_queue_exit(&ring);
  }
  return caps;
}

// The mount holding `real_path`: the longest mount point prefix in mountinfo.
void find_mount(const std::string& real_path, path_capabilities& out) {
  std::ifstream in("/proc/self/mountinfo");
  std::size_t best = 0;
  for (std::string line; std::getline(in, line);) {
    // id parent major:minor root mount_point options [optional...] - fstype source super
    std::istringstream fields(line);
    std::string id, parent, devno, root, mount_point;
    fields >> id >> parent >> devno >> root >> mount_point;
    const auto dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream tail(line.substr(dash + 3));
    std::string fstype, source;
    tail >> fstype >> source;
    const bool prefix = real_path == mount_point || mount_point == "/" ||
                        (real_path.starts_with(mount_point) && real_path[mount_point.size()] == '/');
    // Equal lengths: the later line is mounted over the earlier one.
    if (prefix && mount_point.size() >= best) {
      best = mount_point.size();
      out.mount_point = mount_point;
      out.filesystem = fstype;
      out.device = source;
    }
  }
}

// Opens a fresh file in `dir` with O_DIRECT and moves one aligned block
// through it, as the engine would.
void probe_o_direct(const std::string& dir, path_capabilities& out) {
  std::string name = dir + "/.tierflow-probe-XXXXXX";
  const int plain = ::mkstemp(name.data());
  if (plain < 0) {
    const int err = errno;
    // The directory exists (probe_path stat()ed it): ENOENT here is the
    // filesystem refusing to create any file (proc, sysfs, cgroup), which
    // strerror would word as a missing path.
    const error_context context = error_context{"create a file in"}.at(dir);
    if (err == ENOENT) {
      throw error(err, context,
                  "directory " + dir + ": cannot be written: its " +
                      (out.filesystem.empty() ? std::string() : out.filesystem + " ") +
                      "filesystem does not let files be created");
    }
    throw error(err, context, "directory " + dir + ": cannot be written (" + std::strerror(err) + ")");
  }
  ::close(plain);
  const int fd = ::open(name.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  if (fd < 0) {
    out.o_direct_reason = std::string("open(O_DIRECT): ") + std::strerror(errno);
    ::unlink(name.c_str());
    return;
  }
  constexpr std::size_t block = 4096;
  void* buffer = nullptr;
  if (posix_memalign(&buffer, block, block) != 0) {
    ::close(fd);
    ::unlink(name.c_str());
    throw error(ENOMEM, error_context{"posix_memalign"});
  }
  std::memset(buffer, 0x5a, block);
  if (::pwrite(fd, buffer, block, 0) != static_cast<ssize_t>(block)) {
    out.o_direct_reason = std::string("aligned O_DIRECT write: ") + std::strerror(errno);
  } else if (::pread(fd, buffer, block, 0) != static_cast<ssize_t>(block)) {
    out.o_direct_reason = std::string("aligned O_DIRECT read: ") + std::strerror(errno);
  } else {
    out.o_direct = true;
  }
#if defined(STATX_DIOALIGN)
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_mem_align != 0) {
    out.direct_memory_alignment = sx.stx_dio_mem_align;
    out.direct_offset_alignment = sx.stx_dio_offset_align;
  }
#endif
  std::free(buffer);
  ::close(fd);
  ::unlink(name.c_str());
}

}  // namespace

const uring_capabilities& probe_uring() {
  static const uring_capabilities caps = probe_uring_uncached();
  return caps;
}

path_capabilities probe_path(const std::string& dir) {
  path_capabilities out;
  out.path = dir;
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    throw error(err, error_context{"stat"}.at(dir), "directory " + dir + ": " + std::strerror(err));
  }
  if (!S_ISDIR(st.st_mode))
    throw error(ENOTDIR, error_context{"stat"}.at(dir), "directory " + dir + ": not a directory");

  std::unique_ptr<char, decltype(&std::free)> real(::realpath(dir.c_str(), nullptr), &std::free);
  find_mount(real ? real.get() : dir, out);

  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) == 0) {
    out.free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    out.total_bytes = static_cast<std::uint64_t>(vfs.f_blocks) * vfs.f_frsize;
  }
  probe_o_direct(dir, out);
  return out;
}

}  // namespace tierflow::io
