#include "tierflow/tiers/range_pool.hpp"

#include <algorithm>
#include <iterator>

#include "tierflow/core/assert.hpp"

namespace tierflow::tiers {

range_pool::range_pool(std::uint64_t capacity) : capacity_(capacity), free_bytes_(capacity) {
  if (capacity > 0) free_.emplace(0, capacity);
}

std::optional<std::uint64_t> range_pool::allocate(std::uint64_t bytes) {
  TF_ASSERT(bytes > 0);
  if (small(bytes)) {  // the top end of the highest range that fits
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if (it->second < bytes) continue;
      it->second -= bytes;
      const std::uint64_t offset = it->first + it->second;
      if (it->second == 0) free_.erase(std::next(it).base());
      free_bytes_ -= bytes;
      return offset;
    }
    return std::nullopt;
  }
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const std::uint64_t offset = it->first;
    const std::uint64_t rest = it->second - bytes;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + bytes, rest);
    free_bytes_ -= bytes;
    return offset;
  }
  return std::nullopt;
}

void range_pool::free(std::uint64_t offset, std::uint64_t bytes) {
  TF_ASSERT(bytes > 0 && offset + bytes <= capacity_, "freeing a range outside the pool");
  free_bytes_ += bytes;
  auto next = free_.lower_bound(offset);
  TF_ASSERT(next == free_.end() || offset + bytes <= next->first, "double free in a range pool");
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    TF_ASSERT(prev->first + prev->second <= offset, "double free in a range pool");
    if (prev->first + prev->second == offset) {  // merge with the range before
      offset = prev->first;
      bytes += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && offset + bytes == next->first) {  // and with the one after
    bytes += next->second;
    free_.erase(next);
  }
  free_.emplace(offset, bytes);
}

std::uint64_t range_pool::largest_free() const noexcept {
  std::uint64_t best = 0;
  for (const auto& [offset, length] : free_) best = std::max(best, length);
  return best;
}

}  // namespace tierflow::tiers
