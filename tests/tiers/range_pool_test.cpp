#include "tierflow/tiers/range_pool.hpp"

#include <gtest/gtest.h>

#include "tierflow/core/tier.hpp"

namespace tierflow::tiers {
namespace {

TEST(range_pool, first_fit_and_merging) {
  range_pool p(16 * 4096);
  const auto a = p.allocate(4 * 4096);
  const auto b = p.allocate(4 * 4096);
  const auto c = p.allocate(4 * 4096);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(*b, 4u * 4096);
  EXPECT_FALSE(p.allocate(8 * 4096).has_value());
  p.free(*b, 4 * 4096);
  EXPECT_EQ(p.largest_free(), 4u * 4096);
  p.free(*c, 4 * 4096);  // merges with b's range and the tail
  EXPECT_EQ(p.largest_free(), 12u * 4096);
  EXPECT_EQ(p.fragments(), 1u);
  p.free(*a, 4 * 4096);
  EXPECT_EQ(p.free_bytes(), 16u * 4096);
  EXPECT_EQ(p.fragments(), 1u);
}

TEST(tier_budget, charges_within_budget_and_names_everything_beyond) {
  tier_budget b("host", 8192);
  b.charge(4096, "a");
  EXPECT_TRUE(b.fits(4096));
  EXPECT_FALSE(b.fits(4097));
  try {
    b.charge(8192, "layers.1.w");
    FAIL();
  } catch (const budget_exceeded& e) {
    EXPECT_STREQ(e.what(), "tier host: cannot allocate 8.00 KiB for block \"layers.1.w\": budget 8.00 KiB, 4.00 KiB in use");
    EXPECT_EQ(e.request(), 8192u);
    EXPECT_EQ(e.budget(), 8192u);
  }
  EXPECT_EQ(b.used(), 4096u);
  b.charge(4096, "b");
  EXPECT_EQ(b.high_water(), 8192u);
  b.discharge(8192);
  EXPECT_EQ(b.used(), 0u);
  EXPECT_EQ(b.high_water(), 8192u);
}

}  // namespace
}  // namespace tierflow::tiers
