// Shared by the store tests: a scratch directory, byte patterns, and a small
// store on real tiers (the device's host stand-in, pinned host memory, NVMe
// files in the scratch directory).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "tierflow/core/store.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace tierflow::test {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents.
class scratch_dir {
 public:
  scratch_dir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/tierflow-store-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~scratch_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Fills `bytes` with a pattern determined by `seed`.
inline void fill(std::span<std::byte> bytes, std::uint64_t seed) {
  std::uint64_t s = seed;
  std::size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    const std::uint64_t v = splitmix(s);
    std::memcpy(bytes.data() + i, &v, 8);
  }
  for (; i < bytes.size(); ++i) bytes[i] = std::byte(splitmix(s));
}

// Whether `bytes` hold fill(seed)'s pattern.
inline bool holds(std::span<const std::byte> bytes, std::uint64_t seed) {
  std::uint64_t s = seed;
  std::size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    const std::uint64_t v = splitmix(s);
    if (std::memcmp(bytes.data() + i, &v, 8) != 0) return false;
  }
  for (; i < bytes.size(); ++i)
    if (bytes[i] != std::byte(splitmix(s))) return false;
  return true;
}

struct small_store_sizes {
  std::uint64_t device = 1u << 20;
  std::uint64_t host = 1u << 20;
  std::uint64_t nvme = 64u << 20;
  bool checksums = true;
};

// A block of `bytes` named `name` with its home in `home`.
inline block_id make(block_store& s, const std::string& name, std::uint64_t bytes, tier_kind home) {
  return s.create_block(block_desc{.name = name, .size_bytes = bytes, .home = home});
}

// Writes fill(seed)'s pattern into the block's copy in `where`, marked dirty.
inline void write(block_store& s, block_id id, tier_kind where, std::uint64_t seed) {
  lease l = s.acquire(id, where, access::write);
  fill(l.wait(), seed);
  s.release(std::move(l), dirty::yes);
}

// Whether the block's copy in `where` (loaded if need be) holds fill(seed)'s pattern.
inline bool reads(block_store& s, block_id id, tier_kind where, std::uint64_t seed) {
  lease l = s.acquire(id, where);
  const bool ok = holds(l.wait(), seed);
  s.release(std::move(l), dirty::no);
  return ok;
}

// A store on the device stand-in, pinned host memory and NVMe files.
inline tiers::store_config small_store_config(const scratch_dir& dir, small_store_sizes sizes = {}) {
  tiers::store_config c;
  c.device = tiers::device_tier_options{.budget = sizes.device,
                                        .backend = tiers::device_backend::stand_in};
  c.host = tiers::host_tier_options{.budget = sizes.host, .pre_touch = true, .touch_threads = 2};
  c.nvme = tiers::nvme_tier_options{.directory = dir.sub("nvme"),
                                    .budget = sizes.nvme,
                                    .file_size = 16u << 20,
                                    .checksums = sizes.checksums};
  c.nvme->io.threads = 1;
  c.nvme->io.queue_depth = 8;
  c.nvme->io.block_size = 64u << 10;
  c.staging_chunk = 64u << 10;
  c.device_link_engines = 2;
  c.nvme_link_engines = 2;
  return c;
}

}  // namespace tierflow::test
