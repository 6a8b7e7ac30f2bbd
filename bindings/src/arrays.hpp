// The tensors the optimizers' steps take: C-contiguous CPU buffers handed in
// as DLPack views (torch tensors or NumPy arrays, read and written where they
// are, never copied), and their element types in tierflow's terms.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "tierflow/core/dtype.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optim/tensor.hpp"

namespace tierflow::python {

// A C-contiguous CPU buffer of any dtype; the dtype is checked by the step.
using buffer = nanobind::ndarray<nanobind::device::cpu, nanobind::c_contig>;
using const_buffer = nanobind::ndarray<nanobind::ro, nanobind::device::cpu, nanobind::c_contig>;

// fp32, bf16 or fp16; throws user_error naming `what` for any other dtype.
template <class Array>
dtype element_type(const Array& a, std::string_view what) {
  namespace dl = nanobind::dlpack;
  const dl::dtype t = a.dtype();
  if (t == nanobind::dtype<float>()) return dtype::fp32;
  if (t.code == static_cast<std::uint8_t>(dl::dtype_code::Bfloat) && t.bits == 16 && t.lanes == 1)
    return dtype::bf16;
  if (t.code == static_cast<std::uint8_t>(dl::dtype_code::Float) && t.bits == 16 && t.lanes == 1)
    return dtype::fp16;
  throw user_error(std::string(what) + ": float32, bfloat16 or float16 expected (DLPack code " +
                   std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits)");
}

inline optim::tensor_ref view_of(buffer& a, std::string_view what) {
  return {a.data(), a.size(), element_type(a, what)};
}

inline optim::const_tensor_ref view_of(const const_buffer& a, std::string_view what) {
  return {a.data(), a.size(), element_type(a, what)};
}

}  // namespace tierflow::python
