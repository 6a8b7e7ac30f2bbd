#include "offload/plan.hpp"

#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <thread>

#include "tierflow/core/block.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/tiers/cuda_probe.hpp"
#include "tierflow/tiers/topology.hpp"

namespace tierflow::bench {
namespace {

// Splits `w` into column ranges of at most `limit` elements (at least one column).
void add_chunks(const weight& w, bool muon, std::uint64_t limit, std::vector<chunk>& out) {
  // Stored transposed: a "column" of the optimizer's layout is a row of the
  // weight as written (rows × cols → cols columns of rows elements).
  const std::uint64_t rows = w.cols, cols = w.rows;
  if (muon) {  // Muon orthogonalises the whole matrix: never split
    out.push_back({{w.name, rows, cols}, true});
    return;
  }
  const std::uint64_t per = std::max<std::uint64_t>(1, limit / rows);
  for (std::uint64_t c = 0, k = 0; c < cols; c += per, ++k) {
    const std::uint64_t n = std::min(per, cols - c);
    out.push_back({{cols > per ? w.name + "#" + std::to_string(k) : w.name, rows, n}, false});
  }
}

// The 1-D weights of one layer, concatenated into one sub-group.
void add_vectors(const std::vector<weight>& ws, const std::string& name, std::vector<chunk>& out) {
  std::uint64_t n = 0;
  for (const auto& w : ws) n += w.matrix() ? 0 : w.elements();
  if (n > 0) out.push_back({{name, n, 1}, false});
}

}  // namespace

const char* to_string(strategy s) {
  switch (s) {
    case strategy::zero_offload: return "zero-offload";
    case strategy::zero_infinity: return "zero-infinity";
    case strategy::zenflow: return "zenflow";
  }
  return "?";
}

const char* to_string(optimizer_kind o) { return o == optimizer_kind::adamw ? "adamw" : "muon"; }

strategy parse_strategy(const std::string& text) {
  if (text == "zero-offload" || text == "sync") return strategy::zero_offload;
  if (text == "zero-infinity" || text == "pipelined") return strategy::zero_infinity;
  if (text == "zenflow") return strategy::zenflow;
  throw user_error("--strategy: '" + text + "' is not zero-offload (sync), zero-infinity (pipelined) or zenflow");
}

optimizer_kind parse_optimizer(const std::string& text) {
  if (text == "adamw") return optimizer_kind::adamw;
  if (text == "muon") return optimizer_kind::muon;
  throw user_error("--optimizer: '" + text + "' is not adamw or muon");
}

void parse_device(const std::string& text, offload_options& into) {
  if (text == "sim") {
    into.device = device_kind::sim;
    return;
  }
  if (text == "cuda") {
    into.device = device_kind::cuda;
    into.cuda_device = 0;
    return;
  }
  if (text.starts_with("cuda:") && text.size() > 5 && text.size() < 9 &&
      text.find_first_not_of("0123456789", 5) == std::string::npos) {
    into.device = device_kind::cuda;
    into.cuda_device = std::stoi(text.substr(5));
    return;
  }
  throw user_error("--device: '" + text + "' is not sim, cuda or cuda:N");
}

namespace {

// The CUDA device the run will use, or why it cannot: one line naming
// --device, before any work starts.
tiers::gpu find_cuda_device(const offload_options& o) {
  const tiers::cuda_status cuda = tiers::probe_cuda();
  if (!cuda.compiled)
    throw user_error("--device cuda: this tierflow was built without CUDA (TIERFLOW_CUDA=OFF or no nvcc found)");
  if (!cuda.available) throw user_error("--device cuda: no usable CUDA device (" + cuda.reason + ")");
  for (const auto& g : cuda.devices)
    if (g.index == o.cuda_device) return g;
  throw user_error("--device cuda:" + std::to_string(o.cuda_device) + ": there are " +
                   std::to_string(cuda.devices.size()) + " CUDA device(s), numbered from 0");
}

}  // namespace

namespace {

void check_flags(const offload_options& o) {
  if (o.steps == 0) throw user_error("--steps: must be at least 1");
  if (o.batch_tokens == 0) throw user_error("--batch-tokens: must be at least 1");
  auto positive = [](double v) { return v > 0 && std::isfinite(v); };
  if (!positive(o.device_model.tflops)) throw user_error("--device-tflops: must be a positive number");
  if (!positive(o.device_model.hbm_bytes_per_second)) throw user_error("--hbm-gbps: must be a positive number");
  if (!positive(o.device_model.pcie_bytes_per_second)) throw user_error("--pcie-gbps: must be a positive number");
  if (o.depth < 2) throw user_error("--depth: must be at least 2 (one sub-group updating, one loading)");
  if (o.sub_group_elements < 1024) throw user_error("--sub-group: must be at least 1K elements");
  if (o.strategy == strategy::zero_infinity && o.nvme_dir.empty())
    throw user_error("--strategy zero-infinity: swaps the optimizer state from NVMe; give --nvme-dir");
  // The summary leaves the first window out (warm-up) and needs one more.
  const std::uint64_t window = o.strategy == strategy::zenflow ? o.update_interval.value_or(1) : 1;
  if (o.steps < 2 * window)
    throw user_error("--steps: " + std::to_string(o.steps) + " steps hold fewer than two update windows of " +
                     std::to_string(window) + "; give at least " + std::to_string(2 * window));
}

// ZenFlow's settings, through the same checks a config file's would get.
zenflow::config zenflow_config(const offload_options& o) {
  if (o.select_interval == 0u) throw user_error("--select-interval: must be at least 1 (steps between refreshes)");
  zenflow::config c;
  c.topk_ratio = o.topk_ratio;
  c.strategy = zenflow::select_strategy::step;
  c.update_interval = o.update_interval;
  c.select_interval = o.select_interval.value_or(o.update_interval ? 2 * *o.update_interval : 8);
  c.overlap_step = o.overlap;
  c.pt_reserved_cores_perc = o.reserved_cores;
  try {
    zenflow::validate(c);
  } catch (const user_error& e) {
    std::string what = e.what();
    // Name the flags, not the config keys.
    if (what.starts_with("zenflow.topk_ratio")) what = "--topk-ratio" + what.substr(18);
    else if (what.starts_with("zenflow.update_interval")) what = "--update-interval" + what.substr(23);
    else if (what.starts_with("zenflow.select_interval")) what = "--select-interval" + what.substr(23);
    else if (what.starts_with("zenflow.pt_reserved_cores_perc")) what = "--reserved-cores" + what.substr(30);
    throw user_error(what);
  }
  return c;
}

// Sub-groups: every weight, cut along its columns; Muon's hidden matrices whole.
std::vector<chunk> cut_into_sub_groups(const model_shape& model, const offload_options& o) {
  std::vector<chunk> chunks;
  const bool muon = o.optimizer == optimizer_kind::muon;
  for (const auto& w : model.embedding) add_chunks(w, false, o.sub_group_elements, chunks);
  for (std::size_t l = 0; l < model.layers.size(); ++l) {
    for (const auto& w : model.layers[l]) {
      if (w.matrix()) add_chunks(w, muon, o.sub_group_elements, chunks);
    }
    add_vectors(model.layers[l], "layer" + std::to_string(l) + ".vectors", chunks);
  }
  for (const auto& w : model.head) {
    if (w.matrix()) add_chunks(w, false, o.sub_group_elements, chunks);
  }
  add_vectors(model.head, "head.vectors", chunks);
  return chunks;
}

struct state_totals {
  std::uint64_t state_bytes = 0, largest_sub_group = 0;  // master + state, aligned per block
  std::uint64_t elements = 0, largest_elements = 0, matrix_elements = 0, vector_elements = 0;
};

state_totals count_state(const std::vector<chunk>& chunks, optimizer_kind optimizer) {
  state_totals t;
  for (const auto& c : chunks) {
    const std::uint64_t n = c.shape.elements();
    // Master + moments (AdamW: 2; Muon: momentum); AdamW chunks of a Muon run keep two.
    const std::uint64_t blocks = (optimizer == optimizer_kind::muon && c.muon) ? 2 : 3;
    const std::uint64_t bytes = blocks * aligned_size(n * sizeof(float));
    t.largest_sub_group = std::max(t.largest_sub_group, bytes);
    t.state_bytes += bytes;
    t.elements += n;
    t.largest_elements = std::max(t.largest_elements, n);
    (c.shape.matrix() ? t.matrix_elements : t.vector_elements) += n;
  }
  return t;
}

std::string bytes_text(std::uint64_t bytes) { return format_bytes(static_cast<double>(bytes)); }

void check_nvme_space(const std::string& dir, std::uint64_t state_bytes) {
  struct statvfs fs{};
  if (::statvfs(dir.c_str(), &fs) != 0)
    throw user_error("--nvme-dir: cannot use '" + dir + "': " + std::strerror(errno));
  const std::uint64_t free = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (free < state_bytes + nvme_slack)
    throw user_error("--nvme-dir: '" + dir + "' has " + bytes_text(free) + " free; the optimizer state needs " +
                     bytes_text(state_bytes + nvme_slack));
}

// Host memory: gradient windows and staging first, the stream tier gets the
// rest. Without --host-memory the run takes what it needs, if the machine
// has that much available.
void plan_host_memory(offload_plan& plan, const state_totals& totals) {
  const offload_options& options = plan.options;
  memory_plan& memory = plan.memory;
  memory.state_bytes = totals.state_bytes;
  memory.largest_sub_group = totals.largest_sub_group;
  const bool zenflow = options.strategy == strategy::zenflow;
  memory.state_on_nvme = options.strategy == strategy::zero_infinity || (zenflow && !options.nvme_dir.empty());
  memory.gradient_staging = aligned_size(totals.largest_elements * sizeof(float));
  if (zenflow) memory.accumulators = (options.overlap ? 2 : 1) * totals.matrix_elements * sizeof(float);
  const std::uint64_t fixed = memory.accumulators + memory.gradient_staging;
  const std::uint64_t minimum_stream = options.depth * totals.largest_sub_group + (1u << 20);
  const std::uint64_t stream = memory.state_on_nvme ? minimum_stream : std::max(minimum_stream, totals.state_bytes);
  if (!options.host_memory) {
    const std::uint64_t available = tiers::probe_host().available_memory_bytes;
    if (fixed + stream > available)
      throw user_error("--host-memory: this run needs " + bytes_text(fixed + stream) + " and the machine has " +
                       bytes_text(available) + " available; give --nvme-dir, a smaller --model or --host-memory");
  }
  plan.host_memory = options.host_memory.value_or(fixed + stream);
  if (plan.host_memory < fixed + minimum_stream) {
    const std::string windows =
        memory.accumulators ? "the gradient windows (" + bytes_text(memory.accumulators) + ") and " : "";
    throw user_error("--host-memory: " + bytes_text(plan.host_memory) + " cannot hold " + windows +
                     std::to_string(options.depth) + " sub-groups of " + bytes_text(totals.largest_sub_group) +
                     "; it needs at least " + bytes_text(fixed + minimum_stream) + " (or a smaller --sub-group)");
  }
  memory.stream_tier = plan.host_memory - fixed;
  if (memory.state_on_nvme) check_nvme_space(options.nvme_dir, totals.state_bytes);
  if (!memory.state_on_nvme && totals.state_bytes > memory.stream_tier) {
    throw user_error("--host-memory: the optimizer state (" + bytes_text(totals.state_bytes) +
                     ") does not fit in the " + bytes_text(memory.stream_tier) + " left for it; " +
                     (zenflow ? "give --nvme-dir to keep it on NVMe, or " : "") + "at least " +
                     bytes_text(totals.state_bytes + fixed) + " of --host-memory");
  }
}

std::string cuda_description(const tiers::gpu& g) {
  return "CUDA device " + std::to_string(g.index) + ": " + g.name + " (sm_" +
         std::to_string(g.compute_capability_major) + std::to_string(g.compute_capability_minor) + ", " +
         bytes_text(g.memory_bytes) + ", " + std::to_string(g.copy_engines) + " copy engines)";
}

// The device: what it must hold, against what it has.
void plan_device(offload_plan& plan, const state_totals& totals) {
  const offload_options& options = plan.options;
  device_memory_plan& held = plan.device_memory;
  held.parameters = plan.parameter_bytes;
  held.gradients = plan.gradient_bytes;
  if (options.strategy == strategy::zenflow) {
    const double matrices = static_cast<double>(totals.matrix_elements);
    const auto selected = static_cast<std::uint64_t>(std::ceil(options.topk_ratio * matrices));
    // fp32 master and two moments of what the device owns, and a bf16
    // staging copy of every 2-D weight for the windows' uploads.
    held.zenflow_state = 12 * (selected + totals.vector_elements) + 2 * totals.matrix_elements;
  }
  std::uint64_t widest = 0, largest_matrix = 0;
  for (const auto& w : plan.model.matmuls()) {
    widest = std::max({widest, w.rows, w.cols});
    largest_matrix = std::max(largest_matrix, w.elements());
  }
  held.micro_batch_tokens = std::min<std::uint64_t>(options.batch_tokens, 8192);
  held.working_set = 2 * (2 * held.micro_batch_tokens * widest) + 2 * (2 * largest_matrix);  // bf16
  std::uint64_t device_bytes = options.device_model.memory_bytes;
  const char* memory_flag = "--device-memory";
  plan.device_description = options.device_model.describe();
  if (options.device == device_kind::cuda) {
    if (options.strategy == strategy::zenflow && options.optimizer == optimizer_kind::muon)
      throw user_error("--device cuda: ZenFlow with Muon runs on the simulated device only; the CUDA device side "
                       "updates with Adam/AdamW (use --optimizer adamw, or --strategy zero-offload or zero-infinity)");
    const tiers::gpu g = find_cuda_device(options);
    device_bytes = g.memory_bytes;
    memory_flag = "--device cuda";
    plan.device_description = cuda_description(g);
  }
  if (held.total() > device_bytes) {
    const std::string zenflow_state =
        held.zenflow_state ? ", ZenFlow's device state (" + bytes_text(held.zenflow_state) + ")" : "";
    throw user_error(std::string(memory_flag) + ": the device's " + bytes_text(device_bytes) +
                     " cannot hold the bf16 parameters and gradients (" +
                     bytes_text(held.parameters + held.gradients) + ")" + zenflow_state +
                     " and one layer's working set at " + std::to_string(held.micro_batch_tokens) + " tokens (" +
                     bytes_text(held.working_set) +
                     "); it needs at least " + bytes_text(held.total()));
  }
}

}  // namespace

offload_plan make_plan(const offload_options& options) {
  offload_plan plan;
  plan.options = options;
  check_flags(options);
  plan.model = make_model(options.model);
  plan.zenflow = zenflow_config(options);
  plan.chunks = cut_into_sub_groups(plan.model, options);
  const state_totals totals = count_state(plan.chunks, options.optimizer);
  plan.gradient_bytes = 2 * totals.elements;
  plan.parameter_bytes = 2 * totals.elements;
  plan_host_memory(plan, totals);

  // DeepSpeed's CPU Adam runs on every core; ZenFlow leaves the trainer its share.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const unsigned unreserved =
      std::max(1u, static_cast<unsigned>(std::lround(cores * (1.0 - options.reserved_cores))));
  const bool zenflow = options.strategy == strategy::zenflow;
  plan.optimizer_threads = options.threads ? options.threads : zenflow ? unreserved : cores;
  plan.step_compute_seconds = options.device_model.compute_seconds(plan.model.step_flops(options.batch_tokens));
  plan_device(plan, totals);
  plan.last_backward_seconds =
      options.device_model.compute_seconds(plan.model.step_flops(plan.device_memory.micro_batch_tokens)) * 4.0 / 6.0;
  return plan;
}

}  // namespace tierflow::bench
