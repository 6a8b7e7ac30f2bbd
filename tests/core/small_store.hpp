// What the tests of state streamed through a real store share: a small store
// (an unpinned host tier of a given budget, an NVMe tier of 1 MiB files in a
// test's directory) and the bytes a link of it moved.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "tierflow/core/store.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace tierflow::testing {

inline std::unique_ptr<block_store> small_store(const std::string& dir, std::uint64_t host_budget) {
  tiers::store_config c;
  c.host = tiers::host_tier_options{.budget = host_budget, .pin = tiers::pinning::none, .touch_threads = 1};
  c.nvme = tiers::nvme_tier_options{.directory = dir + "/nvme", .budget = 64ull << 20, .file_size = 1ull << 20};
  c.store.trace = false;
  return tiers::make_store(std::move(c));
}

inline std::uint64_t link_bytes(const block_store& store, const std::string& name) {
  for (const auto& l : store.telemetry().links) {
    if (l.name == name) return l.bytes;
  }
  ADD_FAILURE() << "no link " << name;
  return 0;
}

}  // namespace tierflow::testing
