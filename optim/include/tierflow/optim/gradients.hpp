// A device's gradient on the host: widened from bf16/fp16 to fp32, and added
// into a ZenFlow window's sum over the host-owned columns, spread over an
// executor's threads. What cuda_zenflow_device does with each download, and
// what bench offload's simulated device does with its own.
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

}  // namespace tierflow::optim
