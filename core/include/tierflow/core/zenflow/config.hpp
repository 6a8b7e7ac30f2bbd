// ZenFlow's settings, read from the same keys as DeepSpeed's
// `zero_optimization.zenflow` section, and the schedule they resolve to.
// See docs/zenflow.md for the method; this header only fixes what the keys mean.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace tierflow::zenflow {

// How a column's importance is scored from its gradient.
enum class importance_norm { l1, l2 };  // sum |g| (DeepSpeed's choice), or sum g^2 (the paper's)

enum class select_strategy {
  automatic,  // "auto": once per epoch
  step,       // "step": every select_interval steps
  epoch,      // "epoch": every select_interval epochs
};

struct config {
  double topk_ratio = 0.1;  // share of each 2-D weight's columns updated on the device, in (0, 1]
  select_strategy strategy = select_strategy::automatic;
  std::optional<std::uint64_t> select_interval;  // nullopt: "auto"
  std::optional<std::uint64_t> update_interval;  // nullopt: "auto" (from gradient mass)
  bool overlap_step = false;  // run the CPU step asynchronously, overlapped with the next steps
  double auto_ratio = 0.99;   // share of weights whose unimportant mass must catch up, in (0, 1]
  std::uint64_t full_warm_up_rounds = 0;
  double pt_reserved_cores_perc = 0.5;  // share of cores left to the trainer, in [0, 1)
  importance_norm norm = importance_norm::l1;  // tierflow's key: "importance_norm": "l1" | "l2"
  std::optional<std::uint64_t> steps_per_epoch;  // needed by the epoch strategies
};

// Reads a `zenflow` object with DeepSpeed's keys (unknown keys are refused, so
// a typo cannot silently fall back to a default). Throws user_error naming the
// key and the value for anything out of range. "offload" is accepted only as
// false: the device-side state always stays in device memory.
config from_json(const nlohmann::json& zenflow);

// Throws user_error when a value is out of range or the combination is
// inconsistent (select_interval < update_interval, a "step" strategy without a
// number, ...).
void validate(const config& c);

// What the engine runs: every value resolved to a number of steps.
struct schedule {
  std::uint64_t warm_up_steps = 0;   // steps 0 .. warm_up_steps-1 are full updates
  std::uint64_t select_interval = 0;  // steps between selection refreshes (≥ 1)
  std::optional<std::uint64_t> update_interval;  // nullopt: decided by gradient mass
  std::string select_interval_source;  // how select_interval was obtained, for the report
};

// Resolves `c` (validated first). An epoch strategy without steps_per_epoch
// does not freeze the selection for the whole run as DeepSpeed does; it
// refreshes every 10 update windows (or 100 steps with an automatic update
// interval) and says so in select_interval_source.
schedule resolve(const config& c);

// Step numbers are 0-based. True when step `s` ends with a CPU update of the
// host-side columns, for a fixed update interval. With an automatic interval
// the engine asks its update_trigger instead, and a refresh boundary is also
// an update boundary.
bool is_update_boundary(const schedule& s, std::uint64_t step);
// True when the selection is refreshed after step `s`.
bool is_select_boundary(const schedule& s, std::uint64_t step);

const char* to_string(importance_norm n);
const char* to_string(select_strategy s);

}  // namespace tierflow::zenflow
