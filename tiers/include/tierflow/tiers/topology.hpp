// The host as the tiers see it: cores, NUMA nodes and their memory (hwloc),
// and how much memory this process may pin (RLIMIT_MEMLOCK).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tierflow::tiers {

struct numa_node {
  unsigned os_index = 0;
  std::uint64_t memory_bytes = 0;  // local memory of the node
  std::vector<unsigned> cpus;      // OS indices of its logical CPUs
};

struct host_topology {
  unsigned cpus = 0;            // logical CPUs (hardware threads) this process may run on
  unsigned physical_cores = 0;
  unsigned packages = 0;
  std::vector<numa_node> numa_nodes;  // at least one
  std::uint64_t total_memory_bytes = 0;
  std::uint64_t available_memory_bytes = 0;  // MemAvailable
  // RLIMIT_MEMLOCK soft limit; nullopt when unlimited.
  std::optional<std::uint64_t> memlock_limit_bytes;
};

// Probes the host with hwloc. Throws tierflow::error when hwloc cannot load
// the topology.
host_topology probe_host();

}  // namespace tierflow::tiers
