#include <xxhash.h>

#include <cstring>

#include "detail/movers.hpp"

namespace tierflow::tiers {

namespace detail {

void rethrow_naming(std::string_view block, std::string_view tier_name) {
  try {
    throw;
  } catch (const tierflow::error& e) {
    error_context context = e.context();
    if (!context.block.empty()) throw;  // already named
    context.block = std::string(block);
    if (context.tier.empty()) context.tier = std::string(tier_name);
    throw tierflow::error(e.code(), std::move(context));
  }
}

namespace {

// Host memory to host memory (host <-> the device's host stand-in).
class memcpy_mover final : public mover {
 public:
  std::string engine() const override { return "memcpy"; }
  void move(const transfer& t) override {
    std::memcpy(t.destination.data, t.source.data, t.bytes);
  }
};

// Host memory <-> NVMe through the tier's io engine (which splits each block
// into chunks and keeps queue_depth of them in flight).
class nvme_mover final : public mover {
 public:
  nvme_mover(nvme_tier& nvme, bool to_nvme) : nvme_(nvme), to_nvme_(to_nvme) {}

  std::string engine() const override { return nvme_.engine().describe(); }

  void move(const transfer& t) override {
    try {
      if (to_nvme_) {
        const std::span<const std::byte> from(t.source.data, t.bytes);
        nvme_.engine().write(nvme_.file_of(t.destination), t.destination.offset, from);
        if (nvme_.checksums()) nvme_.record_checksum(t.destination, XXH3_64bits(from.data(), from.size()));
      } else {
        const std::span<std::byte> into(t.destination.data, t.bytes);
        nvme_.engine().read(nvme_.file_of(t.source), t.source.offset, into);
        if (nvme_.checksums())
          nvme_.verify_checksum(t.source, XXH3_64bits(into.data(), into.size()), t.block_name);
      }
    } catch (const tierflow::error&) {
      rethrow_naming(t.block_name, "nvme");
    }
  }

 private:
  nvme_tier& nvme_;
  const bool to_nvme_;
};

}  // namespace

std::unique_ptr<mover> make_memcpy_mover() { return std::make_unique<memcpy_mover>(); }

std::unique_ptr<mover> make_nvme_mover(nvme_tier& nvme, bool to_nvme) {
  return std::make_unique<nvme_mover>(nvme, to_nvme);
}

}  // namespace detail

std::unique_ptr<mover> make_mover(tier& from, tier& to, const mover_options& options) {
  auto* from_nvme = dynamic_cast<detail::nvme_tier*>(&from);
  auto* to_nvme = dynamic_cast<detail::nvme_tier*>(&to);
  const bool from_memory = dynamic_cast<detail::memory_tier*>(&from) != nullptr;
  const bool to_memory = dynamic_cast<detail::memory_tier*>(&to) != nullptr;
  const bool from_cuda = detail::cuda_device_of(from) >= 0;
  const bool to_cuda = detail::cuda_device_of(to) >= 0;
  const std::string label = std::string(name(from.kind())) + "->" + std::string(name(to.kind()));
  if (!(from_nvme || from_memory || from_cuda) || !(to_nvme || to_memory || to_cuda))
    throw user_error("mover " + label + ": a tier not made by tierflow::tiers");
  if (from_nvme && to_nvme) throw user_error("mover " + label + ": nvme to nvme is not a link");

  // Host memory on both sides (host tier, or the device's stand-in).
  if (from_memory && to_memory) return detail::make_memcpy_mover();
  // Host <-> CUDA device: the copy engines.
  if (from_memory && to_cuda) return detail::make_cuda_copy_mover(detail::cuda_device_of(to), true);
  if (from_cuda && to_memory) return detail::make_cuda_copy_mover(detail::cuda_device_of(from), false);
  // Device (real or stand-in) <-> NVMe: staged through pinned bounce buffers.
  if (to_nvme && from.kind() == tier_kind::device) return detail::make_staged_mover(from, *to_nvme, true, options);
  if (from_nvme && to.kind() == tier_kind::device) return detail::make_staged_mover(to, *from_nvme, false, options);
  // Host <-> NVMe: the io engine straight into the pinned pool.
  if (to_nvme) return detail::make_nvme_mover(*to_nvme, true);
  if (from_nvme) return detail::make_nvme_mover(*from_nvme, false);
  throw user_error("mover " + label + ": no mover joins these tiers");
}

std::unique_ptr<block_store> make_store(store_config config) {
  std::vector<std::unique_ptr<tier>> made;
  if (config.device) made.push_back(make_device_tier(*config.device));
  if (config.host) made.push_back(make_host_tier(*config.host));
  if (config.nvme) made.push_back(make_nvme_tier(*config.nvme));
  if (made.empty()) throw user_error("store: no tier configured");

  std::vector<link_spec> links;
  for (auto& a : made) {
    for (auto& b : made) {
      if (a == b) continue;
      const bool nvme_link = a->kind() == tier_kind::nvme || b->kind() == tier_kind::nvme;
      mover_options m;
      m.staging_chunk = config.staging_chunk;
      m.engines = nvme_link ? config.nvme_link_engines : config.device_link_engines;
      links.push_back(link_spec{a->kind(), b->kind(), make_mover(*a, *b, m), m.engines});
    }
  }
  return std::make_unique<block_store>(std::move(made), std::move(links), std::move(config.store));
}

}  // namespace tierflow::tiers
