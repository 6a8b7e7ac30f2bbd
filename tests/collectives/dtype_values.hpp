// Values in each of the communicators' dtypes, for the collectives tests:
// small integers, exact in fp32, bf16 and fp16, as their bytes.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tierflow/core/dtype.hpp"

namespace tierflow::collectives::testing {

// `v`'s 16 bits in bf16 (truncated: exact for small integers) or fp16.
inline std::uint16_t encode16(dtype t, float v) {
  if (t == dtype::bf16) return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(v) >> 16);
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(v));
}

inline float decode16(dtype t, std::uint16_t bits) {
  if (t == dtype::bf16) return std::bit_cast<float>(std::uint32_t{bits} << 16);
  return static_cast<float>(std::bit_cast<_Float16>(bits));
}

// `values` in dtype `t`, as bytes.
inline std::vector<std::byte> encode(dtype t, const std::vector<float>& values) {
  std::vector<std::byte> bytes(values.size() * size_of(t));
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (t == dtype::fp32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const std::uint16_t bits = encode16(t, values[i]);
      std::memcpy(bytes.data() + 2 * i, &bits, 2);
    }
  }
  return bytes;
}

}  // namespace tierflow::collectives::testing
