// The CUDA kernels of ZenFlow's device side (zenflow_kernels.cu), behind
// plain launch functions so the host logic (zenflow_device.cpp) is ordinary
// C++. Every launcher enqueues on `stream` and returns the launch's status
// (cudaGetLastError); the caller checks it. Layout everywhere: a weight is
// stored column after column, column c = elements [c·rows, (c+1)·rows).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "adam_element.hpp"
#include "tierflow/core/dtype.hpp"

namespace tierflow::optim::detail {

// How many blocks a grid-stride kernel over `n` items launches: enough to
// fill every SM a few times over, never more than the items need.
unsigned grid_for(std::uint64_t n, unsigned threads, int sm_count);

enum class column_norm { l1, l2 };  // Σ|g|, or Σg² (zenflow::importance_norm)

// out[c] = Σ_r |g[c·rows + r]| (l2: Σ_r g²) for c < cols, accumulated in fp32.
cudaError_t launch_column_importance(const void* grad, dtype grad_type, std::uint64_t rows, std::uint64_t cols,
                                     column_norm norm, float* out, cudaStream_t stream, int sm_count);

// Adam/AdamW over the owned columns of one weight: slot j (< count) of the
// packed state is column columns[j]. For each r < rows:
//   adam_element(k, grad[columns[j]·rows + r], master[j·rows + r], ...)
//   param[columns[j]·rows + r] = master[j·rows + r] converted to param_type
struct adam_columns_args {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const std::uint32_t* columns = nullptr;
  std::uint64_t count = 0;
  std::uint64_t rows = 0;
  const void* grad = nullptr;
  dtype grad_type = dtype::fp32;
  void* param = nullptr;
  dtype param_type = dtype::fp32;
  adam_element_constants k;
};
cudaError_t launch_adam_columns(const adam_columns_args& args, cudaStream_t stream, int sm_count);

// dst[c·rows + r] = src[c·rows + r] for c in columns[0, count): whole columns
// of `element_size`-byte elements (2 or 4), between two whole-weight buffers.
cudaError_t launch_copy_columns(void* dst, const void* src, std::size_t element_size,
                                const std::uint32_t* columns, std::uint64_t count, std::uint64_t rows,
                                cudaStream_t stream, int sm_count);

// One weight's packed state: three planes of slots·rows floats.
struct state_planes {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
};
struct const_state_planes {
  const float* master = nullptr;
  const float* exp_avg = nullptr;
  const float* exp_avg_sq = nullptr;
};

// Builds `slots` slots of packed state in `dst`: slot j takes slot source[j]
// of `kept` when source[j] >= 0, else slot -source[j]-1 of `entering`. When
// `param` is set, a slot taken from `entering` also writes its master,
// converted to param_type, into param[columns[j]·rows + r] (the compute copy
// of a column entering the device starts from the host's master).
struct repack_args {
  state_planes dst;
  std::uint64_t slots = 0;
  std::uint64_t rows = 0;
  const std::int64_t* source = nullptr;
  const_state_planes kept;
  const_state_planes entering;
  void* param = nullptr;
  dtype param_type = dtype::fp32;
  const std::uint32_t* columns = nullptr;
};
cudaError_t launch_repack(const repack_args& args, cudaStream_t stream, int sm_count);

}  // namespace tierflow::optim::detail
