// The kernels of ZenFlow's device side. All are memory-bound: each reads and
// writes every element once, in a grid-stride loop over the flattened
// (slot, row) space so that any shape (a few long columns or many short
// ones) keeps every SM busy. Compiled for sm_90 whenever the build has CUDA.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "cuda/zenflow_kernels.hpp"

namespace tierflow::optim::detail {
namespace {

constexpr unsigned block_threads = 256;  // a multiple of the warp size (the importance reduction needs it)
constexpr unsigned warp_size = 32;

// ---- dtypes on the device ------------------------------------------------------

template <dtype T>
struct element;
template <>
struct element<dtype::fp32> {
  using type = float;
  __device__ static float load(float x) { return x; }
  __device__ static float store(float x) { return x; }
};
template <>
struct element<dtype::bf16> {
  using type = __nv_bfloat16;
  __device__ static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  // Round to nearest even, as the host's conversions (convert_range) do.
  __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct element<dtype::fp16> {
  using type = __half;
  __device__ static float load(__half x) { return __half2float(x); }
  __device__ static __half store(float x) { return __float2half_rn(x); }
};

// Calls fn(std::integral_constant<dtype, t>) for the run-time dtype t.
template <class Fn>
void with_dtype(dtype t, Fn&& fn) {
  switch (t) {
    case dtype::fp32: fn(std::integral_constant<dtype, dtype::fp32>{}); break;
    case dtype::bf16: fn(std::integral_constant<dtype, dtype::bf16>{}); break;
    case dtype::fp16: fn(std::integral_constant<dtype, dtype::fp16>{}); break;
  }
}

__device__ inline std::uint64_t first_index() {
  return static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline std::uint64_t grid_stride() { return static_cast<std::uint64_t>(gridDim.x) * blockDim.x; }

__device__ inline float warp_sum(float x) {
  for (unsigned offset = warp_size / 2; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
  return x;
}

// ---- kernels ---------------------------------------------------------------------

// One block per column (grid-stride over the columns): each thread sums a
// strided share of the column's rows, then the warps' sums meet in shared memory.
template <dtype G, bool Squared>
__global__ void __launch_bounds__(block_threads)
    column_importance_kernel(const void* grad, std::uint64_t rows, std::uint64_t cols, float* out) {
  using E = element<G>;
  const auto* g = static_cast<const typename E::type*>(grad);
  __shared__ float warp_sums[block_threads / warp_size];
  const unsigned lane = threadIdx.x % warp_size, warp = threadIdx.x / warp_size;
  for (std::uint64_t c = blockIdx.x; c < cols; c += gridDim.x) {
    const auto* column = g + c * rows;
    float sum = 0.0f;
    for (std::uint64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const float x = E::load(column[r]);
      sum += Squared ? x * x : fabsf(x);
    }
    sum = warp_sum(sum);
    if (lane == 0) warp_sums[warp] = sum;
    __syncthreads();
    if (warp == 0) {
      sum = lane < blockDim.x / warp_size ? warp_sums[lane] : 0.0f;
      sum = warp_sum(sum);
      if (lane == 0) out[c] = sum;
    }
    __syncthreads();  // warp_sums is rewritten for the next column
  }
}

template <dtype G, dtype P>
__global__ void __launch_bounds__(block_threads) adam_columns_kernel(adam_columns_args a) {
  const auto* grad = static_cast<const typename element<G>::type*>(a.grad);
  auto* param = static_cast<typename element<P>::type*>(a.param);
  const std::uint64_t n = a.count * a.rows;
  for (std::uint64_t i = first_index(); i < n; i += grid_stride()) {
    const std::uint64_t j = i / a.rows, r = i - j * a.rows;
    const std::uint64_t at = static_cast<std::uint64_t>(a.columns[j]) * a.rows + r;
    float p = a.master[i], m = a.exp_avg[i], v = a.exp_avg_sq[i];
    adam_element(a.k, element<G>::load(grad[at]), p, m, v);
    a.master[i] = p;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    param[at] = element<P>::store(p);
  }
}

template <class T>
__global__ void __launch_bounds__(block_threads)
    copy_columns_kernel(T* dst, const T* src, const std::uint32_t* columns, std::uint64_t count, std::uint64_t rows) {
  const std::uint64_t n = count * rows;
  for (std::uint64_t i = first_index(); i < n; i += grid_stride()) {
    const std::uint64_t j = i / rows, r = i - j * rows;
    const std::uint64_t at = static_cast<std::uint64_t>(columns[j]) * rows + r;
    dst[at] = src[at];
  }
}

template <dtype P, bool WriteParam>
__global__ void __launch_bounds__(block_threads) repack_kernel(repack_args a) {
  const std::uint64_t n = a.slots * a.rows;
  for (std::uint64_t i = first_index(); i < n; i += grid_stride()) {
    const std::uint64_t j = i / a.rows, r = i - j * a.rows;
    const std::int64_t s = a.source[j];
    const bool kept = s >= 0;
    const std::uint64_t at = static_cast<std::uint64_t>(kept ? s : -s - 1) * a.rows + r;
    const float master = (kept ? a.kept.master : a.entering.master)[at];
    a.dst.master[i] = master;
    a.dst.exp_avg[i] = (kept ? a.kept.exp_avg : a.entering.exp_avg)[at];
    a.dst.exp_avg_sq[i] = (kept ? a.kept.exp_avg_sq : a.entering.exp_avg_sq)[at];
    if constexpr (WriteParam) {
      if (!kept) {
        auto* param = static_cast<typename element<P>::type*>(a.param);
        param[static_cast<std::uint64_t>(a.columns[j]) * a.rows + r] = element<P>::store(master);
      }
    }
  }
}

}  // namespace

unsigned grid_for(std::uint64_t n, unsigned threads, int sm_count) {
  // Eight resident blocks of 256 threads per SM fill an sm_90 SM (2048
  // threads); the grid-stride loops take the rest.
  const std::uint64_t cap = static_cast<std::uint64_t>(std::max(sm_count, 1)) * 8;
  const std::uint64_t needed = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::max<std::uint64_t>(1, std::min(needed, cap)));
}

cudaError_t launch_column_importance(const void* grad, dtype grad_type, std::uint64_t rows, std::uint64_t cols,
                                     column_norm norm, float* out, cudaStream_t stream, int sm_count) {
  if (cols == 0) return cudaSuccess;
  // One block per column, up to the cap; the blocks stride over the rest.
  const unsigned blocks = grid_for(cols * block_threads, block_threads, sm_count);
  with_dtype(grad_type, [&](auto g) {
    if (norm == column_norm::l2)
      column_importance_kernel<decltype(g)::value, true><<<blocks, block_threads, 0, stream>>>(grad, rows, cols, out);
    else
      column_importance_kernel<decltype(g)::value, false><<<blocks, block_threads, 0, stream>>>(grad, rows, cols, out);
  });
  return cudaGetLastError();
}

cudaError_t launch_adam_columns(const adam_columns_args& args, cudaStream_t stream, int sm_count) {
  const std::uint64_t n = args.count * args.rows;
  if (n == 0) return cudaSuccess;
  const unsigned blocks = grid_for(n, block_threads, sm_count);
  with_dtype(args.grad_type, [&](auto g) {
    with_dtype(args.param_type, [&](auto p) {
      adam_columns_kernel<decltype(g)::value, decltype(p)::value><<<blocks, block_threads, 0, stream>>>(args);
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_copy_columns(void* dst, const void* src, std::size_t element_size,
                                const std::uint32_t* columns, std::uint64_t count, std::uint64_t rows,
                                cudaStream_t stream, int sm_count) {
  const std::uint64_t n = count * rows;
  if (n == 0) return cudaSuccess;
  const unsigned blocks = grid_for(n, block_threads, sm_count);
  if (element_size == 4) {
    copy_columns_kernel<std::uint32_t><<<blocks, block_threads, 0, stream>>>(
        static_cast<std::uint32_t*>(dst), static_cast<const std::uint32_t*>(src), columns, count, rows);
  } else if (element_size == 2) {
    copy_columns_kernel<std::uint16_t><<<blocks, block_threads, 0, stream>>>(
        static_cast<std::uint16_t*>(dst), static_cast<const std::uint16_t*>(src), columns, count, rows);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_repack(const repack_args& args, cudaStream_t stream, int sm_count) {
  const std::uint64_t n = args.slots * args.rows;
  if (n == 0) return cudaSuccess;
  const unsigned blocks = grid_for(n, block_threads, sm_count);
  if (args.param == nullptr) {
    repack_kernel<dtype::fp32, false><<<blocks, block_threads, 0, stream>>>(args);
  } else {
    with_dtype(args.param_type,
               [&](auto p) { repack_kernel<decltype(p)::value, true><<<blocks, block_threads, 0, stream>>>(args); });
  }
  return cudaGetLastError();
}

}  // namespace tierflow::optim::detail
