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

enum class strategy { sync, pipelined, zenflow };
enum class device_kind { sim, cuda };
enum class optimizer_kind { adamw, muon };

struct offload_options {
  std::string model = "gpt2-medium";
  device_kind device = device_kind::sim;
  int cuda_device = 0;                           // --device cuda:N
  std::uint64_t host_memory = 2ull << 30;
  std::string nvme_dir;  // empty: the state stays in host memory (it must fit)
  optimizer_kind optimizer = optimizer_kind::adamw;
  bench::strategy strategy = strategy::zenflow;
  std::uint64_t steps = 12;
  sim_device device_model;
  std::uint64_t batch_tokens = 16384;
  std::uint64_t update_interval = 4;
  double topk_ratio = 0.1;
  std::optional<std::uint64_t> select_interval;  // default: 100 windows (refreshes are rare)
  bool overlap = true;                           // zenflow's overlap_step
  double reserved_cores = 0.5;                   // pt_reserved_cores_perc
  unsigned threads = 0;                          // optimizer threads; 0: from reserved_cores
  std::uint64_t sub_group_elements = 4ull << 20; // largest sub-group the optimizer streams
  unsigned depth = 3;                            // sub-groups resident while streaming
  std::string trace_path;                        // Perfetto trace; empty: none
};

const char* to_string(strategy s);
const char* to_string(optimizer_kind o);
strategy parse_strategy(const std::string& text);        // throws user_error naming --strategy
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
  unsigned optimizer_threads = 1;
  double step_compute_seconds = 0;  // modelled device compute per step
  std::uint64_t gradient_bytes = 0;  // bf16 gradient of every parameter: what goes device → host
  std::uint64_t parameter_bytes = 0;  // bf16 parameters: what goes host → device
};

// What the run's NVMe tier holds beyond the state (its files' rounding).
inline constexpr std::uint64_t nvme_slack = 64ull << 20;

// Checks `options` and builds the plan, or throws user_error with one line
// naming the flag (and, for budgets too small, the minimum that would do).
offload_plan make_plan(const offload_options& options);

}  // namespace tierflow::bench
