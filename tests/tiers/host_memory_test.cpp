// Host regions: exact size, pre-touched, pinned (or saying why not), NUMA-bound.
#include "tierflow/tiers/host_memory.hpp"

#include <gtest/gtest.h>

#include <cstring>

#include "tierflow/core/error.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace tierflow::tiers {
namespace {

TEST(host_region, exact_size_pre_touched_and_pinned_or_reported) {
  host_region r = host_region::map({.bytes = (3u << 20) + 4096, .touch_threads = 3});
  EXPECT_EQ(r.size(), (3u << 20) + 4096);  // page-aligned, not a power of two
  ASSERT_NE(r.data(), nullptr);
  std::memset(r.data(), 0xab, r.size());
  if (r.pinned_by() == "none") {
    EXPECT_FALSE(r.pin_note().empty()) << "unpinned without a reason";
  } else {
    EXPECT_TRUE(r.pinned_by() == "mlock" || r.pinned_by() == "cuda_host_register") << r.pinned_by();
  }
  host_region moved = std::move(r);
  EXPECT_EQ(r.data(), nullptr);
  EXPECT_EQ(moved.size(), (3u << 20) + 4096);
}

TEST(host_region, huge_pages_fall_back_when_none_are_reserved) {
  host_region r = host_region::map({.bytes = 4u << 20, .pages = huge_pages::hugetlb, .pin = pinning::none});
  EXPECT_TRUE(r.page_backing() == "hugetlb" || r.page_backing() == "transparent" ||
              r.page_backing() == "off");
  r.data()[r.size() - 1] = std::byte{1};
}

TEST(host_region, numa_binding_to_node_zero) {
  host_region r = host_region::map({.bytes = 1u << 20, .numa_node = 0, .pin = pinning::none});
  EXPECT_TRUE(r.numa_node() == 0 || r.numa_node() == -1);
}

TEST(host_region, zero_bytes_is_a_user_error) {
  EXPECT_THROW(host_region::map({.bytes = 0}), user_error);
}

TEST(device_tier, stand_in_without_a_gpu_and_cuda_only_with_one) {
  auto t = make_device_tier({.budget = 1u << 20, .backend = device_backend::stand_in});
  EXPECT_EQ(t->kind(), tier_kind::device);
  EXPECT_EQ(t->memory(), memory_kind::host);
  EXPECT_EQ(t->budget(), 1u << 20);
  if (!cuda_device_present()) {
    EXPECT_THROW(make_device_tier({.budget = 1u << 20, .backend = device_backend::cuda}), user_error);
    auto automatic = make_device_tier({.budget = 1u << 20});
    EXPECT_EQ(automatic->memory(), memory_kind::host);
  } else {
    auto cuda = make_device_tier({.budget = 1u << 20, .backend = device_backend::cuda});
    EXPECT_EQ(cuda->memory(), memory_kind::device);
    const tier_allocation a = cuda->allocate(1u << 20, "x");
    EXPECT_THROW(cuda->allocate(4096, "y"), budget_exceeded);
    cuda->deallocate(a);
  }
}

}  // namespace
}  // namespace tierflow::tiers
