#include <gtest/gtest.h>

#include "tierflow/core/dtype.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow {
namespace {

TEST(dtype, sizes_names_and_parse) {
  EXPECT_EQ(size_of(dtype::fp32), 4u);
  EXPECT_EQ(size_of(dtype::bf16), 2u);
  EXPECT_EQ(size_of(dtype::fp16), 2u);
  for (dtype t : {dtype::fp32, dtype::bf16, dtype::fp16}) EXPECT_EQ(parse_dtype(name(t), "--x"), t);
  EXPECT_EQ(parse_dtype("bfloat16", "--x"), dtype::bf16);
  EXPECT_EQ(parse_dtype("half", "--x"), dtype::fp16);
  EXPECT_THROW(parse_dtype("fp8", "--x"), user_error);
  try {
    parse_dtype("int4", "--state-dtype");
  } catch (const user_error& e) {
    EXPECT_STREQ(e.what(), "--state-dtype: unknown dtype 'int4' (expected fp32, bf16 or fp16)");
  }
}

}  // namespace
}  // namespace tierflow
