#include "tierflow/io/file_space.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/io/checksum.hpp"
#include "tierflow/io/engine.hpp"

namespace tierflow::io {
namespace {

constexpr std::uint64_t alignment = 4096;

std::uint64_t round_up(std::uint64_t n) { return (n + alignment - 1) & ~(alignment - 1); }

std::uint64_t checksum_key(const extent& e) {
  return (static_cast<std::uint64_t>(e.file_index) << 48) | (e.offset / alignment);
}

std::string hex(std::uint64_t v) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%016" PRIx64, v);
  return text;
}

}  // namespace

file_space::file_space(file_space_options options) : options_(std::move(options)) {
  if (options_.directory.empty()) throw user_error("offload directory: empty path");
  if (options_.file_size == 0 || options_.file_size % alignment != 0) {
    throw user_error("offload file size " + std::to_string(options_.file_size) + ": not a positive multiple of 4096");
  }
  while (options_.directory.size() > 1 && options_.directory.back() == '/') options_.directory.pop_back();
  check_directory();
}

void file_space::check_directory() {
  const std::string& dir = options_.directory;
  const int flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
  int fd = ::open(dir.c_str(), flags);
  if (fd < 0 && errno == ENOENT) {
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
      // ENOENT: its parent is missing too; EACCES, EROFS: the parent cannot be written.
      const int err = errno;
      throw error(err, error_context{"mkdir"}.at(dir),
                  "offload directory " + dir + ": cannot be created (" + std::strerror(err) + ")");
    }
    fd = ::open(dir.c_str(), flags);
  }
  if (fd < 0) {
    const int err = errno;
    struct stat st {};
    if (::lstat(dir.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
      throw user_error("offload directory " + dir + ": is a symlink; refusing it");
    }
    if (err == ENOTDIR)
      throw error(err, error_context{"open"}.at(dir), "offload directory " + dir + ": not a directory");
    throw error(err, error_context{"open"}.at(dir), "offload directory " + dir + ": " + std::strerror(err));
  }
  directory_fd_ = unique_fd(fd);
  // Files are made in it only when the first extent is asked for: a directory
  // that cannot take them (read-only, not writable by this user; root is
  // refused by a read-only mount alone) is refused now, naming it.
  if (::faccessat(fd, ".", W_OK, AT_EACCESS) != 0) {
    const int err = errno;
    throw error(err, error_context{"access"}.at(dir),
                "offload directory " + dir + ": cannot be written (" + std::strerror(err) + ")");
  }

  struct stat st {};
  TF_CHECK_SYSCALL(::fstat(fd, &st), error_context{"fstat"}.at(dir));
  const uid_t me = ::geteuid();
  if (st.st_uid != me) {
    throw user_error("offload directory " + dir + ": owned by uid " + std::to_string(st.st_uid) +
                     ", not by this user (uid " + std::to_string(me) + "); refusing it");
  }
  // A directory we just made is 0700 already; one that existed keeps its mode
  // (e.g. a sticky scratch directory), but must hold nothing planted by others.
  DIR* listing = ::fdopendir(TF_CHECK_SYSCALL(::dup(fd), error_context{"dup"}.at(dir)));
  if (listing == nullptr) throw_errno(errno, error_context{"fdopendir"}.at(dir));
  std::string refusal;
  while (const dirent* entry = ::readdir(listing)) {
    const std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    struct stat child {};
    if (::fstatat(fd, name.c_str(), &child, AT_SYMLINK_NOFOLLOW) != 0) continue;  // gone meanwhile
    if (S_ISLNK(child.st_mode)) {
      refusal = "holds a symlink (" + name + ")";
      break;
    }
    if (child.st_uid != me) {
      refusal = "holds " + name + ", owned by uid " + std::to_string(child.st_uid);
      break;
    }
  }
  ::closedir(listing);
  if (!refusal.empty()) throw user_error("offload directory " + dir + ": " + refusal + "; refusing it");
}

file_space::~file_space() {
  lock_guard lock(mutex_);
  for (space_file& f : files_) {
    f.handle.reset();  // close before unlinking
    if (options_.keep == keep_files::no && ::unlinkat(directory_fd_.get(), f.name.c_str(), 0) != 0) {
      std::fprintf(stderr, "tierflow: removing %s/%s: %s\n", options_.directory.c_str(), f.name.c_str(),
                   std::strerror(errno));
    }
  }
}

file_space::space_file& file_space::add_file(std::uint64_t size) {
  const std::string& dir = options_.directory;
  if (options_.capacity != 0 && file_bytes_ + size > options_.capacity) {
    throw error(ENOSPC, error_context{"preallocate " + format_bytes(static_cast<double>(size)) +
                                      " beyond the capacity of " +
                                      format_bytes(static_cast<double>(options_.capacity)) + " in"}
                            .at(dir));
  }
  space_file f;
  for (int attempt = 0;; ++attempt) {
    f.name = "tierflow-" + std::to_string(::getpid()) + "-" + std::to_string(next_name_++) + ".nvme";
    open_options open{access::read_write, creation::exclusive, options_.direct, 0600, directory_fd_.get(),
                      dir + "/" + f.name};
    try {
      f.handle = std::make_unique<io::file>(io::file::open(f.name, open));
      break;
    } catch (const error& e) {
      // Another space (or process) using the same name: take the next one.
      if (e.errnum() != EEXIST || attempt > 1000) throw;
    }
  }
  // 0600 whatever the umask: only this user reads the training state.
  TF_CHECK_SYSCALL(::fchmod(f.handle->buffered_fd(), 0600), error_context{"fchmod"}.at(f.handle->path()));
  try {
    f.handle->allocate(0, size);
  } catch (const error& e) {
    // Leave nothing half-made behind; what other files hold is untouched.
    const std::string path = f.handle->path();
    f.handle.reset();
    ::unlinkat(directory_fd_.get(), f.name.c_str(), 0);
    throw error(e.errnum(), error_context{"preallocate " + format_bytes(static_cast<double>(size)) +
                                          " for offload in directory " + dir + ":"}
                                .at(path)
                                .range(0, size));
  }
  f.size = size;
  f.free.emplace(0, size);
  file_bytes_ += size;
  files_.push_back(std::move(f));
  return files_.back();
}

