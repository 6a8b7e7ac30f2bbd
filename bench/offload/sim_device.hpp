// The stated model of a device for `tierflow bench offload --device sim`:
// compute at a sustained rate, HBM at a stated bandwidth for ZenFlow's
// selective update, and a PCIe link with bandwidth and latency per direction.
// Only the device is modelled; the CPU optimizer and the NVMe I/O run for real.
#pragma once

#include <cstdint>
#include <string>

namespace tierflow::bench {

struct sim_device {
  // Sustained bf16 TFLOP/s of training matmuls. H100 SXM peaks at 989 dense;
  // 400 is the ~40% model-FLOPs utilisation large trainings report.
  double tflops = 400;
  std::uint64_t memory_bytes = 80ull << 30;
  double hbm_bytes_per_second = 3.35e12;  // H100 SXM's HBM3
  double pcie_bytes_per_second = 25e9;    // per direction, effective
  double pcie_latency_seconds = 10e-6;    // per transfer

  double compute_seconds(double flops) const { return flops / (tflops * 1e12); }
  // A memory-bound kernel that moves `bytes` through HBM.
  double hbm_seconds(std::uint64_t bytes) const { return static_cast<double>(bytes) / hbm_bytes_per_second; }
  double transfer_seconds(std::uint64_t bytes) const {
    return pcie_latency_seconds + static_cast<double>(bytes) / pcie_bytes_per_second;
  }
  // One line stating the model, printed with every result.
  std::string describe() const;
};

}  // namespace tierflow::bench
