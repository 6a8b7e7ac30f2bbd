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

TEST(range_pool, small_ranges_go_to_the_top_so_large_holes_stay_whole) {
  // 8 MiB: weights of 2 MiB and, beside each, a 4 KiB bias that stays.
  constexpr std::uint64_t kib = 1024, mib = 1024 * kib;
  range_pool p(8 * mib);
  EXPECT_TRUE(p.small(4 * kib));
  EXPECT_FALSE(p.small(2 * mib));
  for (int step = 0; step < 100; ++step) {
    const auto w = p.allocate(2 * mib);  // the weight of layer `step`
    ASSERT_TRUE(w.has_value()) << "step " << step << ": largest free " << p.largest_free();
    EXPECT_LT(*w + 2 * mib, 7 * mib);   // from the bottom
    if (step < 24) {
      const auto b = p.allocate(4 * kib);  // its bias, resident for the rest of the run
      ASSERT_TRUE(b.has_value());
      EXPECT_EQ(*b, 8 * mib - (step + 1) * 4 * kib);  // packed at the top
    }
    p.free(*w, 2 * mib);
  }
  EXPECT_EQ(p.fragments(), 1u);
  EXPECT_EQ(p.largest_free(), 8 * mib - 24 * 4 * kib);
  // A small range that only the lowest hole can take still gets it.
  range_pool q(64 * 4096);
  const auto big = q.allocate(63 * 4096);
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(*big, 0u);
  EXPECT_EQ(q.allocate(4096), std::optional<std::uint64_t>(63 * 4096));
  EXPECT_FALSE(q.allocate(4096).has_value());
  q.free(*big, 63 * 4096);
  EXPECT_EQ(q.allocate(2 * 4096), std::optional<std::uint64_t>(61 * 4096));
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
