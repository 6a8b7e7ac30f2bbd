// What the ZenFlow tests share: a config with every interval a fixed number
// of steps, and reproducible initial values per weight.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

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

// n values uniform in [-1, 1), the same for the same weight index.
inline std::vector<float> initial(std::size_t w, std::size_t n) {
  std::vector<float> v(n);
  std::mt19937 rng(static_cast<unsigned>(w + 77));
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : v) x = u(rng);
  return v;
}

}  // namespace tierflow::zenflow
