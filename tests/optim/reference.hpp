// Plain scalar references for the optimizer tests: conversions written
// independently of the kernels (the compiler's _Float16 for fp16), and Adam /
// Muon in double precision.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "tierflow/core/dtype.hpp"

namespace tierflow::optim::test {

inline std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
inline float float_of(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline std::uint16_t ref_to_bf16(float f) {
  const std::uint32_t b = bits_of(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((b >> 16) | 0x0040);
  const std::uint64_t rounded = static_cast<std::uint64_t>(b) + 0x7FFF + ((b >> 16) & 1);
  return static_cast<std::uint16_t>(rounded >> 16);
}
inline float ref_from_bf16(std::uint16_t h) { return float_of(static_cast<std::uint32_t>(h) << 16); }

inline std::uint16_t ref_to_fp16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  std::uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
inline float ref_from_fp16(std::uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

inline float round_to(dtype t, double v) {
  const float f = static_cast<float>(v);
  if (t == dtype::bf16) return ref_from_bf16(ref_to_bf16(f));
  if (t == dtype::fp16) return ref_from_fp16(ref_to_fp16(f));
  return f;
}

// A buffer of n elements of dtype t holding `values` rounded to t.
struct typed_buffer {
  dtype type = dtype::fp32;
  std::vector<float> f32;
  std::vector<std::uint16_t> h16;

  typed_buffer(dtype t, const std::vector<float>& values) : type(t) {
    if (t == dtype::fp32) {
      f32 = values;
    } else {
      for (float v : values) h16.push_back(t == dtype::bf16 ? ref_to_bf16(v) : ref_to_fp16(v));
    }
  }
  std::size_t size() const { return type == dtype::fp32 ? f32.size() : h16.size(); }
  void* data() { return type == dtype::fp32 ? static_cast<void*>(f32.data()) : static_cast<void*>(h16.data()); }
  float at(std::size_t i) const {
    if (type == dtype::fp32) return f32[i];
    return type == dtype::bf16 ? ref_from_bf16(h16[i]) : ref_from_fp16(h16[i]);
  }
  bool operator==(const typed_buffer&) const = default;
};

inline std::vector<float> normal_values(std::size_t n, unsigned seed, float scale = 1.0f, float offset = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = offset + scale * dist(rng);
  return v;
}

}  // namespace tierflow::optim::test
