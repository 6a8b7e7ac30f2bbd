// What this machine offers tierflow, every fact probed, as one JSON object:
// the object `tierflow info --json` prints and `tierflow.info()` returns.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace tierflow::tiers {

// CPU and SIMD level, cores and NUMA nodes, memory and the pinning limit,
// io_uring, CUDA devices; with a non-empty `path`, also that directory's
// filesystem, O_DIRECT and free space under the key "path". Blocks while it
// probes (the CUDA driver and the directory probe can take a while). Throws
// user_error for a `path` that does not exist or cannot be written.
nlohmann::json machine_info(const std::string& path = {});

}  // namespace tierflow::tiers
