#include "tierflow/core/block.hpp"

#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow {

tier_kind parse_tier_kind(std::string_view text, std::string_view what) {
  for (tier_kind t : {tier_kind::device, tier_kind::host, tier_kind::nvme})
    if (text == name(t)) return t;
  throw user_error(std::string(what) + ": unknown tier '" + std::string(text) +
                   "' (expected device, host or nvme)");
}

block_desc validated(block_desc desc) {
  if (desc.name.empty()) throw user_error("block: the name is empty");
  if (!desc.shape.empty()) {
    std::uint64_t elements = 1;
    for (const std::int64_t extent : desc.shape) {
      if (extent <= 0)
        throw user_error("block \"" + desc.name + "\": shape extents must be positive");
      elements *= static_cast<std::uint64_t>(extent);
    }
    const std::uint64_t from_shape = elements * size_of(desc.type);
    if (desc.size_bytes == 0) desc.size_bytes = from_shape;
    if (desc.size_bytes != from_shape)
      throw user_error("block \"" + desc.name + "\": size " + std::to_string(desc.size_bytes) +
                       " bytes does not match its shape (" + std::to_string(from_shape) +
                       " bytes of " + std::string(name(desc.type)) + ")");
  }
  if (desc.size_bytes == 0) throw user_error("block \"" + desc.name + "\": size is zero");
  return desc;
}

}  // namespace tierflow
