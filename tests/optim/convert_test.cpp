// The kernels' dtype conversions on every SIMD target, bit for bit against
// the compiler's own (round to nearest even, overflow to inf, subnormals, NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels.hpp"
#include "reference.hpp"

namespace tierflow::optim {
namespace {

std::vector<float> interesting_floats() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, 65536.0f, 1e10f,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), 6.1035156e-05f /* 2^-14 */,
                          6.1e-05f, 5.96e-08f, 2.98e-08f, 2.99e-08f, 1e-40f, 3.0e38f,
                          1.00048828125f /* 1 + 2^-11: an fp16 tie */, 1.00390625f /* bf16 tie */};
  std::mt19937 rng(42);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) v.push_back(test::float_of(bits(rng)));
  // Dense around the fp16 range, where the rounding cases are.
  std::uniform_real_distribution<float> exp(-26.0f, 17.0f);
  for (int i = 0; i < 200000; ++i) v.push_back((i & 1 ? -1.0f : 1.0f) * std::exp2(exp(rng)));
  return v;
}

TEST(convert, fp32_to_bf16_and_fp16_on_every_target) {
  const std::vector<float> in = interesting_floats();
  for (const auto& [target, name] : detail::available_targets()) {
    for (dtype to : {dtype::bf16, dtype::fp16}) {
      std::vector<std::uint16_t> out(in.size());
      detail::convert_range(target, in.data(), dtype::fp32, out.data(), to, 1.0f, 0, in.size());
      // "avx512-bf16" stores bf16 with VCVTNEPS2BF16, which turns subnormal
      // inputs into signed zero; everything else rounds exactly as torch does.
      const bool flushes = to == dtype::bf16 && (target & detail::native_bf16_bit) != 0;
      for (std::size_t i = 0; i < in.size(); ++i) {
        std::uint16_t want = to == dtype::bf16 ? test::ref_to_bf16(in[i]) : test::ref_to_fp16(in[i]);
        if (flushes && std::fpclassify(in[i]) == FP_SUBNORMAL)
          want = static_cast<std::uint16_t>((test::bits_of(in[i]) >> 16) & 0x8000);
        if (std::isnan(in[i])) {
          // Any quiet NaN will do: the payload is not specified.
          const float back = to == dtype::bf16 ? test::ref_from_bf16(out[i]) : test::ref_from_fp16(out[i]);
          ASSERT_TRUE(std::isnan(back)) << name;
          continue;
        }
        ASSERT_EQ(out[i], want) << name << " " << tierflow::name(to) << " of " << in[i] << " (bits 0x" << std::hex
                                << test::bits_of(in[i]) << ")";
      }
    }
  }
}

TEST(convert, every_fp16_and_bf16_pattern_widens_exactly) {
  std::vector<std::uint16_t> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
  for (const auto& [target, name] : detail::available_targets()) {
    for (dtype from : {dtype::bf16, dtype::fp16}) {
      std::vector<float> out(all.size());
      detail::convert_range(target, all.data(), from, out.data(), dtype::fp32, 1.0f, 0, all.size());
      for (std::size_t i = 0; i < all.size(); ++i) {
        const float want = from == dtype::bf16 ? test::ref_from_bf16(all[i]) : test::ref_from_fp16(all[i]);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(out[i])) << name;
        } else {
          ASSERT_EQ(test::bits_of(out[i]), test::bits_of(want)) << name << " pattern 0x" << std::hex << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace tierflow::optim
