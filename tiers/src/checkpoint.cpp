#include "tierflow/tiers/checkpoint.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/io/aligned_buffer.hpp"
#include "tierflow/io/engine.hpp"
#include "tierflow/io/file.hpp"

namespace tierflow::tiers {
namespace {

constexpr const char* manifest_name = "manifest.json";
constexpr std::size_t verify_chunk = 8u << 20;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// What a save or a restore of manifest `m` reports, timed from `start`.
checkpoint_stats stats_of(const checkpoint_manifest& m, std::chrono::steady_clock::time_point start) {
  checkpoint_stats out;
  out.generation = m.generation;
  out.blocks = m.blocks.size();
  out.bytes = m.data_bytes;
  out.seconds = seconds_since(start);
  return out;
}

std::string hex(std::uint64_t v) {
  char text[24];
  std::snprintf(text, sizeof text, "%016" PRIx64, v);
  return text;
}

// Makes a rename or a new name in `directory` durable.
void sync_directory(const std::string& directory) {
  io::unique_fd fd(TF_CHECK_SYSCALL(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC),
                                    error_context{"open"}.at(directory)));
  TF_CHECK_SYSCALL(::fsync(fd.get()), error_context{"fsync"}.at(directory));
}

void rename_durably(const std::string& directory, const std::string& from, const std::string& to) {
  TF_CHECK_SYSCALL(::rename((directory + "/" + from).c_str(), (directory + "/" + to).c_str()),
                   error_context{"rename"}.at(directory + "/" + from));
  sync_directory(directory);
}

std::vector<std::string> list(const std::string& directory) {
  std::vector<std::string> names;
  DIR* d = ::opendir(directory.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

void remove_if_present(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) throw_errno(errno, error_context{"unlink"}.at(path));
}

// manifest.json: the manifest's JSON, then one line "xxh3 <hex>" of the JSON.
std::string manifest_text(const checkpoint_manifest& m) {
  const std::string body = to_json(m);
  return body + "\nxxh3 " + hex(XXH3_64bits(body.data(), body.size())) + "\n";
}

checkpoint_manifest read_manifest(const std::string& directory) {
  const std::string path = directory + "/" + manifest_name;
  io::unique_fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) {
    if (errno == ENOENT) throw checkpoint_error(directory, "", "no checkpoint here (no manifest.json)");
    throw_errno(errno, error_context{"open"}.at(path));
  }
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, error_context{"read"}.at(path));
    }
    if (n == 0) break;
    text.append(buf, std::size_t(n));
  }
  const std::size_t trailer = text.rfind("\nxxh3 ");
  if (trailer == std::string::npos || text.size() < trailer + 6 + 16)
    throw checkpoint_error(directory, "", "corrupt or truncated manifest (no checksum line)");
  const std::string body = text.substr(0, trailer);
  const std::string written = text.substr(trailer + 6, 16);
  if (written != hex(XXH3_64bits(body.data(), body.size())))
    throw checkpoint_error(directory, "", "corrupt manifest (its checksum does not match)");
  return parse_manifest(body, directory);
}

// Reads every block of `m` from its data file and checks its checksum.
void verify_data(const std::string& directory, const checkpoint_manifest& m, io::engine& engine) {
  const std::string path = directory + "/" + m.data_file;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw checkpoint_error(directory, "", "its data file " + m.data_file + " is missing");
  if (std::uint64_t(st.st_size) < m.data_bytes)
    throw checkpoint_error(directory, "", "data file " + m.data_file + " is truncated (" +
                                              std::to_string(st.st_size) + " of " +
                                              std::to_string(m.data_bytes) + " bytes)");
  io::file f = io::file::open(path, {.access = io::access::read_only});
  io::aligned_buffer buffer(verify_chunk);
  for (const manifest_block& b : m.blocks) {
    XXH3_state_t* state = XXH3_createState();
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> owned(state, &XXH3_freeState);
    XXH3_64bits_reset(state);
    for (std::uint64_t done = 0; done < b.size_bytes;) {
      const std::size_t n = std::size_t(std::min<std::uint64_t>(verify_chunk, b.size_bytes - done));
      engine.read(f, b.offset + done, {buffer.data(), n});
      XXH3_64bits_update(state, buffer.data(), n);
      done += n;
    }
    if (XXH3_64bits_digest(state) != b.checksum)
      throw checkpoint_error(directory, b.name, "checksum mismatch (corrupt data file " + m.data_file + ")");
  }
}

}  // namespace

