// What `tierflow bench offload` will run, decided before any work starts:
// the options as given, checked; the model cut into the sub-groups the
// optimizer streams; and the host memory each part takes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "offload/model.hpp"
#include "offload/sim_device.hpp"
#include "tierflow/core/zenflow/engine.hpp"

namespace tierflow::bench {

// What is modelled, by the name users know it under:
//   zero_offload:  DeepSpeed's ZeRO-Offload — the gradient goes down while the
//                  backward runs, CPU Adam on every core once it has ended, the
//                  updated parameters go back up after; the state in host memory;
//   zero_infinity: the same with the state swapped from NVMe by DeepSpeed's
//                  pipelined read and write (read(i+1) ‖ update(i) ‖ write(i-1));
//   zenflow:       selective device updates, the rest in asynchronous windows.
enum class strategy { zero_offload, zero_infinity, zenflow };
enum class device_kind { sim, cuda };
enum class optimizer_kind { adamw, muon };

struct offload_options {
  std::string model = "gpt2-small";
  device_kind device = device_kind::sim;
  int cuda_device = 0;                           // --device cuda:N
  std::optional<std::uint64_t> host_memory;      // nullopt: what the run needs, if the machine has it
  std::string nvme_dir;  // empty: the state stays in host memory (it must fit)
  optimizer_kind optimizer = optimizer_kind::adamw;
  bench::strategy strategy = strategy::zenflow;
  std::uint64_t steps = 12;
  sim_device device_model;
  std::uint64_t batch_tokens = 65536;
  std::optional<std::uint64_t> update_interval = 4;  // nullopt: "auto" (the engine's trigger)
  double topk_ratio = 0.1;
  // Default: two windows (8 steps with "auto"), so a default run refreshes
  // the selection once and pays its pass over the state in its summary.
  std::optional<std::uint64_t> select_interval;
  bool overlap = true;                           // zenflow's overlap_step
  double reserved_cores = 0.5;                   // pt_reserved_cores_perc
  unsigned threads = 0;                          // optimizer threads; 0: from reserved_cores
  std::uint64_t sub_group_elements = 4ull << 20; // largest sub-group the optimizer streams
  unsigned depth = 3;                            // sub-groups resident while streaming
  std::string trace_path;                        // Perfetto trace; empty: none
};

// The printed and JSON name: "zero-offload", "zero-infinity", "zenflow".
const char* to_string(strategy s);
const char* to_string(optimizer_kind o);
// Also takes "sync" (zero-offload) and "pipelined" (zero-infinity); throws
// user_error naming --strategy.
strategy parse_strategy(const std::string& text);
optimizer_kind parse_optimizer(const std::string& text);  // throws user_error naming --optimizer
// "sim", "cuda" or "cuda:N"; throws user_error naming --device.
void parse_device(const std::string& text, offload_options& into);

// One sub-group of the optimizer's state: a column range of one weight (or
// the 1-D weights of a layer, concatenated).
struct chunk {
  zenflow::weight_shape shape;  // rows × cols, transposed layout
  bool muon = false;            // updated by Muon (a hidden matrix, whole)
};

struct memory_plan {
  std::uint64_t accumulators = 0;   // zenflow's gradient windows (fp32, one or two)
  std::uint64_t gradient_staging = 0;  // where the device's gradients land (pinned)
  std::uint64_t stream_tier = 0;    // the host tier the state streams through
  std::uint64_t state_bytes = 0;    // master + optimizer state, all sub-groups
  std::uint64_t largest_sub_group = 0;  // its blocks, aligned
  bool state_on_nvme = false;
};

// What the device holds during the run: the model's bf16 parameters and
// gradients, ZenFlow's device state, and the working set of the matmuls of
// one weight over one micro-batch (two activation buffers and two weight-sized
// buffers).
struct device_memory_plan {
  std::uint64_t parameters = 0;
  std::uint64_t gradients = 0;
  std::uint64_t zenflow_state = 0;  // masters and moments of the selected columns and 1-D weights, staging copies
  std::uint64_t working_set = 0;
  std::uint64_t micro_batch_tokens = 0;  // tokens per matmul
  std::uint64_t total() const { return parameters + gradients + zenflow_state + working_set; }
};

struct offload_plan {
  offload_options options;
  model_shape model;
  std::vector<chunk> chunks;
  memory_plan memory;
  device_memory_plan device_memory;
  std::string device_description;  // the modelled device, or the CUDA device found
  zenflow::config zenflow;  // for strategy::zenflow
  unsigned optimizer_threads = 1;   // zero-offload, zero-infinity: every core; zenflow: the unreserved share
  std::uint64_t host_memory = 0;    // as given, or what the run needs
  double step_compute_seconds = 0;  // modelled device compute per step
  // Modelled: the backward of the last micro-batch, which the baselines'
  // gradient download overlaps (4 of the 6 FLOPs per parameter and token).
  double last_backward_seconds = 0;
  std::uint64_t gradient_bytes = 0;  // bf16 gradient of every parameter: what goes device → host
  std::uint64_t parameter_bytes = 0;  // bf16 parameters: what goes host → device
};

// What the run's NVMe tier holds beyond the state (its files' rounding).
inline constexpr std::uint64_t nvme_slack = 64ull << 20;

// Checks `options` and builds the plan, or throws user_error with one line
// naming the flag (and, for budgets too small, the minimum that would do).
offload_plan make_plan(const offload_options& options);

}  // namespace tierflow::bench
