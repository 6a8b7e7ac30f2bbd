#include "tierflow/core/units.hpp"

#include <gtest/gtest.h>

#include "tierflow/core/error.hpp"

namespace tierflow {
namespace {

TEST(Units, ParsesSuffixesAsPowersOfTwo) {
  EXPECT_EQ(parse_size("512", "--size"), 512u);
  EXPECT_EQ(parse_size("4K", "--size"), 4096u);
  EXPECT_EQ(parse_size("4k", "--size"), 4096u);
  EXPECT_EQ(parse_size("1M", "--size"), 1u << 20);
  EXPECT_EQ(parse_size("1MiB", "--size"), 1u << 20);
  EXPECT_EQ(parse_size("2GB", "--size"), 2ull << 30);
  EXPECT_EQ(parse_size("1.5G", "--size"), 3ull << 29);
  EXPECT_EQ(parse_size("1T", "--size"), 1ull << 40);
  EXPECT_EQ(parse_size("0", "--size", true), 0u);
}

TEST(Units, RejectsWithTheFlagNamed) {
  for (const char* bad : {"", "-1", "12X", "K", "1.3", "abc", "0", "99999999T"}) {
    try {
      parse_size(bad, "--block-size");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const user_error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--block-size: '", 0), 0u) << e.what();
    }
  }
}

TEST(Units, FormatsBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(1ull << 30), "1.00 GiB");
  EXPECT_EQ(format_rate(2.5 * (1ull << 30)), "2.50 GiB/s");
}

}  // namespace
}  // namespace tierflow
