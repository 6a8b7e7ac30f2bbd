// The concrete tiers and the movers between them, and the usual assembly of
// a block store from them.
//
//   auto store = tiers::make_store({
//       .device = tiers::device_tier_options{.budget = 8_GiB},
//       .host = tiers::host_tier_options{.budget = 32_GiB},
//       .nvme = tiers::nvme_tier_options{.directory = "/nvme/tf", .budget = 1_TiB}});
//   block_id w = store->create_block({.name = "l0.w", .size_bytes = n, .home = tier_kind::nvme});
//   lease l = store->acquire(w, tier_kind::device);
//   use(l.wait());
//   store->release(std::move(l), dirty::no);
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "tierflow/core/link.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/core/tier.hpp"
#include "tierflow/io/engine.hpp"
#include "tierflow/tiers/host_memory.hpp"

namespace tierflow::tiers {

// Pinned host memory: one region of exactly `budget` bytes (see host_memory.hpp)
// from which blocks are carved; the budget is the region.
struct host_tier_options {
  std::uint64_t budget = 0;
  huge_pages pages = huge_pages::transparent;
  int numa_node = -1;  // -1: nearest the GPU when known
  pinning pin = pinning::automatic;
  bool pre_touch = true;
  unsigned touch_threads = 0;  // 0: one per CPU
  int cuda_device = 0;
};

// Builds the host tier. Throws as host_region::map does.
std::unique_ptr<tier> make_host_tier(const host_tier_options& options);

enum class device_backend : unsigned char {
  automatic,  // cuda when a device is present, else the host stand-in
  cuda,       // a CUDA stream-ordered pool (cudaMallocAsync); an error without a device
  stand_in,   // plain host memory with the device's budget, so everything above runs
};

struct device_tier_options {
  std::uint64_t budget = 0;
  device_backend backend = device_backend::automatic;
  int cuda_device = 0;
};

// Builds the device tier. Throws user_error when backend is cuda and this
// build or machine has no CUDA device.
std::unique_ptr<tier> make_device_tier(const device_tier_options& options);

// NVMe: extents of preallocated files in one directory (io::file_space),
// read and written through an io::engine.
struct nvme_tier_options {
  std::string directory;
  std::uint64_t budget = 0;                 // bytes of extents at most
  std::uint64_t file_size = 256ull << 20;   // each preallocated file
  bool checksums = false;                   // XXH3 each block written; verify on every read
  io::engine_config io{};                   // the engine moving its bytes
};

// Builds the NVMe tier. Throws user_error for an unusable directory.
std::unique_ptr<tier> make_nvme_tier(const nvme_tier_options& options);

struct mover_options {
  // Device<->NVMe moves go through pinned bounce buffers in chunks of this
  // size, two per engine (one filling while the other drains).
  std::uint64_t staging_chunk = 4ull << 20;
  unsigned engines = 2;  // transfers at once on the link (bounce buffers are per engine)
};

// The mover for blocks going `from` -> `to`, both made by this module:
//   host <-> device (stand-in): memcpy;  host <-> device (cuda): cudaMemcpyAsync
//   on a dedicated H2D or D2H stream, completion by event;  host <-> nvme: the
//   tier's io::engine;  device <-> nvme: staged through pinned bounce buffers,
//   chunked and double-buffered. Throws user_error for tiers not made here.
std::unique_ptr<mover> make_mover(tier& from, tier& to, const mover_options& options = {});

// A store over the tiers that are given, with a link each way between every
// pair (so any tier can load from any other).
struct store_config {
  std::optional<device_tier_options> device;
  std::optional<host_tier_options> host;
  std::optional<nvme_tier_options> nvme;
  unsigned device_link_engines = 2;  // per direction, host<->device
  unsigned nvme_link_engines = 4;    // per direction, host<->nvme and device<->nvme
  std::uint64_t staging_chunk = 4ull << 20;
  store_options store{};
};

std::unique_ptr<block_store> make_store(store_config config);

}  // namespace tierflow::tiers
