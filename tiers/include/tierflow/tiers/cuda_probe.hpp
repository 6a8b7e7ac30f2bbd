// The CUDA devices this process can use, or why there are none.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tierflow::tiers {

struct gpu {
  int index = 0;
  std::string name;
  std::string pci_bus_id;  // "0000:3b:00.0"
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  std::uint64_t memory_bytes = 0;
  int copy_engines = 0;  // asyncEngineCount: concurrent copy engines (2 = H2D and D2H at once)
  int numa_node = -1;    // the host NUMA node nearest the device, -1 when unknown
};

struct cuda_status {
  bool compiled = false;   // this build has CUDA support
  bool available = false;  // at least one device is usable
  std::string reason;      // why not, when unavailable
  int driver_version = 0;   // e.g. 13000, 0 when there is no driver
  int runtime_version = 0;  // e.g. 13000
  std::vector<gpu> devices;
};

// Never throws for a missing driver or device: that is reported in `reason`.
cuda_status probe_cuda();

// "13.0" from 13000; "none" from 0.
std::string cuda_version_string(int version);

}  // namespace tierflow::tiers
