// tierflow.info(): the facts `tierflow info --json` reports, as a dict with
// the same keys and values, probed by the same core/, io/ and tiers/ calls.
#include <cstdint>
#include <optional>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "bindings.hpp"
#include "tierflow/core/cpu.hpp"
#include "tierflow/core/version.hpp"
#include "tierflow/io/probe.hpp"
#include "tierflow/tiers/cuda_probe.hpp"
#include "tierflow/tiers/topology.hpp"

namespace nb = nanobind;

namespace tierflow::python {
namespace {

template <class Value>
nb::object optional_value(const std::optional<Value>& v) {
  return v ? nb::cast(*v) : nb::none();
}

template <class Sequence>
nb::list list_of(const Sequence& items) {
  nb::list out;
  for (const auto& item : items) out.append(item);
  return out;
}

template <class Map>
nb::dict dict_of(const Map& flags) {
  nb::dict out;
  for (const auto& [name, on] : flags) out[name.c_str()] = on;
  return out;
}

// Everything info() reports, probed without the GIL (CUDA's driver and the
// directory probe can take a while).
struct machine_facts {
  cpu_features cpu;
  tiers::host_topology host;
  io::uring_capabilities uring;
  tiers::cuda_status cuda;
  std::optional<io::path_capabilities> path;
};

machine_facts probe_machine(const std::optional<std::string>& path) {
  nb::gil_scoped_release unlocked;
  machine_facts f{probe_cpu(), tiers::probe_host(), io::probe_uring(), tiers::probe_cuda(), std::nullopt};
  if (path && !path->empty()) f.path = io::probe_path(*path);
  return f;
}

void add_host_facts(nb::dict& j, const cpu_features& cpu, const tiers::host_topology& host) {
  nb::dict jcpu;
  jcpu["vendor"] = cpu.vendor;
  jcpu["model"] = cpu.model;
  jcpu["extensions"] = list_of(cpu.extensions);
  j["cpu"] = jcpu;
  j["simd"] = cpu.simd;
  j["cpus"] = host.cpus;
  j["physical_cores"] = host.physical_cores;
  j["packages"] = host.packages;
  j["numa_nodes"] = host.numa_nodes.size();
  nb::list nodes;
  for (const auto& n : host.numa_nodes) {
    nb::dict node;
    node["node"] = n.os_index;
    node["memory_bytes"] = n.memory_bytes;
    node["cpus"] = list_of(n.cpus);
    nodes.append(node);
  }
  j["numa"] = nodes;
  nb::dict memory;
  memory["total_bytes"] = host.total_memory_bytes;
  memory["available_bytes"] = host.available_memory_bytes;
  memory["memlock_limit_bytes"] = optional_value(host.memlock_limit_bytes);
  j["memory"] = memory;
}

nb::dict uring_facts(const io::uring_capabilities& uring) {
  nb::dict ju;
  ju["available"] = uring.available;
  if (!uring.available) ju["reason"] = uring.reason;
  ju["setup_flags"] = dict_of(uring.setup_flags);
  ju["opcodes"] = dict_of(uring.opcodes);
  ju["register_buffers"] = uring.register_buffers;
  ju["register_files"] = uring.register_files;
  return ju;
}

nb::dict cuda_facts(const tiers::cuda_status& cuda) {
  nb::dict jc;
  jc["available"] = cuda.available;
  jc["compiled"] = cuda.compiled;
  jc["driver_version"] = tiers::cuda_version_string(cuda.driver_version);
  jc["runtime_version"] = tiers::cuda_version_string(cuda.runtime_version);
  if (!cuda.available) jc["reason"] = cuda.reason;
  nb::list devices;
  for (const auto& d : cuda.devices) {
    nb::dict device;
    device["index"] = d.index;
    device["name"] = d.name;
    device["pci_bus_id"] = d.pci_bus_id;
    device["compute_capability"] = std::to_string(d.compute_capability_major) + "." +
                                   std::to_string(d.compute_capability_minor);
    device["memory_bytes"] = d.memory_bytes;
    device["copy_engines"] = d.copy_engines;
    device["numa_node"] = d.numa_node;
    devices.append(device);
  }
  jc["devices"] = devices;
  return jc;
}

nb::dict path_facts(const io::path_capabilities& p) {
  nb::dict jp;
  jp["path"] = p.path;
  jp["mount_point"] = p.mount_point;
  jp["filesystem"] = p.filesystem;
  jp["device"] = p.device;
  jp["o_direct"] = p.o_direct;
  jp["direct_memory_alignment"] = optional_value(p.direct_memory_alignment);
  jp["direct_offset_alignment"] = optional_value(p.direct_offset_alignment);
  jp["free_bytes"] = p.free_bytes;
  jp["total_bytes"] = p.total_bytes;
  if (!p.o_direct) jp["o_direct_reason"] = p.o_direct_reason;
  return jp;
}

nb::dict info(const std::optional<std::string>& path) {
  const machine_facts f = probe_machine(path);
  nb::dict j;
  j["version"] = tierflow::version;
  add_host_facts(j, f.cpu, f.host);
  j["io_uring"] = uring_facts(f.uring);
  j["cuda"] = cuda_facts(f.cuda);
  if (f.path) j["path"] = path_facts(*f.path);
  return j;
}

}  // namespace

void bind_info(nb::module_& m) {
  m.def("info", &info, nb::arg("path") = nb::none(),
        "What this machine offers tierflow, every fact probed: the dict `tierflow info --json`\n"
        "prints (CPU and SIMD level, cores and NUMA nodes, memory and the pinning limit,\n"
        "io_uring, CUDA devices; with `path`, that directory's filesystem, O_DIRECT and free\n"
        "space). A `path` that does not exist or cannot be written raises ValueError naming it.");
}

}  // namespace tierflow::python
