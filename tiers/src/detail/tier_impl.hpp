// The concrete tiers, seen by the movers and the factory (not by users).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "tierflow/core/thread_annotations.hpp"
#include "tierflow/core/tier.hpp"
#include "tierflow/io/engine.hpp"
#include "tierflow/io/file_space.hpp"
#include "tierflow/tiers/host_memory.hpp"
#include "tierflow/tiers/range_pool.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace tierflow::tiers::detail {

// Host memory (pinned, or the device's host stand-in): one region and a pool
// carving blocks out of it.
class memory_tier final : public tier {
 public:
  // The budget is `budget` bytes (<= the region's size: a hugetlb region is
  // rounded up to 2 MiB, the budget is not).
  memory_tier(tier_kind kind, std::string label, host_region region, std::uint64_t budget);

  tier_kind kind() const noexcept override { return kind_; }
  std::string name() const override { return label_; }
  memory_kind memory() const noexcept override { return memory_kind::host; }
  std::uint64_t budget() const noexcept override { return budget_.budget(); }
  std::uint64_t used() const override { return budget_.used(); }
  std::uint64_t high_water() const override { return budget_.high_water(); }
  bool can_allocate(std::uint64_t bytes) const override TF_EXCLUDES(mutex_);
  tier_allocation allocate(std::uint64_t bytes, std::string_view block) override TF_EXCLUDES(mutex_);
  std::optional<std::uint64_t> largest_free() const override TF_EXCLUDES(mutex_);
  void deallocate(const tier_allocation& allocation) noexcept override TF_EXCLUDES(mutex_);
  std::map<std::string, std::string> details() const override;

  const host_region& region() const noexcept { return region_; }
  bool stand_in() const noexcept { return kind_ == tier_kind::device; }

 private:
  const tier_kind kind_;
  const std::string label_;
  host_region region_;
  tier_budget budget_;
  mutable mutex mutex_;
  range_pool pool_ TF_GUARDED_BY(mutex_);
};

// NVMe: extents of io::file_space files, moved by one io::engine.
class nvme_tier final : public tier {
 public:
  explicit nvme_tier(const nvme_tier_options& options);
  ~nvme_tier() override;

  tier_kind kind() const noexcept override { return tier_kind::nvme; }
  std::string name() const override;
  memory_kind memory() const noexcept override { return memory_kind::file; }
  std::uint64_t budget() const noexcept override { return budget_.budget(); }
  std::uint64_t used() const override { return budget_.used(); }
  std::uint64_t high_water() const override { return budget_.high_water(); }
  bool can_allocate(std::uint64_t bytes) const override { return budget_.fits(bytes); }
  tier_allocation allocate(std::uint64_t bytes, std::string_view block) override;
  void deallocate(const tier_allocation& allocation) noexcept override;
  std::map<std::string, std::string> details() const override;

  io::engine& engine() noexcept { return *engine_; }
  io::file_space& space() noexcept { return *space_; }
  const io::file& file_of(const tier_allocation& a) const;
  bool checksums() const noexcept { return checksums_; }
  bool verifies_whole_blocks() const noexcept override { return checksums_; }
  // The checksum of what was last written to `a` (checksums on).
  void record_checksum(const tier_allocation& a, std::uint64_t sum) TF_EXCLUDES(mutex_);
  // Throws tierflow::error (EBADMSG) naming the block when `sum` differs.
  void verify_checksum(const tier_allocation& a, std::uint64_t sum, std::string_view block) const
      TF_EXCLUDES(mutex_);

 private:
  static std::uint64_t key(const tier_allocation& a) { return (std::uint64_t(a.file) << 48) | (a.offset >> 12); }

  tier_budget budget_;
  const bool checksums_;
  std::unique_ptr<io::engine> engine_;
  std::unique_ptr<io::file_space> space_;
  mutable mutex mutex_;
  std::unordered_map<std::uint64_t, std::uint64_t> sums_ TF_GUARDED_BY(mutex_);
};

}  // namespace tierflow::tiers::detail
