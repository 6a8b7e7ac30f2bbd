// The tier interface: an allocator with a byte budget it never exceeds.
//
// core/ knows no concrete tier: tiers/ implements this interface for device
// memory, pinned host memory and NVMe files, and the program that assembles a
// store hands the instances to it. Allocation is control plane (once per load
// of a block into a tier), so it is a virtual call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <source_location>
#include <span>
#include <string>
#include <string_view>

#include "tierflow/core/block.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/thread_annotations.hpp"

namespace tierflow {

// Where a tier's bytes are, which decides what a mover may do with them.
enum class memory_kind : unsigned char {
  host,    // CPU-addressable memory (data points at it)
  device,  // GPU memory (data is a device pointer, not dereferenceable on the CPU)
  file,    // a range of a file (offset is meaningful, data is null)
};

// One block's storage in one tier: a pointer for memory tiers, a file and an
// offset in it for file tiers, and its size (a multiple of block_alignment).
struct tier_allocation {
  std::byte* data = nullptr;
  std::uint64_t offset = 0;   // memory tiers: from the start of the tier's region
  std::uint64_t size = 0;
  std::uint32_t file = 0;     // file tiers: which of the tier's files

  explicit operator bool() const noexcept { return size != 0; }
  std::span<std::byte> bytes() const noexcept { return {data, static_cast<std::size_t>(size)}; }
};

// Thrown when an allocation would take a tier past its budget. what() names
// the tier, the block, the request, the budget and what is in use, e.g.
//   tier host: cannot allocate 64.00 MiB for block "l3.w": budget 1.00 GiB, 992.00 MiB in use
class budget_exceeded : public error {
 public:
  budget_exceeded(std::string_view tier, std::string_view block, std::uint64_t request,
                  std::uint64_t budget, std::uint64_t in_use,
                  std::source_location where = std::source_location::current());

  std::uint64_t request() const noexcept { return request_; }
  std::uint64_t budget() const noexcept { return budget_; }

 private:
  std::uint64_t request_;
  std::uint64_t budget_;
};

// A byte budget with its high-water mark; thread-safe. Tiers charge it before
// they hand out memory, so a budget is enforced in one place.
class tier_budget {
 public:
  tier_budget(std::string tier_name, std::uint64_t budget);

  // Takes `bytes` from the budget for `block`, or throws budget_exceeded and
  // takes nothing. Asserts the invariant high_water <= budget.
  void charge(std::uint64_t bytes, std::string_view block) TF_EXCLUDES(mutex_);
  // Returns `bytes` taken earlier by charge().
  void discharge(std::uint64_t bytes) noexcept TF_EXCLUDES(mutex_);
  // Whether `bytes` more would fit now.
  bool fits(std::uint64_t bytes) const TF_EXCLUDES(mutex_);

  std::uint64_t budget() const noexcept { return budget_; }
  std::uint64_t used() const TF_EXCLUDES(mutex_);
  std::uint64_t high_water() const TF_EXCLUDES(mutex_);

 private:
  const std::string tier_name_;
  const std::uint64_t budget_;
  mutable mutex mutex_;
  std::uint64_t used_ TF_GUARDED_BY(mutex_) = 0;
  std::uint64_t high_water_ TF_GUARDED_BY(mutex_) = 0;
};

// One tier. Implementations are thread-safe: the store allocates under its own
// lock, but telemetry reads the counters from any thread.
class tier {
 public:
  virtual ~tier() = default;
  tier() = default;
  tier(const tier&) = delete;
  tier& operator=(const tier&) = delete;

  virtual tier_kind kind() const noexcept = 0;
  // A human name: "host (NUMA node 0, pinned: mlock)", "device (host stand-in)".
  virtual std::string name() const = 0;
  virtual memory_kind memory() const noexcept = 0;

  virtual std::uint64_t budget() const noexcept = 0;
  virtual std::uint64_t used() const = 0;
  virtual std::uint64_t high_water() const = 0;

  // Whether allocate(bytes, ...) would succeed now: within the budget and, for
  // pooled memory, with a free range that large.
  virtual bool can_allocate(std::uint64_t bytes) const = 0;
  // Storage for `bytes` (a multiple of block_alignment) for block `block`.
  // Throws budget_exceeded past the budget (or when no range that large is
  // free), tierflow::error when the system refuses.
  virtual tier_allocation allocate(std::uint64_t bytes, std::string_view block) = 0;
  // The largest allocation that would succeed now, where the allocator can
  // tell (a pooled region's largest free range within the budget); nullopt
  // where it cannot. For messages: can_allocate() is what decides.
  virtual std::optional<std::uint64_t> largest_free() const { return std::nullopt; }
  // Returns storage from allocate(). Never throws.
  virtual void deallocate(const tier_allocation& allocation) noexcept = 0;

  // Whether what is read from it is checked against a checksum of the whole
  // block (NVMe with checksums on): a part of a block cannot be checked.
  virtual bool verifies_whole_blocks() const noexcept { return false; }

  // Extra facts for telemetry ("pinning": "mlock", "numa_node": "0", ...).
  virtual std::map<std::string, std::string> details() const { return {}; }
};

}  // namespace tierflow
