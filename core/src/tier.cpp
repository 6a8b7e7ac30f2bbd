#include "tierflow/core/tier.hpp"

#include "tierflow/core/assert.hpp"
#include "tierflow/core/units.hpp"

namespace tierflow {
namespace {

std::string budget_message(std::string_view tier, std::string_view block, std::uint64_t request,
                           std::uint64_t budget, std::uint64_t in_use) {
  return "tier " + std::string(tier) + ": cannot allocate " + format_bytes(double(request)) +
         " for block \"" + std::string(block) + "\": budget " + format_bytes(double(budget)) +
         ", " + format_bytes(double(in_use)) + " in use";
}

}  // namespace

budget_exceeded::budget_exceeded(std::string_view tier, std::string_view block,
                                 std::uint64_t request, std::uint64_t budget,
                                 std::uint64_t in_use, std::source_location where)
    : error(std::make_error_code(std::errc::not_enough_memory),
            error_context{"allocate"}.in_tier(std::string(tier)).of_block(std::string(block)),
            where, budget_message(tier, block, request, budget, in_use)),
      request_(request),
      budget_(budget) {}

tier_budget::tier_budget(std::string tier_name, std::uint64_t budget)
    : tier_name_(std::move(tier_name)), budget_(budget) {}

void tier_budget::charge(std::uint64_t bytes, std::string_view block) {
  lock_guard lock(mutex_);
  if (bytes > budget_ - used_) throw budget_exceeded(tier_name_, block, bytes, budget_, used_);
  used_ += bytes;
  high_water_ = std::max(high_water_, used_);
  TF_ASSERT(high_water_ <= budget_, "a tier's high-water mark passed its budget");
}

void tier_budget::discharge(std::uint64_t bytes) noexcept {
  lock_guard lock(mutex_);
  TF_ASSERT(bytes <= used_, "a tier returned more bytes than it took");
  used_ -= bytes;
}

bool tier_budget::fits(std::uint64_t bytes) const {
  lock_guard lock(mutex_);
  return bytes <= budget_ - used_;
}

std::uint64_t tier_budget::used() const {
  lock_guard lock(mutex_);
  return used_;
}

std::uint64_t tier_budget::high_water() const {
  lock_guard lock(mutex_);
  return high_water_;
}

}  // namespace tierflow
