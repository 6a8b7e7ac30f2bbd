// The movers, and the staged device<->NVMe path as a template over how bytes
// cross between pinned host memory and the device (the hot loop: no virtual
// call per chunk).
#pragma once

#include <xxhash.h>

#include <algorithm>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "tier_impl.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/link.hpp"
#include "tierflow/tiers/host_memory.hpp"

namespace tierflow::tiers::detail {

std::unique_ptr<tier> make_device_stand_in(const device_tier_options& options);
// The CUDA tier (only in CUDA builds; throws user_error elsewhere).
std::unique_ptr<tier> make_cuda_device_tier(const device_tier_options& options);
// For a CUDA device tier, its device index; -1 for any other tier.
int cuda_device_of(const tier& t) noexcept;

std::unique_ptr<mover> make_memcpy_mover();
std::unique_ptr<mover> make_nvme_mover(nvme_tier& nvme, bool to_nvme);
std::unique_ptr<mover> make_cuda_copy_mover(int device, bool to_device);
std::unique_ptr<mover> make_staged_mover(tier& device, nvme_tier& nvme, bool to_nvme,
                                         const mover_options& options);

// Rethrows the current tierflow::error with the block (and tier) named.
[[noreturn]] void rethrow_naming(std::string_view block, std::string_view tier_name);

// How a staged move crosses the host/device boundary: asynchronous copies
// tagged with a buffer slot, and a wait for the last copy of a slot.
template <typename C>
concept device_copier = requires(C c, std::byte* d, const std::byte* s, std::size_t n, unsigned slot) {
  c.to_device(d, s, n, slot);
  c.to_host(d, s, n, slot);
  c.wait(slot);
  { c.name() } -> std::convertible_to<std::string>;
};

// The host stand-in: the device is host memory, a copy is memcpy and done at once.
struct memcpy_copier {
  void to_device(std::byte* d, const std::byte* s, std::size_t n, unsigned) { std::memcpy(d, s, n); }
  void to_host(std::byte* d, const std::byte* s, std::size_t n, unsigned) { std::memcpy(d, s, n); }
  void wait(unsigned) {}
  std::string name() const { return "memcpy"; }
};

// Device <-> NVMe through pinned bounce buffers: each engine owns two chunk
// buffers; while one is being copied across (copier), the other is being read
// from or written to the file (io engine), so the two links of the path
// overlap. Every chunk's bytes go into a running XXH3 when checksums are on.
template <device_copier Copier>
class staged_mover final : public mover {
 public:
  staged_mover(Copier copier, nvme_tier& nvme, bool to_nvme, const mover_options& options,
               host_region bounce)
      : copier_(std::move(copier)),
        nvme_(nvme),
        to_nvme_(to_nvme),
        chunk_(options.staging_chunk),
        bounce_(std::move(bounce)) {
    const unsigned engines = std::max(1u, options.engines);
    for (unsigned e = 0; e < engines; ++e) free_pairs_.push_back(e);
  }

  std::string engine() const override {
    return "staged via pinned bounce buffers (" + copier_.name() + " + " +
           nvme_.engine().describe() + ")";
  }

  void move(const transfer& t) override {
    const unsigned pair = take_pair();
    struct give_back {
      staged_mover* self;
      unsigned pair;
      ~give_back() { self->return_pair(pair); }
    } guard{this, pair};
    try {
      if (to_nvme_)
        device_to_nvme(t, pair);
      else
        nvme_to_device(t, pair);
    } catch (const tierflow::error&) {
      rethrow_naming(t.block_name, to_nvme_ ? "nvme" : "device");
    }
  }

 private:
  std::byte* buffer(unsigned pair, unsigned k) const {
    return bounce_.data() + (std::uint64_t(pair) * 2 + k) * chunk_;
  }
  static unsigned slot(unsigned pair, unsigned k) { return pair * 2 + k; }

  // A running XXH3 over a transfer's chunks, or null when the tier keeps no checksums.
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> checksum_state() const {
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(nullptr, &XXH3_freeState);
    if (nvme_.checksums()) {
      state.reset(XXH3_createState());
      if (!state) throw error(ENOMEM, error_context{"XXH3_createState"});
      XXH3_64bits_reset(state.get());
    }
    return state;
  }

  void nvme_to_device(const transfer& t, unsigned pair) {
    const io::file& f = nvme_.file_of(t.source);
    const auto owned = checksum_state();
    XXH3_state_t* state = owned.get();
    const std::uint64_t chunks = (t.bytes + chunk_ - 1) / chunk_;
    for (std::uint64_t i = 0; i < chunks; ++i) {
      const unsigned k = unsigned(i % 2);
      const std::uint64_t offset = i * chunk_;
      const std::size_t length = std::size_t(std::min<std::uint64_t>(chunk_, t.bytes - offset));
      // The copy of chunk i - 2 read this buffer: it must be done before we refill it.
      if (i >= 2) copier_.wait(slot(pair, k));
      std::byte* buf = buffer(pair, k);
      nvme_.engine().read(f, t.source.offset + offset, {buf, length});
      if (state) XXH3_64bits_update(state, buf, length);
      copier_.to_device(t.destination.data + offset, buf, length, slot(pair, k));
    }
    copier_.wait(slot(pair, 0));
    copier_.wait(slot(pair, 1));
    if (state) nvme_.verify_checksum(t.source, XXH3_64bits_digest(state), t.block_name);
  }

  void device_to_nvme(const transfer& t, unsigned pair) {
    const io::file& f = nvme_.file_of(t.destination);
    const auto owned = checksum_state();
    XXH3_state_t* state = owned.get();
    const std::uint64_t chunks = (t.bytes + chunk_ - 1) / chunk_;
    auto length_of = [&](std::uint64_t i) {
      return std::size_t(std::min<std::uint64_t>(chunk_, t.bytes - i * chunk_));
    };
    copier_.to_host(buffer(pair, 0), t.source.data, length_of(0), slot(pair, 0));
    for (std::uint64_t i = 0; i < chunks; ++i) {
      const unsigned k = unsigned(i % 2);
      // Start the next chunk's copy first: its buffer's last write (chunk
      // i - 1) has finished, since file writes here are synchronous.
      if (i + 1 < chunks)
        copier_.to_host(buffer(pair, 1 - k), t.source.data + (i + 1) * chunk_, length_of(i + 1),
                        slot(pair, 1 - k));
      copier_.wait(slot(pair, k));
      const std::byte* buf = buffer(pair, k);
      if (state) XXH3_64bits_update(state, buf, length_of(i));
      nvme_.engine().write(f, t.destination.offset + i * chunk_, {buf, length_of(i)});
    }
    if (state) nvme_.record_checksum(t.destination, XXH3_64bits_digest(state));
  }

  unsigned take_pair() {
    unique_lock lock(pairs_mutex_);
    while (free_pairs_.empty()) lock.wait(pairs_cv_);
    const unsigned pair = free_pairs_.back();
    free_pairs_.pop_back();
    return pair;
  }
  void return_pair(unsigned pair) {
    {
      lock_guard lock(pairs_mutex_);
      free_pairs_.push_back(pair);
    }
    pairs_cv_.notify_one();
  }

  Copier copier_;
  nvme_tier& nvme_;
  const bool to_nvme_;
  const std::uint64_t chunk_;
  host_region bounce_;
  mutex pairs_mutex_;
  std::condition_variable pairs_cv_;
  std::vector<unsigned> free_pairs_ TF_GUARDED_BY(pairs_mutex_);
};

}  // namespace tierflow::tiers::detail
