// The NVMe tier's file space: preallocated files in one offload directory,
// carved into 4 KiB-aligned extents by an allocator with a free list that
// coalesces neighbours, and optional per-extent checksums.
//
// Safety: the directory is created 0700 (or must already be a real directory
// owned by this user, holding no symlink and nothing of another user); files
// are created 0600 with O_EXCL | O_NOFOLLOW | O_CLOEXEC relative to the
// directory's descriptor. A full disk is an error naming the directory, and
// never touches what is already stored. Files are removed on destruction
// unless keep() was called (a checkpoint).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "tierflow/core/thread_annotations.hpp"
#include "tierflow/io/file.hpp"

namespace tierflow::io {

class engine;

// A run of bytes in one of the space's files. `length` is what the caller
// asked for; the space reserved is `length` rounded up to 4 KiB.
struct extent {
  std::uint32_t file_index = 0;
  std::uint64_t offset = 0;  // 4 KiB-aligned
  std::uint64_t length = 0;
  std::uint64_t reserved() const noexcept { return (length + 4095) & ~std::uint64_t{4095}; }
  friend bool operator==(const extent&, const extent&) = default;
};

enum class keep_files : std::uint8_t { no, yes };
enum class checksums : std::uint8_t { off, on };

struct file_space_options {
  std::string directory;                    // created 0700 when missing (its parent must exist)
  std::uint64_t file_size = 1ull << 30;     // each preallocated file (a multiple of 4 KiB)
  std::uint64_t capacity = 0;               // the most bytes of files to create; 0: no limit
  tierflow::io::checksums checksums = checksums::off;
  tierflow::io::direct_io direct = direct_io::prefer;
  tierflow::io::keep_files keep = keep_files::no;
};

struct file_space_stats {
  std::uint64_t file_bytes = 0;       // preallocated in files
  std::uint64_t allocated_bytes = 0;  // reserved by live extents
  std::uint64_t free_bytes = 0;       // in the free lists
  std::uint64_t free_ranges = 0;      // fragments in the free lists
  std::uint32_t files = 0;
};

class file_space {
 public:
  // Opens (or creates) the directory and checks it is safe to use. Creates no
  // file yet. Throws user_error naming the directory when it is a symlink,
  // owned by another user or holds a symlink or another user's file;
  // tierflow::error with the errno and the path, in one line naming the
  // directory, when it cannot be created (ENOENT: its parent is missing), is
  // not a directory (ENOTDIR) or cannot be written (EROFS, EACCES).
  explicit file_space(file_space_options options);
  ~file_space();
  file_space(const file_space&) = delete;
  file_space& operator=(const file_space&) = delete;

  // Reserves `length` bytes (rounded up to 4 KiB) in the lowest-addressed free
  // range that fits, preallocating a new file (fallocate) when none does.
  // Throws tierflow::error ENOSPC naming the directory when the disk (or the
  // capacity) is full; the extents already handed out are untouched.
  extent allocate(std::uint64_t length) TF_EXCLUDES(mutex_);
  // Returns an extent to the free list, merged with free neighbours, and drops
  // its checksum. Releasing what was not allocated is a bug (aborts).
  void release(const extent& e) TF_EXCLUDES(mutex_);

  // The file holding `e` (stable for the space's life).
  const file& file_of(const extent& e) const TF_EXCLUDES(mutex_);
  std::vector<const file*> files() const TF_EXCLUDES(mutex_);
  const std::string& directory() const noexcept { return options_.directory; }
  file_space_stats stats() const TF_EXCLUDES(mutex_);

  // Checksums (when enabled): record the checksum of what is written to `e`,
  // and verify what was read from it. verify() throws tierflow::error
  // (EBADMSG) naming the extent and its file on a mismatch; both do nothing
  // when checksums are off. Thread-safe.
  void record(const extent& e, std::span<const std::byte> written) TF_EXCLUDES(mutex_);
  void verify(const extent& e, std::span<const std::byte> read) const TF_EXCLUDES(mutex_);

  // Synchronous helpers through `eng`: write `data` (≤ e.length) to `e` and
  // record its checksum; read `e` into `into` and verify it.
  void write(engine& eng, const extent& e, std::span<const std::byte> data);
  void read(engine& eng, const extent& e, std::span<std::byte> into) const;

  // Keep the files when the space is destroyed (a checkpoint).
  void keep() noexcept { options_.keep = keep_files::yes; }

 private:
  struct space_file {
    std::unique_ptr<io::file> handle;
    std::string name;
    std::uint64_t size = 0;
    std::map<std::uint64_t, std::uint64_t> free;  // offset → length, disjoint, coalesced
    std::map<std::uint64_t, std::uint64_t> used;  // offset → reserved length
  };
  void check_directory();
  space_file& add_file(std::uint64_t size) TF_REQUIRES(mutex_);
  std::string describe(const extent& e) const TF_REQUIRES(mutex_);

  file_space_options options_;
  unique_fd directory_fd_;
  mutable mutex mutex_;
  std::vector<space_file> files_ TF_GUARDED_BY(mutex_);
  std::uint64_t file_bytes_ TF_GUARDED_BY(mutex_) = 0;
  std::uint32_t next_name_ TF_GUARDED_BY(mutex_) = 0;
  // Keyed by (file_index << 48 | offset >> 12): one entry per written extent.
  std::unordered_map<std::uint64_t, std::uint64_t> checksums_ TF_GUARDED_BY(mutex_);
};

}  // namespace tierflow::io
