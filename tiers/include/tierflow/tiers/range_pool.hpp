// Carves fixed ranges out of one region over a free list that merges
// neighbours. Offsets and sizes are multiples of block_alignment.
// Not thread-safe (the tier owning it holds a lock).
//
// Small ranges (at most 1/32 of the region) are placed from the top down,
// the others from the bottom up, each first fit from its end. A copy in use
// cannot move, so what fragments a region is small long-lived copies (a
// model's biases and norms, resident for a whole step) landing in the holes
// large ones left: with them kept at the other end, the holes a released
// weight leaves stay whole for the next weight.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace tierflow::tiers {

class range_pool {
 public:
  explicit range_pool(std::uint64_t capacity);

  // The offset of a free range of `bytes` (the lowest that fits; a small
  // one: the highest), or nullopt.
  std::optional<std::uint64_t> allocate(std::uint64_t bytes);
  // Whether a range of `bytes` counts as small (placed from the top).
  bool small(std::uint64_t bytes) const noexcept { return bytes <= capacity_ / 32; }
  // Returns [offset, offset + bytes), taken earlier by allocate(). Freeing
  // what was not allocated is a bug (asserted).
  void free(std::uint64_t offset, std::uint64_t bytes);

  std::uint64_t capacity() const noexcept { return capacity_; }
  std::uint64_t free_bytes() const noexcept { return free_bytes_; }
  std::uint64_t largest_free() const noexcept;
  std::size_t fragments() const noexcept { return free_.size(); }

 private:
  std::uint64_t capacity_;
  std::uint64_t free_bytes_;
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> length; disjoint, never adjacent
};

}  // namespace tierflow::tiers
