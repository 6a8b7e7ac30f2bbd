// `tierflow info [--path DIR] [--json]`: what this machine offers tierflow,
// every fact probed: CPU and SIMD level, cores and NUMA nodes, memory and the
// pinning limit, io_uring, CUDA devices, and for --path the filesystem.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "tierflow/core/cpu.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/core/version.hpp"
#include "tierflow/io/probe.hpp"
#include "tierflow/tiers/cuda_probe.hpp"
#include "tierflow/tiers/topology.hpp"

namespace tierflow::cli {
namespace {

using nlohmann::json;

struct info_options {
  std::string path;
  bool as_json = false;
};

json optional_json(const std::optional<std::uint64_t>& v) { return v ? json(*v) : json(nullptr); }

json collect(const info_options& opt) {
  const cpu_features cpu = probe_cpu();
  const tiers::host_topology host = tiers::probe_host();
  const io::uring_capabilities& uring = io::probe_uring();
  const tiers::cuda_status cuda = tiers::probe_cuda();

  json j;
  j["version"] = tierflow::version;
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

  json ju = {{"available", uring.available}};
  if (!uring.available) ju["reason"] = uring.reason;
  ju["setup_flags"] = uring.setup_flags;
  ju["opcodes"] = uring.opcodes;
  ju["register_buffers"] = uring.register_buffers;
  ju["register_files"] = uring.register_files;
  j["io_uring"] = ju;

  json jc = {{"available", cuda.available},
             {"compiled", cuda.compiled},
             {"driver_version", tiers::cuda_version_string(cuda.driver_version)},
             {"runtime_version", tiers::cuda_version_string(cuda.runtime_version)}};
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
  j["cuda"] = jc;

  if (!opt.path.empty()) {
    const io::path_capabilities p = io::probe_path(opt.path);
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
    j["path"] = jp;
  }
  return j;
}

std::string yes_no(bool b) { return b ? "yes" : "no"; }

std::string list_true(const json& flags) {
  std::string out;
  for (const auto& [name, on] : flags.items()) {
    if (on.get<bool>()) out += (out.empty() ? "" : " ") + name;
  }
  return out.empty() ? "none" : out;
}

void print_human(const json& j) {
  auto row = [](const char* key, const std::string& value) {
    std::printf("  %-22s %s\n", key, value.c_str());
  };
  std::printf("tierflow %s\n\nhost\n", j["version"].get<std::string>().c_str());
  row("cpu", j["cpu"]["model"].get<std::string>());
  row("simd", j["simd"].get<std::string>());
  row("cpus", std::to_string(j["cpus"].get<int>()) + " logical, " +
                  std::to_string(j["physical_cores"].get<int>()) + " cores");
  row("memory", format_bytes(j["memory"]["total_bytes"].get<double>()) + " total, " +
                    format_bytes(j["memory"]["available_bytes"].get<double>()) + " available");
  const json& memlock = j["memory"]["memlock_limit_bytes"];
  row("memlock limit", memlock.is_null() ? "unlimited" : format_bytes(memlock.get<double>()));
  for (const auto& n : j["numa"]) {
    const std::string key = "numa node " + std::to_string(n["node"].get<int>());
    row(key.c_str(), format_bytes(n["memory_bytes"].get<double>()) + ", " +
                         std::to_string(n["cpus"].size()) + " cpus");
  }

  std::printf("\nio_uring\n");
  const json& u = j["io_uring"];
  row("available", u["available"].get<bool>() ? "yes" : "no (" + u["reason"].get<std::string>() + ")");
  if (u["available"].get<bool>()) {
    row("setup flags", list_true(u["setup_flags"]));
    row("opcodes", list_true(u["opcodes"]));
    row("registered buffers", yes_no(u["register_buffers"].get<bool>()));
    row("registered files", yes_no(u["register_files"].get<bool>()));
  }

  std::printf("\ncuda\n");
  const json& c = j["cuda"];
  row("available", c["available"].get<bool>() ? "yes" : "no (" + c["reason"].get<std::string>() + ")");
  row("driver / runtime", c["driver_version"].get<std::string>() + " / " +
                              c["runtime_version"].get<std::string>());
  for (const auto& d : c["devices"]) {
    const std::string key = "gpu " + std::to_string(d["index"].get<int>());
    row(key.c_str(), d["name"].get<std::string>() + ", " +
                         format_bytes(d["memory_bytes"].get<double>()) + ", sm_" +
                         d["compute_capability"].get<std::string>() + ", " +
                         std::to_string(d["copy_engines"].get<int>()) + " copy engines, numa node " +
                         std::to_string(d["numa_node"].get<int>()) + ", pci " +
                         d["pci_bus_id"].get<std::string>());
  }

  if (j.contains("path")) {
    const json& p = j["path"];
    std::printf("\npath %s\n", p["path"].get<std::string>().c_str());
    row("filesystem", p["filesystem"].get<std::string>() + " on " + p["device"].get<std::string>() +
                          " (mounted at " + p["mount_point"].get<std::string>() + ")");
    row("O_DIRECT", p["o_direct"].get<bool>() ? "yes" : "no (" + p["o_direct_reason"].get<std::string>() + ")");
    row("free", format_bytes(p["free_bytes"].get<double>()) + " of " +
                    format_bytes(p["total_bytes"].get<double>()));
  }
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto opt = std::make_shared<info_options>();
  CLI::App* cmd = app.add_subcommand("info", "Report what this machine offers tierflow (all probed)");
  cmd->add_option("--path", opt->path, "Also probe this directory: filesystem, O_DIRECT, free space");
  cmd->add_flag("--json", opt->as_json, "One JSON object on stdout instead of the table");
  cmd->callback([opt] {
    const json j = collect(*opt);
    if (opt->as_json) std::cout << j.dump(2) << '\n';
    else print_human(j);
  });
}

}  // namespace tierflow::cli
