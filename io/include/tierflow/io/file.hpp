// Files as the I/O engine sees them: one path opened twice, once with
// O_DIRECT for the aligned body of each request and once buffered for the
// unaligned head and tail (and for filesystems without O_DIRECT).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace tierflow::io {

class engine;

// An owned file descriptor: closed on destruction, moved with std::exchange.
class unique_fd {
 public:
  unique_fd() noexcept = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& other) noexcept;
  unique_fd& operator=(unique_fd&& other) noexcept;
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd();

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  // Gives up ownership without closing.
  int release() noexcept;
  // Closes now (logging, never throwing, on failure).
  void reset() noexcept;

 private:
  int fd_ = -1;
};

enum class access : std::uint8_t { read_only, read_write };
enum class creation : std::uint8_t {
  open_existing,  // the file must exist
  if_missing,     // create it when it does not exist
  exclusive,      // create it; fail with EEXIST when it exists
};
enum class direct_io : std::uint8_t {
  off,      // the page cache for everything
  prefer,   // O_DIRECT where the filesystem accepts it, the page cache elsewhere
  require,  // O_DIRECT or an error
};

struct open_options {
  tierflow::io::access access = access::read_write;
  tierflow::io::creation creation = creation::open_existing;
  tierflow::io::direct_io direct = direct_io::prefer;
  mode_t mode = 0600;
  // Paths are relative to this directory descriptor (AT_FDCWD: the working directory).
  int directory_fd = -100;  // AT_FDCWD
  // The name errors and path() show (default: the path as given).
  std::string display_path;
};

// An open file. Always opened O_NOFOLLOW | O_CLOEXEC: a symlink in place of
// the file is refused. Move-only; closing it while requests on it are in
// flight is a bug.
class file {
 public:
  // Opens `path` as `options` say. Throws tierflow::error naming the path
  // (ELOOP for a symlink, EEXIST for creation::exclusive, EINVAL when
  // direct_io::require and the filesystem refuses O_DIRECT).
  static file open(const std::string& path, const open_options& options = {});

  file(file&& other) noexcept;
  file& operator=(file&& other) noexcept;
  file(const file&) = delete;
  file& operator=(const file&) = delete;
  ~file();

  const std::string& path() const noexcept { return path_; }
  // The O_DIRECT descriptor, or -1 when this file is not using O_DIRECT.
  int direct_fd() const noexcept { return direct_.get(); }
  // The buffered descriptor (always open).
  int buffered_fd() const noexcept { return buffered_.get(); }
  bool is_direct() const noexcept { return static_cast<bool>(direct_); }
  bool writable() const noexcept { return writable_; }
  // Alignment O_DIRECT needs for buffer addresses here (statx DIOALIGN, or 4096).
  std::size_t memory_alignment() const noexcept { return memory_alignment_; }
  // Alignment used for file offsets and lengths on the O_DIRECT path: 4096.
  static constexpr std::size_t offset_alignment = 4096;

  // Current size (fstat). Throws tierflow::error.
  std::uint64_t size() const;
  // ftruncate. Throws tierflow::error.
  void truncate(std::uint64_t size);
  // fallocate(mode 0): reserves blocks for [offset, offset+length), growing
  // the file. Throws tierflow::error (ENOSPC when the filesystem is full;
  // EOPNOTSUPP where fallocate is unsupported).
  void allocate(std::uint64_t offset, std::uint64_t length);
  // fdatasync. Throws tierflow::error.
  void sync();

  // Registration with one engine (see engine::register_file): the slot pair of
  // its registered file table, -1 when none. Read by the engine's threads.
  int registered_slot(const engine* by) const noexcept {
    return registered_by_.load(std::memory_order_acquire) == by
               ? registered_slot_.load(std::memory_order_relaxed)
               : -1;
  }

 private:
  friend class file_registration;
  friend class engine;
  file() = default;

  std::string path_;
  unique_fd direct_;
  unique_fd buffered_;
  bool writable_ = false;
  std::size_t memory_alignment_ = 4096;
  // Set before the engine may see it (release on registered_by_, acquire in
  // registered_slot()), cleared only after every request on it completed.
  std::atomic<const engine*> registered_by_{nullptr};
  std::atomic<int> registered_slot_{-1};
};

}  // namespace tierflow::io
