// A device's gradient on the host: widened from bf16/fp16 to fp32, and added
// into a ZenFlow window's sum over the host-owned columns, spread over an
// executor's threads. What cuda_zenflow_device does with each download, and
// what bench offload's simulated device does with its own. Also the copies
// between a gradient or a master and the store's blocks that a training
// step makes on the host (convert), and a gradient's squared norm for
// clipping (sum_of_squares).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "tierflow/core/dtype.hpp"
#include "tierflow/core/zenflow/engine.hpp"
#include "tierflow/optim/executor.hpp"

namespace tierflow::optim {

// dst[i] = src[i] as fp32 for i < n; src holds `type` (fp32, bf16 or fp16).
// Widening is exact, so every SIMD target and every split over the threads
// give the same bits.
void widen_gradient(executor& ex, const void* src, dtype type, float* dst, std::size_t n);

// sum[k] += src[k] (src widened to fp32) for every element k of the columns
// in `runs` (column c is elements [c·rows, (c+1)·rows)); other elements of
// `sum` are not touched. Element by element the same fp32 addition as a
// plain loop, whatever the threads. `runs` ascending and inside `sum`.
void accumulate_gradient(executor& ex, const void* src, dtype type, std::span<const zenflow::column_run> runs,
                         std::uint64_t rows, std::span<float> sum);

// dst[i] = src[i] × scale for i < n, from `src_type` to `dst_type`, rounded
// to nearest even when narrowing (as torch rounds; subnormals kept whatever
// the executor's target). With `sum_squares`, *sum_squares is also set, in
// the same pass, to sum_of_squares of what was written. src and dst may be
// the same buffer when their dtypes are; otherwise they must not overlap.
void convert(executor& ex, const void* src, dtype src_type, void* dst, dtype dst_type, float scale,
             std::size_t n, double* sum_squares = nullptr);

// Σ x² over the n elements of `data` (widened to fp32), each square and the
// sum in fp64. The elements are added in one fixed order (tile by tile, each
// tile in order), so the result's bits depend on neither the threads nor
// the SIMD target. An inf or nan element gives a result that is not finite.
double sum_of_squares(executor& ex, const void* data, dtype type, std::size_t n);

}  // namespace tierflow::optim
