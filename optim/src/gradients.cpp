// The widening and adding of a downloaded gradient (gradients.hpp).
#include "tierflow/optim/gradients.hpp"

#include <algorithm>
#include <array>
#include <vector>

#include "kernels.hpp"
#include "tiles.hpp"
#include "tierflow/core/assert.hpp"

namespace tierflow::optim {

using detail::convert_range;
using detail::for_each_tile;

void widen_gradient(executor& ex, const void* src, dtype type, float* dst, std::size_t n) {
  const std::int64_t target = ex.target();
  for_each_tile(ex, n, [&](std::size_t begin, std::size_t end) {
    convert_range(target, src, type, dst, dtype::fp32, 1.0f, begin, end);
  });
}

void accumulate_gradient(executor& ex, const void* src, dtype type, std::span<const zenflow::column_run> runs,
                         std::uint64_t rows, std::span<float> sum) {
  // The runs laid end to end: the tiles cut that line, whatever the runs' lengths.
  std::vector<std::uint64_t> starts(runs.size() + 1, 0);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    TF_ASSERT(runs[i].begin < runs[i].end && runs[i].end * rows <= sum.size(), "accumulate: a run outside the weight");
    starts[i + 1] = starts[i] + (runs[i].end - runs[i].begin) * rows;
  }
  const std::int64_t target = ex.target();
  const auto* bytes = static_cast<const std::byte*>(src);
  const std::size_t element = size_of(type);
  for_each_tile(ex, starts.back(), [&](std::size_t begin, std::size_t end) {
    // Widened a piece at a time into a buffer that stays in L1.
    std::array<float, 2048> widened;
    std::size_t run = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
    while (begin < end) {
      const std::uint64_t at = runs[run].begin * rows + (begin - starts[run]);  // element of the weight
      const std::size_t piece = static_cast<std::size_t>(std::min<std::uint64_t>(
          {end - begin, starts[run + 1] - begin, widened.size()}));
      float* out = sum.data() + at;
      if (type == dtype::fp32) {
        const float* in = reinterpret_cast<const float*>(bytes) + at;
        for (std::size_t i = 0; i < piece; ++i) out[i] += in[i];
      } else {
        convert_range(target, bytes + at * element, type, widened.data(), dtype::fp32, 1.0f, 0, piece);
        for (std::size_t i = 0; i < piece; ++i) out[i] += widened[i];
      }
      begin += piece;
      if (begin == starts[run + 1]) ++run;
    }
  });
}

}  // namespace tierflow::optim
