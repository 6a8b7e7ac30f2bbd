#include <string>

#include "tierflow/tiers/cuda_probe.hpp"

namespace tierflow::tiers {

std::string cuda_version_string(int version) {
  if (version <= 0) return "none";
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

}  // namespace tierflow::tiers
