// `tierflow info [--path DIR] [--json]`: what this machine offers tierflow,
// every fact probed: CPU and SIMD level, cores and NUMA nodes, memory and the
// pinning limit, io_uring, CUDA devices, and for --path the filesystem.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/tiers/machine_info.hpp"

namespace tierflow::cli {
namespace {

using nlohmann::json;

struct info_options {
  std::string path;
  bool as_json = false;
};

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
    const json j = tiers::machine_info(opt->path);
    if (opt->as_json) std::cout << j.dump(2) << '\n';
    else print_human(j);
  });
}

}  // namespace tierflow::cli
