#include <algorithm>
#include <utility>

#include "detail/tier_impl.hpp"
#include "tierflow/core/units.hpp"

namespace tierflow::tiers {

namespace detail {

memory_tier::memory_tier(tier_kind kind, std::string label, host_region region,
                         std::uint64_t budget)
    : kind_(kind),
      label_(std::move(label)),
      region_(std::move(region)),
      budget_(std::string(tierflow::name(kind)), std::min(budget, region_.size())),
      pool_(std::min(budget, region_.size())) {}

bool memory_tier::can_allocate(std::uint64_t bytes) const {
  if (!budget_.fits(bytes)) return false;
  lock_guard lock(mutex_);
  return pool_.largest_free() >= bytes;
}

std::optional<std::uint64_t> memory_tier::largest_free() const {
  const std::uint64_t within_budget = budget_.budget() - budget_.used();
  lock_guard lock(mutex_);
  return std::min(within_budget, pool_.largest_free());
}

tier_allocation memory_tier::allocate(std::uint64_t bytes, std::string_view block) {
  TF_ASSERT(bytes > 0 && bytes % block_alignment == 0, "an allocation not in whole pages");
  budget_.charge(bytes, block);  // throws budget_exceeded past the budget
  lock_guard lock(mutex_);
  const auto offset = pool_.allocate(bytes);
  if (!offset) {
    // Within budget but no free range that large: fragmentation.
    const std::uint64_t in_use = budget_.used() - bytes;
    budget_.discharge(bytes);
    throw budget_exceeded(std::string(tierflow::name(kind_)) + " (no free range that large)", block,
                          bytes, budget_.budget(), in_use);
  }
  return tier_allocation{region_.data() + *offset, *offset, bytes, 0};
}

void memory_tier::deallocate(const tier_allocation& allocation) noexcept {
  {
    lock_guard lock(mutex_);
    pool_.free(allocation.offset, allocation.size);
  }
  budget_.discharge(allocation.size);
}

std::map<std::string, std::string> memory_tier::details() const {
  std::map<std::string, std::string> out{
      {"pinning", region_.pinned_by()},
      {"pages", region_.page_backing()},
      {"numa_node", region_.numa_node() < 0 ? std::string("unbound") : std::to_string(region_.numa_node())},
      {"region_bytes", std::to_string(region_.size())}};
  if (!region_.pin_note().empty()) out["pin_note"] = region_.pin_note();
  if (stand_in()) out["backend"] = "host stand-in";
  lock_guard lock(mutex_);
  out["free_fragments"] = std::to_string(pool_.fragments());
  return out;
}

}  // namespace detail

std::unique_ptr<tier> make_host_tier(const host_tier_options& options) {
  if (options.budget == 0) throw user_error("host tier: the budget is zero");
  host_region_options r;
  r.bytes = aligned_size(options.budget);
  r.pages = options.pages;
  r.numa_node = options.numa_node;
  r.pre_touch = options.pre_touch;
  r.touch_threads = options.touch_threads;
  r.pin = options.pin;
  r.cuda_device = options.cuda_device;
  host_region region = host_region::map(r);
  std::string label = "host (pinned: " + region.pinned_by() + ")";
  return std::make_unique<detail::memory_tier>(tier_kind::host, std::move(label), std::move(region),
                                               r.bytes);
}

namespace detail {

std::unique_ptr<tier> make_device_stand_in(const device_tier_options& options) {
  host_region_options r;
  r.bytes = aligned_size(options.budget);
  r.pages = huge_pages::transparent;
  r.pre_touch = false;
  r.pin = pinning::none;
  r.numa_node = -1;
  return std::make_unique<detail::memory_tier>(tier_kind::device, "device (host stand-in)",
                                               host_region::map(r), r.bytes);
}

}  // namespace detail

}  // namespace tierflow::tiers
