// The element types tierflow stores and moves: a tag, its size and its name.
//
// Kept free of any SIMD or CUDA header so every module (blocks, tiers, the
// optimizers, the CLI) can name a dtype without pulling in a kernel library.
// bf16 and fp16 values are carried as their raw 16-bit patterns (std::uint16_t).
#pragma once

#include <cstddef>
#include <string_view>

namespace tierflow {

enum class dtype : unsigned char {
  fp32,  // IEEE binary32
  bf16,  // bfloat16: the top 16 bits of a binary32
  fp16,  // IEEE binary16
};

// Bytes per element: 4 for fp32, 2 for bf16 and fp16.
constexpr std::size_t size_of(dtype t) noexcept { return t == dtype::fp32 ? 4 : 2; }

// "fp32", "bf16", "fp16" — the spelling flags, configs and JSON use.
constexpr std::string_view name(dtype t) noexcept {
  switch (t) {
    case dtype::fp32: return "fp32";
    case dtype::bf16: return "bf16";
    case dtype::fp16: return "fp16";
  }
  return "unknown";
}

// Parses "fp32" / "float32" / "f32", "bf16" / "bfloat16", "fp16" / "float16" /
// "half" (case-sensitive, lower case). `what` names the flag or key in the
// message. Throws user_error for anything else.
dtype parse_dtype(std::string_view text, std::string_view what);

}  // namespace tierflow
