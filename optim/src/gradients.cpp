// The widening and adding of a downloaded gradient, the host copies of a
// training step and a gradient's squared norm (gradients.hpp).
#include "tierflow/optim/gradients.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <vector>

#include "kernels.hpp"
#include "tiles.hpp"
#include "tierflow/core/assert.hpp"

namespace tierflow::optim {

using detail::convert_range;
using detail::for_each_tile;
using detail::tile_elements;

namespace {

// Σ x² over data[0, n) in fp64, in order. Element i is added into running
// sum i % 16 (the compiler keeps them in vector registers: 16 lanes fill
// whole vectors of every width), and the sums are then added in a fixed
// tree, so the result is one set of bits on every target.
double squares_in_order(const float* data, std::size_t n) {
  constexpr std::size_t lanes = 16;
  double s[lanes] = {};
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    for (std::size_t k = 0; k < lanes; ++k) {
      const double x = data[i + k];
      s[k] += x * x;
    }
  }
  for (std::size_t k = 0; i < n; ++i, ++k) {
    const double x = data[i];
    s[k] += x * x;
  }
  for (std::size_t width = lanes / 2; width > 0; width /= 2)
    for (std::size_t k = 0; k < width; ++k) s[k] += s[k + width];
  return s[0];
}

// Σ x² over elements [first, last) of `data` (of `type`), in order, a piece
// of 2 Ki elements at a time whatever the type (so a sum's bits do not
// depend on it); bf16/fp16 widened (exactly) into a buffer in L1.
double squares_of(std::int64_t target, const void* data, dtype type, std::size_t first, std::size_t last) {
  constexpr std::size_t piece_elements = 2048;
  std::array<float, piece_elements> widened;
  const auto* bytes = static_cast<const std::byte*>(data);
  double sum = 0;
  for (std::size_t at = first; at < last; at += piece_elements) {
    const std::size_t piece = std::min(piece_elements, last - at);
    if (type == dtype::fp32) {
      sum += squares_in_order(static_cast<const float*>(data) + at, piece);
    } else {
      convert_range(target, bytes + at * size_of(type), type, widened.data(), dtype::fp32, 1.0f, 0, piece);
      sum += squares_in_order(widened.data(), piece);
    }
  }
  return sum;
}

// Σ over the tiles of [0, n) of tile(first, last), each tile's figure made
// on whichever thread holds it and the figures added in tile order: the same
// bits for any split over the threads.
template <class Tile>
double sum_by_tile(executor& ex, std::size_t n, Tile&& tile) {
  std::vector<double> sums((n + tile_elements - 1) / tile_elements, 0.0);
  for_each_tile(ex, n, [&](std::size_t begin, std::size_t end) {
    for (std::size_t t = begin / tile_elements; t * tile_elements < end; ++t) {
      const std::size_t first = t * tile_elements;
      sums[t] = tile(first, std::min(end, first + tile_elements));
    }
  });
  double total = 0;
  for (const double s : sums) total += s;
  return total;
}

}  // namespace

void widen_gradient(executor& ex, const void* src, dtype type, float* dst, std::size_t n) {
  convert(ex, src, type, dst, dtype::fp32, 1.0f, n);
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

void convert(executor& ex, const void* src, dtype src_type, void* dst, dtype dst_type, float scale,
             std::size_t n, double* sum_squares) {
  const std::int64_t target = ex.target() & ~detail::native_bf16_bit;  // torch's rounding of subnormals
  if (sum_squares == nullptr) {
    for_each_tile(ex, n, [&](std::size_t begin, std::size_t end) {
      convert_range(target, src, src_type, dst, dst_type, scale, begin, end);
    });
    return;
  }
  *sum_squares = sum_by_tile(ex, n, [&](std::size_t first, std::size_t last) {
    convert_range(target, src, src_type, dst, dst_type, scale, first, last);
    return squares_of(target, dst, dst_type, first, last);  // the tile is still in cache
  });
}

double sum_of_squares(executor& ex, const void* data, dtype type, std::size_t n) {
  const std::int64_t target = ex.target();
  return sum_by_tile(ex, n, [&](std::size_t first, std::size_t last) {
    return squares_of(target, data, type, first, last);
  });
}

}  // namespace tierflow::optim
