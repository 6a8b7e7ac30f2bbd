#include "tierflow/core/dtype.hpp"

#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow {

dtype parse_dtype(std::string_view text, std::string_view what) {
  if (text == "fp32" || text == "float32" || text == "f32") return dtype::fp32;
  if (text == "bf16" || text == "bfloat16") return dtype::bf16;
  if (text == "fp16" || text == "float16" || text == "half") return dtype::fp16;
  throw user_error(std::string(what) + ": unknown dtype '" + std::string(text) +
                   "' (expected fp32, bf16 or fp16)");
}

}  // namespace tierflow
