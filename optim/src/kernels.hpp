// The SIMD kernels behind the optimizers, one entry point per kernel family.
// Each takes the Highway target to run (an executor's choice, so a test can
// force every compiled target without touching global state) and one range of
// elements; the callers in adam.cpp / muon.cpp split the work into tiles and
// spread the tiles over the executor's threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "adam_element.hpp"
#include "tierflow/core/dtype.hpp"

namespace tierflow::optim::detail {

// The target bits (Highway's HWY_* values) compiled in and supported here,
// best first, with tierflow's name for each. On a CPU with AVX-512 BF16,
// "avx512-bf16" comes first: Highway's AVX3 bits with native_bf16_bit set,
// the AVX3 kernels storing bf16 with VCVTNEPS2BF16 (which flushes subnormal
// inputs and results to zero, where "avx512" rounds them as torch does).
// (Bit 20: between Highway's x86 and Arm target bits, used by neither.)
inline constexpr std::int64_t native_bf16_bit = std::int64_t{1} << 20;
std::vector<std::pair<std::int64_t, std::string>> available_targets();

enum class copy_kind : unsigned char { none, bf16, fp16 };

// One Adam step over one sub-group: its buffers and dtypes, and the step's
// constants (adam_element.hpp, shared with the CUDA device side).
struct adam_kernel_args {
  float* param = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;  // with amsgrad only
  void* param_copy = nullptr;      // with copy != none only
  dtype grad_type = dtype::fp32;
  dtype state_type = dtype::fp32;
  copy_kind copy = copy_kind::none;
  bool amsgrad = false;
  bool native_bf16 = false;  // set by adam_range for the "avx512-bf16" target
  float grad_scale = 1.0f;
  adam_element_constants k;
};

void adam_range(std::int64_t target, const adam_kernel_args& args, std::size_t begin,
                std::size_t end);

// True when every element of data[begin, end) times `scale` is finite.
bool all_finite(std::int64_t target, const void* data, dtype type, float scale,
                std::size_t begin, std::size_t end);

// The STREAM-style Adam-shaped pass: p += g, m += g, v += g.
void stream_range(std::int64_t target, float* p, const float* g, float* m, float* v,
                  std::size_t begin, std::size_t end);

// dst[i] = src[i] * scale, converted (round to nearest even when narrowing).
void convert_range(std::int64_t target, const void* src, dtype src_type, void* dst,
                   dtype dst_type, float scale, std::size_t begin, std::size_t end);

}  // namespace tierflow::optim::detail