checkpoint_stats write_checkpoint(block_store& store, const std::string& directory) {
  const auto start = std::chrono::steady_clock::now();
  if (!store.has_tier(tier_kind::host))
    throw user_error("checkpoint: the store has no host tier to read blocks through");
  if (::mkdir(directory.c_str(), 0700) != 0 && errno != EEXIST)
    throw_errno(errno, error_context{"mkdir"}.at(directory));

  std::uint64_t previous = 0;
  std::string previous_data;
  bool readable = true;
  try {
    const checkpoint_manifest old = read_manifest(directory);
    previous = old.generation;
    previous_data = old.data_file;
  } catch (const checkpoint_error&) {
    // No usable checkpoint yet: this one starts the sequence afresh.
    readable = ::access((directory + "/" + manifest_name).c_str(), F_OK) != 0;
  }
  // Leftovers of a writer that died: temporary files, and data files no
  // manifest names (none removed while an unreadable manifest is there:
  // what it named is left for a person to look at).
  for (const std::string& n : list(directory)) {
    const bool temporary = n.ends_with(".tmp");
    const bool orphan = readable && n.starts_with("blocks-") && n.ends_with(".bin") && n != previous_data;
    if (temporary || orphan) remove_if_present(directory + "/" + n);
  }

  checkpoint_manifest m = describe_store(store);
  m.generation = previous + 1;
  m.data_file = "blocks-" + std::to_string(m.generation) + ".bin";
  const std::string data_tmp = m.data_file + ".tmp";
  auto engine = io::make_engine({});
  {
    io::file f = io::file::open(directory + "/" + data_tmp,
                                {.creation = io::creation::exclusive, .mode = 0600});
    for (manifest_block& b : m.blocks) {
      lease l = store.acquire(block_id{b.id}, tier_kind::host, access::read);
      const std::span<std::byte> bytes = l.wait();
      b.checksum = XXH3_64bits(bytes.data(), bytes.size());
      // A copy's storage is whole pages (block_alignment): write them all so
      // the request stays aligned for O_DIRECT.
      engine->write(f, b.offset, {bytes.data(), std::size_t(aligned_size(b.size_bytes))});
      store.release(std::move(l), dirty::no);
    }
    if (f.size() < m.data_bytes) f.truncate(m.data_bytes);
    f.sync();
  }
  rename_durably(directory, data_tmp, m.data_file);

  // The commit point: the rename of the manifest.
  const std::string manifest_tmp = std::string(manifest_name) + ".tmp";
  {
    const std::string path = directory + "/" + manifest_tmp;
    io::unique_fd fd(TF_CHECK_SYSCALL(
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600),
        error_context{"open"}.at(path)));
    const std::string text = manifest_text(m);
    for (std::size_t done = 0; done < text.size();) {
      const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw_errno(errno, error_context{"write"}.at(path));
      done += std::size_t(n);
    }
    TF_CHECK_SYSCALL(::fsync(fd.get()), error_context{"fsync"}.at(path));
  }
  rename_durably(directory, manifest_tmp, manifest_name);

  if (!previous_data.empty() && previous_data != m.data_file) {
    remove_if_present(directory + "/" + previous_data);
    sync_directory(directory);
  }
  return stats_of(m, start);
}

checkpoint_manifest read_checkpoint_manifest(const std::string& directory) { return read_manifest(directory); }

checkpoint_manifest verify_checkpoint(const std::string& directory) {
  checkpoint_manifest m = read_manifest(directory);
  auto engine = io::make_engine({});
  verify_data(directory, m, *engine);
  return m;
}

checkpoint_stats restore_checkpoint(block_store& store, const std::string& directory) {
  const auto start = std::chrono::steady_clock::now();
  if (!store.has_tier(tier_kind::host))
    throw user_error("restore: the store has no host tier to write blocks through");
  const checkpoint_manifest m = read_manifest(directory);
  auto engine = io::make_engine({});
  verify_data(directory, m, *engine);
  if (store.block_count() == 0) {
    for (const manifest_block& b : m.blocks) {
      store.create_block(block_desc{.name = b.name, .size_bytes = b.size_bytes, .type = b.type,
                                    .shape = b.shape, .home = b.home});
    }
  }
  check_matches(m, store, directory);

  io::file f = io::file::open(directory + "/" + m.data_file, {.access = io::access::read_only});
  for (const manifest_block& b : m.blocks) {
    lease l = store.acquire(block_id{b.id}, tier_kind::host, access::overwrite);
    const std::span<std::byte> bytes = l.wait();
    engine->read(f, b.offset, {bytes.data(), std::size_t(aligned_size(b.size_bytes))});
    // Checked again: the file could have changed since verify_data read it.
    if (XXH3_64bits(bytes.data(), bytes.size()) != b.checksum) {
      store.release(std::move(l), dirty::no);
      throw checkpoint_error(directory, b.name, "checksum mismatch (the data file changed during restore)");
    }
    store.release(std::move(l), dirty::yes);
  }
  return stats_of(m, start);
}

}  // namespace tierflow::tiers
