// What the kernel and a directory's filesystem offer the I/O engine, probed
// by trying them (never assumed from versions).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace tierflow::io {

// io_uring as this process can use it: a seccomp filter, an old kernel,
// kernel.io_uring_disabled or a missing opcode the engine submits make it
// unavailable, and `reason` says which.
struct uring_capabilities {
  bool available = false;
  std::string reason;                  // empty when available
  std::map<std::string, bool> setup_flags;  // "single_issuer", "defer_taskrun", "coop_taskrun", "sqpoll", ...
  std::map<std::string, bool> opcodes;      // the engine's: "read", "write", "read_fixed", "write_fixed"
  bool register_buffers = false;       // io_uring_register_buffers works on pinned-size buffers
  bool register_files = false;         // io_uring_register_files works
};

// Probes io_uring; cached after the first call (the answer cannot change
// during a process' life). Thread-safe.
const uring_capabilities& probe_uring();

// What a directory offers the NVMe tier.
struct path_capabilities {
  std::string path;         // as given
  std::string mount_point;  // the mount holding it
  std::string filesystem;   // "ext4", "xfs", "tmpfs", ...
  std::string device;       // the mount's source, e.g. "/dev/nvme0n1p2"
  bool o_direct = false;    // a file there opened with O_DIRECT accepted an aligned write and read
  std::string o_direct_reason;  // why not, when o_direct is false
  // Alignment O_DIRECT needs there (statx STATX_DIOALIGN), when the kernel says.
  std::optional<std::uint32_t> direct_memory_alignment;
  std::optional<std::uint32_t> direct_offset_alignment;
  std::uint64_t free_bytes = 0;   // available to this user
  std::uint64_t total_bytes = 0;
};

// Probes `dir` by creating (and removing) a small file in it. Throws
// tierflow::error with the errno (ENOENT, ENOTDIR, EROFS, EACCES...) and the
// path, and one line naming the directory, when it does not exist, is not a
// directory or cannot be written.
path_capabilities probe_path(const std::string& dir);

}  // namespace tierflow::io