extent file_space::allocate(std::uint64_t length) {
  if (length == 0) throw user_error("extent of 0 bytes requested");
  const std::uint64_t need = round_up(length);
  lock_guard lock(mutex_);
  // The lambda runs only here, under `lock`; the analysis checks it as such.
  auto carve = [&](std::uint32_t index) TF_REQUIRES(mutex_) -> std::optional<extent> {
    space_file& f = files_[index];
    for (auto it = f.free.begin(); it != f.free.end(); ++it) {
      if (it->second < need) continue;
      const auto [offset, free_length] = *it;
      f.free.erase(it);
      if (free_length > need) f.free.emplace(offset + need, free_length - need);
      f.used.emplace(offset, need);
      return extent{index, offset, length};
    }
    return std::nullopt;
  };
  for (std::uint32_t i = 0; i < files_.size(); ++i) {
    if (auto e = carve(i)) return *e;
  }
  add_file(std::max(options_.file_size, need));
  auto e = carve(static_cast<std::uint32_t>(files_.size() - 1));
  TF_ASSERT(e.has_value(), "a fresh file could not hold the extent it was made for");
  return *e;
}

void file_space::release(const extent& e) {
  lock_guard lock(mutex_);
  TF_ASSERT(e.file_index < files_.size(), "releasing an extent of a file this space does not have");
  space_file& f = files_[e.file_index];
  auto used = f.used.find(e.offset);
  TF_ASSERT(used != f.used.end() && used->second == e.reserved(), "releasing an extent that is not allocated");
  f.used.erase(used);
  checksums_.erase(checksum_key(e));

  std::uint64_t offset = e.offset;
  std::uint64_t length = e.reserved();
  auto next = f.free.lower_bound(offset);
  if (next != f.free.begin()) {
    auto prev = std::prev(next);
    TF_ASSERT(prev->first + prev->second <= offset, "free list overlaps a released extent");
    if (prev->first + prev->second == offset) {  // coalesce with the range before
      offset = prev->first;
      length += prev->second;
      f.free.erase(prev);
    }
  }
  if (next != f.free.end()) {
    TF_ASSERT(offset + length <= next->first, "free list overlaps a released extent");
    if (offset + length == next->first) {  // and with the range after
      length += next->second;
      f.free.erase(next);
    }
  }
  f.free.emplace(offset, length);
}

const file& file_space::file_of(const extent& e) const {
  lock_guard lock(mutex_);
  TF_ASSERT(e.file_index < files_.size(), "extent of a file this space does not have");
  return *files_[e.file_index].handle;
}

std::vector<const file*> file_space::files() const {
  lock_guard lock(mutex_);
  std::vector<const file*> out;
  for (const space_file& f : files_) out.push_back(f.handle.get());
  return out;
}

file_space_stats file_space::stats() const {
  lock_guard lock(mutex_);
  file_space_stats s;
  s.files = static_cast<std::uint32_t>(files_.size());
  s.file_bytes = file_bytes_;
  for (const space_file& f : files_) {
    for (const auto& [offset, length] : f.used) s.allocated_bytes += length;
    for (const auto& [offset, length] : f.free) s.free_bytes += length;
    s.free_ranges += f.free.size();
  }
  return s;
}

std::string file_space::describe(const extent& e) const {
  return "extent " + std::to_string(e.file_index) + ":" + std::to_string(e.offset) + "+" + std::to_string(e.length);
}

void file_space::record(const extent& e, std::span<const std::byte> written) {
  if (options_.checksums == checksums::off) return;
  const std::uint64_t sum = checksum(written);
  lock_guard lock(mutex_);
  checksums_[checksum_key(e)] = sum;
}

void file_space::verify(const extent& e, std::span<const std::byte> read) const {
  if (options_.checksums == checksums::off) return;
  const std::uint64_t actual = checksum(read);
  lock_guard lock(mutex_);
  const auto it = checksums_.find(checksum_key(e));
  if (it == checksums_.end() || it->second == actual) return;  // nothing recorded, or intact
  error_context context{"checksum mismatch (expected " + hex(it->second) + ", read " + hex(actual) + ") reading"};
  context.at(files_[e.file_index].handle->path()).range(e.offset, e.length).of_block(describe(e));
  throw error(EBADMSG, std::move(context));
}

void file_space::write(engine& eng, const extent& e, std::span<const std::byte> data) {
  TF_ASSERT(data.size() <= e.length, "writing more than the extent holds");
  eng.write(file_of(e), e.offset, data);
  record(e, data);
}

void file_space::read(engine& eng, const extent& e, std::span<std::byte> into) const {
  TF_ASSERT(into.size() <= e.length, "reading more than the extent holds");
  eng.read(file_of(e), e.offset, into);
  verify(e, into);
}

}  // namespace tierflow::io
