// A ZenFlow config with every interval a fixed number of steps, for tests.
#pragma once

#include <cstdint>

#include "tierflow/core/zenflow/config.hpp"

namespace tierflow::zenflow {

inline config step_config(double topk, std::uint64_t update, std::uint64_t select, bool overlap,
                          std::uint64_t warm = 0) {
  config c;
  c.topk_ratio = topk;
  c.strategy = select_strategy::step;
  c.update_interval = update;
  c.select_interval = select;
  c.overlap_step = overlap;
  c.full_warm_up_rounds = warm;
  return c;
}

}  // namespace tierflow::zenflow
