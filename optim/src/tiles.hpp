// How a step's elements are cut into tiles and spread over an executor's
// threads. Every pass over a sub-group (first touch, the finite check, the
// update, the bound) goes through here, so element i is always handled by the
// same thread: the pages it first touched are the ones it streams.
#pragma once

#include <algorithm>
#include <cstddef>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>

#include "tierflow/optim/executor.hpp"

namespace tierflow::optim::detail {

// 16 Ki elements: 64 KiB per fp32 array, 7 arrays ≈ 450 KiB in flight per
// tile — within L2 on current x86 and ARM server cores, and a multiple of
// every vector width and of the 4 KiB page for each dtype.
inline constexpr std::size_t tile_elements = std::size_t{1} << 14;

// Calls body(begin, end) over [0, n) in tiles. One thread (or fewer than two
// tiles): on the calling thread, in order. Otherwise: oneTBB's static
// partitioner inside the executor's arena, which gives each thread one
// contiguous run of tiles, the same run on every call.
template <class Body>
void for_each_tile(executor& ex, std::size_t n, Body&& body) {
  const std::size_t tiles = (n + tile_elements - 1) / tile_elements;
  if (ex.threads() == 1 || tiles < 2) {
    if (n > 0) body(std::size_t{0}, n);
    return;
  }
  ex.run([&] {
    tbb::parallel_for(
        tbb::blocked_range<std::size_t>(0, tiles),
        [&](const tbb::blocked_range<std::size_t>& r) {
          body(r.begin() * tile_elements, std::min(n, r.end() * tile_elements));
        },
        tbb::static_partitioner{});
  });
}

}  // namespace tierflow::optim::detail
