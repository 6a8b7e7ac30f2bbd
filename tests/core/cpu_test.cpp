#include "tierflow/core/cpu.hpp"

#include <algorithm>
#include <set>

#include <gtest/gtest.h>

namespace tierflow {
namespace {

bool has(const cpu_features& f, const std::string& ext) {
  return std::find(f.extensions.begin(), f.extensions.end(), ext) != f.extensions.end();
}

TEST(Cpu, SimdLevelIsOneOfTheNamedOnesAndConsistentWithItsExtensions) {
  const cpu_features f = probe_cpu();
  const std::set<std::string> levels = {"scalar", "avx2", "avx512", "avx512-bf16", "amx", "neon", "sve"};
  EXPECT_TRUE(levels.contains(f.simd)) << f.simd;
  EXPECT_FALSE(f.model.empty());
  if (f.simd == "avx2") {
    EXPECT_TRUE(has(f, "avx2") && has(f, "fma"));
  }
  if (f.simd.starts_with("avx512") || f.simd == "amx") {
    EXPECT_TRUE(has(f, "avx512f") && has(f, "avx512bw"));
  }
  if (f.simd == "avx512-bf16") {
    EXPECT_TRUE(has(f, "avx512_bf16"));
  }
#if defined(__x86_64__)
  // The compiler's own view of the running CPU must agree on the basics.
  __builtin_cpu_init();
  EXPECT_EQ(has(f, "avx2"), static_cast<bool>(__builtin_cpu_supports("avx2")));
  EXPECT_EQ(has(f, "avx512f"), static_cast<bool>(__builtin_cpu_supports("avx512f")));
#endif
}

}  // namespace
}  // namespace tierflow
