// Views of one flat buffer of one dtype: what the optimizers read and write.
//
// The optimizers never own memory: a scheduler hands them the parameter,
// gradient and state buffers of one sub-group (wherever the tiers put them)
// as these views, and gets the same buffers back updated in place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "tierflow/core/dtype.hpp"

namespace tierflow::optim {

// A writable buffer of `size` elements of `type` at `data`. bf16 and fp16
// elements are raw 16-bit patterns. An empty view (data == nullptr, size == 0)
// means "absent" where a buffer is optional.
struct tensor_ref {
  void* data = nullptr;
  std::size_t size = 0;
  dtype type = dtype::fp32;

  bool empty() const noexcept { return data == nullptr && size == 0; }
};

// A read-only buffer, as tensor_ref.
struct const_tensor_ref {
  const void* data = nullptr;
  std::size_t size = 0;
  dtype type = dtype::fp32;

  const_tensor_ref() = default;
  const_tensor_ref(const void* d, std::size_t n, dtype t) : data(d), size(n), type(t) {}
  // Every writable view reads as well.
  const_tensor_ref(const tensor_ref& r) : data(r.data), size(r.size), type(r.type) {}  // NOLINT

  bool empty() const noexcept { return data == nullptr && size == 0; }
};

inline tensor_ref fp32_ref(std::span<float> s) { return {s.data(), s.size(), dtype::fp32}; }
inline const_tensor_ref fp32_ref(std::span<const float> s) { return {s.data(), s.size(), dtype::fp32}; }
// `type` is dtype::bf16 or dtype::fp16: the patterns' meaning.
inline tensor_ref half_ref(std::span<std::uint16_t> s, dtype type) { return {s.data(), s.size(), type}; }
inline const_tensor_ref half_ref(std::span<const std::uint16_t> s, dtype type) {
  return {s.data(), s.size(), type};
}

}  // namespace tierflow::optim
