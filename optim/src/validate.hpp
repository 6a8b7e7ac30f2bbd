// Argument checks shared by the optimizers: every one throws user_error with
// one line naming the argument, before anything is written.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "tierflow/core/dtype.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optim/tensor.hpp"

namespace tierflow::optim::detail {

inline void require(bool ok, std::string_view what, const std::string& message) {
  if (!ok) throw user_error(std::string(what) + ": " + message);
}

inline void require_finite_at_least(double value, double low, std::string_view what) {
  require(std::isfinite(value) && value >= low, what,
          "must be finite and >= " + std::to_string(low) + ", got " + std::to_string(value));
}

// [0, 1): betas and momentum.
inline void require_unit_interval(double value, std::string_view what) {
  require(std::isfinite(value) && value >= 0.0 && value < 1.0, what,
          "must be in [0, 1), got " + std::to_string(value));
}

inline void require_grad_scale(float scale) {
  require(std::isfinite(scale) && scale > 0.0f, "grad_scale",
          "must be finite and > 0, got " + std::to_string(scale));
}

// A buffer of `expected` elements whose pointer is non-null (unless empty)
// and aligned to its element size.
inline void require_buffer(const const_tensor_ref& t, std::size_t expected, std::string_view what) {
  require(t.size == expected, what,
          "has " + std::to_string(t.size) + " elements, expected " + std::to_string(expected));
  if (expected == 0) return;
  require(t.data != nullptr, what, "is a null pointer");
  require(reinterpret_cast<std::uintptr_t>(t.data) % size_of(t.type) == 0, what,
          "is not aligned to its " + std::to_string(size_of(t.type)) + "-byte elements");
}

inline void require_dtype(dtype t, std::string_view what, bool fp32, bool bf16, bool fp16) {
  const bool ok = (t == dtype::fp32 && fp32) || (t == dtype::bf16 && bf16) || (t == dtype::fp16 && fp16);
  if (ok) return;
  std::string allowed;
  auto add = [&](bool on, const char* n) {
    if (on) allowed += (allowed.empty() ? "" : ", ") + std::string(n);
  };
  add(fp32, "fp32");
  add(bf16, "bf16");
  add(fp16, "fp16");
  throw user_error(std::string(what) + ": dtype " + std::string(name(t)) + " is not supported (" +
                   allowed + ")");
}

}  // namespace tierflow::optim::detail
