// The CUDA side of probe_cuda(): compiled by nvcc for sm_90 whenever the
// build has CUDA, run wherever a driver and a device are present.
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <string>

#include "tierflow/tiers/cuda_probe.hpp"

namespace tierflow::tiers {
namespace {

int numa_node_of(std::string bus_id) {
  std::transform(bus_id.begin(), bus_id.end(), bus_id.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::ifstream in("/sys/bus/pci/devices/" + bus_id + "/numa_node");
  int node = -1;
  if (!(in >> node)) return -1;
  return node;
}

}  // namespace

cuda_status probe_cuda() {
  cuda_status out;
  out.compiled = true;
  cudaRuntimeGetVersion(&out.runtime_version);
  if (cudaDriverGetVersion(&out.driver_version) != cudaSuccess || out.driver_version == 0) {
    out.driver_version = 0;
    out.reason = "no CUDA driver (libcuda) on this machine";
    return out;
  }
  int count = 0;
  if (const cudaError_t rc = cudaGetDeviceCount(&count); rc != cudaSuccess) {
    (void)cudaGetLastError();
    out.reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(rc);
    return out;
  }
  if (count == 0) {
    out.reason = "no CUDA device visible (CUDA_VISIBLE_DEVICES?)";
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    gpu dev;
    dev.index = i;
    dev.name = prop.name;
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, i) == cudaSuccess) dev.pci_bus_id = bus;
    dev.compute_capability_major = prop.major;
    dev.compute_capability_minor = prop.minor;
    dev.memory_bytes = prop.totalGlobalMem;
    dev.copy_engines = prop.asyncEngineCount;
    dev.numa_node = numa_node_of(dev.pci_bus_id);
    out.devices.push_back(std::move(dev));
  }
  out.available = !out.devices.empty();
  if (!out.available) out.reason = "no device could be queried";
  return out;
}

}  // namespace tierflow::tiers
