// Check macros for CUDA runtime and NCCL calls. Include only from code built
// with CUDA (TIERFLOW_WITH_CUDA): it needs cuda_runtime.h (and nccl.h for
// TF_NCCL_CHECK). A failed call throws tierflow::error whose code() carries the
// CUDA or NCCL status in its own category, with file:line; the context is only
// built on failure.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <system_error>

#include "tierflow/core/error.hpp"

namespace tierflow::detail {

class cuda_category_t final : public std::error_category {
 public:
  const char* name() const noexcept override { return "cuda"; }
  std::string message(int status) const override {
    return std::string(cudaGetErrorName(static_cast<cudaError_t>(status))) + ": " +
           cudaGetErrorString(static_cast<cudaError_t>(status));
  }
};

inline const std::error_category& cuda_category() {
  static const cuda_category_t category;
  return category;
}

}  // namespace tierflow::detail

#define TF_CUDA_CHECK(expr, context)                                                    \
  do {                                                                                  \
    const cudaError_t tf_status_ = (expr);                                              \
    if (tf_status_ != cudaSuccess) [[unlikely]] {                                       \
      (void)cudaGetLastError(); /* clear the sticky-free error so later calls run */    \
      throw ::tierflow::error(std::error_code(static_cast<int>(tf_status_),             \
                                              ::tierflow::detail::cuda_category()),     \
                              (context));                                               \
    }                                                                                   \
  } while (0)

#if __has_include(<nccl.h>)
#include <nccl.h>

namespace tierflow::detail {

class nccl_category_t final : public std::error_category {
 public:
  const char* name() const noexcept override { return "nccl"; }
  std::string message(int status) const override {
    return ncclGetErrorString(static_cast<ncclResult_t>(status));
  }
};

inline const std::error_category& nccl_category() {
  static const nccl_category_t category;
  return category;
}

}  // namespace tierflow::detail

#define TF_NCCL_CHECK(expr, context)                                                    \
  do {                                                                                  \
    const ncclResult_t tf_status_ = (expr);                                             \
    if (tf_status_ != ncclSuccess) [[unlikely]] {                                       \
      throw ::tierflow::error(std::error_code(static_cast<int>(tf_status_),             \
                                              ::tierflow::detail::nccl_category()),     \
                              (context));                                               \
    }                                                                                   \
  } while (0)
#endif
