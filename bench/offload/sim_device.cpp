#include "offload/sim_device.hpp"

#include <cstdio>

#include "tierflow/core/units.hpp"

namespace tierflow::bench {

std::string sim_device::describe() const {
  char line[400];
  std::snprintf(line, sizeof line,
                "simulated device: %.0f TFLOP/s sustained, %s memory, HBM %.0f GB/s for ZenFlow's selective "
                "update, PCIe %.1f GB/s per direction + %.0f us per transfer; column importances log-normal, "
                "the top 1%% of columns carrying 90%% of the gradient's squared norm (compute, HBM and link "
                "modelled; CPU optimizer and NVMe I/O real)",
                tflops, format_bytes(static_cast<double>(memory_bytes)).c_str(), hbm_bytes_per_second / 1e9,
                pcie_bytes_per_second / 1e9, pcie_latency_seconds * 1e6);
  return line;
}

}  // namespace tierflow::bench
