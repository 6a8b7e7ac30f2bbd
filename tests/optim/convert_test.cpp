// The kernels' dtype conversions on every SIMD target, bit for bit against
// the compiler's own (round to nearest even, overflow to inf, subnormals, NaN);
// and optim::convert / sum_of_squares, the host copies of a training step
// spread over an executor's threads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <limits>
#include <random>
#include <vector>

#include "kernels.hpp"
#include "tierflow/optim/executor.hpp"
#include "tierflow/optim/gradients.hpp"
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

// Sizes around the tile (16 Ki elements) and the widening piece (2 Ki): none,
// one, less than a vector, a piece and one, a tile and one, several tiles
// and a tail.
constexpr std::size_t sizes[] = {0, 1, 7, 2049, 16385, 3 * 16384 + 5};

constexpr dtype all_dtypes[] = {dtype::fp32, dtype::bf16, dtype::fp16};

TEST(convert, scaled_copies_between_every_pair_of_dtypes_on_threads_match_a_scalar_loop) {
  for (const int threads : {1, 3}) {
    for (const std::string& simd : simd_targets()) {
      executor ex(threads, simd);
      for (const dtype from : all_dtypes) {
        for (const dtype to : all_dtypes) {
          for (const std::size_t n : sizes) {
            for (const float scale : {1.0f, 0.3712f}) {
              const test::typed_buffer src(from, test::normal_values(n, 11 + static_cast<unsigned>(n), 2.0f));
              // One element past the end, which must stay as it is.
              test::typed_buffer dst(to, std::vector<float>(n + 1, -5.0f));
              double sum = -1;
              convert(ex, const_cast<test::typed_buffer&>(src).data(), from, dst.data(), to, scale, n, &sum);
              double want_sum = 0;
              for (std::size_t i = 0; i < n; ++i) {
                const float want = test::round_to(to, src.at(i) * scale);
                ASSERT_EQ(test::bits_of(dst.at(i)), test::bits_of(want))
                    << simd << ", " << threads << " threads, " << name(from) << " -> " << name(to) << ", n " << n
                    << ", element " << i;
                want_sum += static_cast<double>(want) * want;
              }
              ASSERT_EQ(dst.at(n), -5.0f) << "written past the end, n " << n;
              // The squares are of what was written; the order of the sum is
              // the kernel's, so only close to this one.
              EXPECT_NEAR(sum, want_sum, 1e-12 * want_sum) << simd << ", n " << n;
            }
          }
        }
      }
    }
  }
}

TEST(convert, onto_itself_in_one_dtype) {
  executor ex(2);
  std::vector<float> v = test::normal_values(40000, 3);
  const std::vector<float> before = v;
  convert(ex, v.data(), dtype::fp32, v.data(), dtype::fp32, 0.5f, v.size());
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], before[i] * 0.5f) << i;
}

TEST(sum_of_squares, has_the_same_bits_on_every_thread_count_and_target) {
  for (const dtype type : all_dtypes) {
    for (const std::size_t n : sizes) {
      test::typed_buffer data(type, test::normal_values(n, 5 + static_cast<unsigned>(n), 1e-3f, 2e-4f));
      long double exact = 0;
      for (std::size_t i = 0; i < n; ++i) exact += static_cast<long double>(data.at(i)) * data.at(i);
      std::optional<std::uint64_t> first;
      for (const int threads : {1, 2, 3}) {
        for (const std::string& simd : simd_targets()) {
          executor ex(threads, simd);
          const double got = sum_of_squares(ex, data.data(), type, n);
          EXPECT_NEAR(got, static_cast<double>(exact), 1e-12 * static_cast<double>(exact))
              << name(type) << ", n " << n << ", " << simd;
          std::uint64_t bits;
          std::memcpy(&bits, &got, sizeof bits);
          if (!first) first = bits;
          EXPECT_EQ(bits, *first) << name(type) << ", n " << n << ", " << simd << ", " << threads << " threads";
          double fused = -1;
          std::vector<float> copy(n);
          convert(ex, data.data(), type, copy.data(), dtype::fp32, 1.0f, n, &fused);
          EXPECT_EQ(fused, got) << "the fused sum differs from sum_of_squares, " << simd;
        }
      }
    }
  }
}

TEST(sum_of_squares, an_inf_or_a_nan_anywhere_is_not_finite) {
  executor ex(3);
  for (const float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()}) {
    for (const std::size_t at : {std::size_t{0}, std::size_t{16384 + 3}, std::size_t{3 * 16384 + 4}}) {
      std::vector<float> v = test::normal_values(3 * 16384 + 5, 9);
      v[at] = bad;
      EXPECT_FALSE(std::isfinite(sum_of_squares(ex, v.data(), dtype::fp32, v.size()))) << bad << " at " << at;
    }
  }
  // The largest fp32 squared, a million times over, stays finite in fp64.
  std::vector<float> big(1 << 20, std::numeric_limits<float>::max());
  EXPECT_TRUE(std::isfinite(sum_of_squares(ex, big.data(), dtype::fp32, big.size())));
}

}  // namespace
}  // namespace tierflow::optim
