#include "tierflow/tiers/topology.hpp"

#include <hwloc.h>
#include <sys/resource.h>

#include <cerrno>
#include <fstream>
#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::tiers {
namespace {

// Owns an hwloc topology.
class topology_handle {
 public:
  topology_handle() {
    if (hwloc_topology_init(&topo_) != 0) throw error(errno, error_context{"hwloc_topology_init"});
    if (hwloc_topology_load(topo_) != 0) {
      const int err = errno;
      hwloc_topology_destroy(topo_);
      throw error(err, error_context{"hwloc_topology_load"});
    }
  }
  ~topology_handle() { hwloc_topology_destroy(topo_); }
  topology_handle(const topology_handle&) = delete;
  topology_handle& operator=(const topology_handle&) = delete;
  hwloc_topology_t get() const { return topo_; }

 private:
  hwloc_topology_t topo_ = nullptr;
};

std::uint64_t meminfo_bytes(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with(key + ":")) return std::stoull(line.substr(key.size() + 1)) * 1024;
  }
  return 0;
}

}  // namespace

host_topology probe_host() {
  topology_handle topo;
  host_topology out;
  out.cpus = static_cast<unsigned>(std::max(0, hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_PU)));
  out.physical_cores =
      static_cast<unsigned>(std::max(0, hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_CORE)));
  out.packages =
      static_cast<unsigned>(std::max(0, hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_PACKAGE)));

  const int nodes = hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < nodes; ++i) {
    hwloc_obj_t obj = hwloc_get_obj_by_type(topo.get(), HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
    numa_node node;
    node.os_index = obj->os_index;
    node.memory_bytes = obj->attr ? obj->attr->numanode.local_memory : 0;
    unsigned cpu = 0;
    hwloc_bitmap_foreach_begin(cpu, obj->cpuset) { node.cpus.push_back(cpu); }
    hwloc_bitmap_foreach_end();
    out.numa_nodes.push_back(std::move(node));
  }
  out.total_memory_bytes = meminfo_bytes("MemTotal");
  out.available_memory_bytes = meminfo_bytes("MemAvailable");
  if (out.numa_nodes.empty()) {
    // hwloc always reports one node; keep the contract if it ever does not.
    out.numa_nodes.push_back({0, out.total_memory_bytes, {}});
  }

  rlimit lim{};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    out.memlock_limit_bytes = lim.rlim_cur;
  }
  return out;
}

}  // namespace tierflow::tiers
