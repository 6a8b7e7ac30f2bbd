#include "tierflow/io/file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <xxh3.h>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/io/aligned_buffer.hpp"
#include "tierflow/io/checksum.hpp"

namespace tierflow::io {

static_assert(AT_FDCWD == -100, "open_options::directory_fd defaults to AT_FDCWD");

// ---- unique_fd --------------------------------------------------------------

unique_fd::unique_fd(unique_fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

unique_fd& unique_fd::operator=(unique_fd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

unique_fd::~unique_fd() { reset(); }

int unique_fd::release() noexcept { return std::exchange(fd_, -1); }

void unique_fd::reset() noexcept {
  if (fd_ >= 0) {
    // close() releases the descriptor even when it reports an error (EINTR
    // included, on Linux): never retry it, only say so.
    if (::close(fd_) != 0) std::fprintf(stderr, "tierflow: close(%d): %s\n", fd_, std::strerror(errno));
    fd_ = -1;
  }
}

// ---- file -------------------------------------------------------------------

file file::open(const std::string& path, const open_options& options) {
  int flags = O_CLOEXEC | O_NOFOLLOW;
  flags |= options.access == access::read_write ? O_RDWR : O_RDONLY;
  if (options.creation == creation::if_missing) flags |= O_CREAT;
  if (options.creation == creation::exclusive) flags |= O_CREAT | O_EXCL;

  file f;
  f.path_ = options.display_path.empty() ? path : options.display_path;
  f.writable_ = options.access == access::read_write;
  f.buffered_ = unique_fd(TF_CHECK_SYSCALL(::openat(options.directory_fd, path.c_str(), flags, options.mode),
                                           error_context{"open"}.at(f.path_)));
  if (options.direct != direct_io::off) {
    // The second descriptor never creates: the first one did.
    const int direct_flags = (flags & ~(O_CREAT | O_EXCL)) | O_DIRECT;
    const int fd = ::openat(options.directory_fd, path.c_str(), direct_flags);
    if (fd >= 0) {
      f.direct_ = unique_fd(fd);
    } else if (options.direct == direct_io::require || errno != EINVAL) {
      throw_errno(errno, error_context{"open (O_DIRECT)"}.at(f.path_));
    }
  }
#if defined(STATX_DIOALIGN)
  if (f.direct_) {
    struct statx sx {};
    if (::statx(f.direct_.get(), "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
        (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_mem_align != 0) {
      f.memory_alignment_ = sx.stx_dio_mem_align;
    }
  }
#endif
  return f;
}

file::file(file&& other) noexcept
    : path_(std::move(other.path_)),
      direct_(std::move(other.direct_)),
      buffered_(std::move(other.buffered_)),
      writable_(other.writable_),
      memory_alignment_(other.memory_alignment_) {
  TF_ASSERT(other.registered_by_.load() == nullptr, "moving a file registered with an engine");
}

file& file::operator=(file&& other) noexcept {
  TF_ASSERT(registered_by_.load() == nullptr && other.registered_by_.load() == nullptr,
            "moving a file registered with an engine");
  path_ = std::move(other.path_);
  direct_ = std::move(other.direct_);
  buffered_ = std::move(other.buffered_);
  writable_ = other.writable_;
  memory_alignment_ = other.memory_alignment_;
  return *this;
}

file::~file() {
  TF_ASSERT(registered_by_.load() == nullptr, "closing a file still registered with an engine");
}

std::uint64_t file::size() const {
  struct stat st {};
  TF_CHECK_SYSCALL(::fstat(buffered_.get(), &st), error_context{"fstat"}.at(path_));
  return static_cast<std::uint64_t>(st.st_size);
}

void file::truncate(std::uint64_t size) {
  TF_CHECK_SYSCALL(::ftruncate(buffered_.get(), static_cast<off_t>(size)),
                   error_context{"ftruncate"}.at(path_).range(size, 0));
}

void file::allocate(std::uint64_t offset, std::uint64_t length) {
  int rc;
  do {
    rc = ::fallocate(buffered_.get(), 0, static_cast<off_t>(offset), static_cast<off_t>(length));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) throw_errno(errno, error_context{"fallocate"}.at(path_).range(offset, length));
}

void file::sync() {
  int rc;
  do {
    rc = ::fdatasync(buffered_.get());
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) throw_errno(errno, error_context{"fdatasync"}.at(path_));
}

// ---- aligned_buffer -----------------------------------------------------------

aligned_buffer::aligned_buffer(std::size_t size, std::size_t alignment) : size_(size) {
  // A buffer of a huge page or more gets whole transparent huge pages: a
  // 1 MiB request in scattered 4 KiB pages is 256 segments, which the block
  // layer splits and a virtio disk without indirect descriptors fits one of at
  // a time; in one huge page it is a single segment.
  const bool huge = size >= huge_page_size;
  if (huge && alignment < huge_page_size) alignment = huge_page_size;
  void* p = nullptr;
  const std::size_t rounded = (size + alignment - 1) / alignment * alignment;
  if (const int rc = ::posix_memalign(&p, alignment, rounded == 0 ? alignment : rounded); rc != 0) {
    throw_errno(rc, error_context{"posix_memalign"}.range(0, size));
  }
  // Before the first touch, so the memset faults in huge pages. Advice only:
  // where THP is off or not built the buffer keeps small pages.
  if (huge) (void)::madvise(p, rounded, MADV_HUGEPAGE);
  std::memset(p, 0, rounded == 0 ? alignment : rounded);
  data_ = static_cast<std::byte*>(p);
}

aligned_buffer::aligned_buffer(aligned_buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

aligned_buffer& aligned_buffer::operator=(aligned_buffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

aligned_buffer::~aligned_buffer() { std::free(data_); }

// ---- checksum -----------------------------------------------------------------

std::uint64_t checksum(std::span<const std::byte> bytes) noexcept {
  return XXH3_64bits(bytes.data(), bytes.size());
}

}  // namespace tierflow::io
