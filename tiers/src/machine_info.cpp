#include "tierflow/tiers/machine_info.hpp"

#include <optional>

#include "tierflow/core/cpu.hpp"
#include "tierflow/core/version.hpp"
#include "tierflow/io/probe.hpp"
#include "tierflow/tiers/cuda_probe.hpp"
#include "tierflow/tiers/topology.hpp"

namespace tierflow::tiers {
namespace {

using nlohmann::json;

json optional_json(const std::optional<std::uint64_t>& v) { return v ? json(*v) : json(nullptr); }

void add_host(json& j, const cpu_features& cpu, const host_topology& host) {
  j["cpu"] = {{"vendor", cpu.vendor}, {"model", cpu.model}, {"extensions", cpu.extensions}};
  j["simd"] = cpu.simd;
  j["cpus"] = host.cpus;
  j["physical_cores"] = host.physical_cores;
  j["packages"] = host.packages;
  j["numa_nodes"] = host.numa_nodes.size();
  json nodes = json::array();
  for (const auto& n : host.numa_nodes)
    nodes.push_back({{"node", n.os_index}, {"memory_bytes", n.memory_bytes}, {"cpus", n.cpus}});
  j["numa"] = nodes;
  j["memory"] = {{"total_bytes", host.total_memory_bytes},
                 {"available_bytes", host.available_memory_bytes},
                 {"memlock_limit_bytes", optional_json(host.memlock_limit_bytes)}};
}

json uring_json(const io::uring_capabilities& uring) {
  json ju = {{"available", uring.available}};
  if (!uring.available) ju["reason"] = uring.reason;
  ju["setup_flags"] = uring.setup_flags;
  ju["opcodes"] = uring.opcodes;
  ju["register_buffers"] = uring.register_buffers;
  ju["register_files"] = uring.register_files;
  return ju;
}

json cuda_json(const cuda_status& cuda) {
  json jc = {{"available", cuda.available},
             {"compiled", cuda.compiled},
             {"driver_version", cuda_version_string(cuda.driver_version)},
             {"runtime_version", cuda_version_string(cuda.runtime_version)}};
  if (!cuda.available) jc["reason"] = cuda.reason;
  json devices = json::array();
  for (const auto& d : cuda.devices) {
    devices.push_back({{"index", d.index},
                       {"name", d.name},
                       {"pci_bus_id", d.pci_bus_id},
                       {"compute_capability", std::to_string(d.compute_capability_major) + "." +
                                                  std::to_string(d.compute_capability_minor)},
                       {"memory_bytes", d.memory_bytes},
                       {"copy_engines", d.copy_engines},
                       {"numa_node", d.numa_node}});
  }
  jc["devices"] = devices;
  return jc;
}

json path_json(const io::path_capabilities& p) {
  json jp = {{"path", p.path},
             {"mount_point", p.mount_point},
             {"filesystem", p.filesystem},
             {"device", p.device},
             {"o_direct", p.o_direct},
             {"direct_memory_alignment", optional_json(p.direct_memory_alignment)},
             {"direct_offset_alignment", optional_json(p.direct_offset_alignment)},
             {"free_bytes", p.free_bytes},
             {"total_bytes", p.total_bytes}};
  if (!p.o_direct) jp["o_direct_reason"] = p.o_direct_reason;
  return jp;
}

}  // namespace

json machine_info(const std::string& path) {
  json j;
  j["version"] = tierflow::version;
  add_host(j, probe_cpu(), probe_host());
  j["io_uring"] = uring_json(io::probe_uring());
  j["cuda"] = cuda_json(probe_cuda());
  if (!path.empty()) j["path"] = path_json(io::probe_path(path));
  return j;
}

}  // namespace tierflow::tiers
