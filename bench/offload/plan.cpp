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
    case strategy::sync: return "sync";
    case strategy::pipelined: return "pipelined";
    case strategy::zenflow: return "zenflow";
  }
  return "?";
}

const char* to_string(optimizer_kind o) { return o == optimizer_kind::adamw ? "adamw" : "muon"; }

strategy parse_strategy(const std::string& text) {
  if (text == "sync") return strategy::sync;
  if (text == "pipelined") return strategy::pipelined;
  if (text == "zenflow") return strategy::zenflow;
  throw user_error("--strategy: '" + text + "' is not sync, pipelined or zenflow");
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

offload_plan make_plan(const offload_options& o) {
  offload_plan plan;
  plan.options = o;
  if (o.steps == 0) throw user_error("--steps: must be at least 1");
  if (o.batch_tokens == 0) throw user_error("--batch-tokens: must be at least 1");
  if (!(o.device_model.tflops > 0) || !std::isfinite(o.device_model.tflops))
    throw user_error("--device-tflops: must be a positive number");
  if (!(o.device_model.pcie_bytes_per_second > 0) || !std::isfinite(o.device_model.pcie_bytes_per_second))
    throw user_error("--pcie-gbps: must be a positive number");
  if (o.depth < 2) throw user_error("--depth: must be at least 2 (one sub-group updating, one loading)");
  if (o.sub_group_elements < 1024) throw user_error("--sub-group: must be at least 1K elements");

  plan.model = make_model(o.model);

  // ZenFlow's settings go through the same checks a config file's would.
  plan.zenflow.topk_ratio = o.topk_ratio;
  plan.zenflow.strategy = zenflow::select_strategy::step;
  plan.zenflow.update_interval = o.update_interval;
  plan.zenflow.select_interval = o.select_interval.value_or(100 * o.update_interval);
  plan.zenflow.overlap_step = o.overlap;
  plan.zenflow.pt_reserved_cores_perc = o.reserved_cores;
  try {
    zenflow::validate(plan.zenflow);
  } catch (const user_error& e) {
    std::string what = e.what();
    // Name the flags, not the config keys.
    if (what.starts_with("zenflow.topk_ratio")) what = "--topk-ratio" + what.substr(18);
    else if (what.starts_with("zenflow.update_interval")) what = "--update-interval" + what.substr(23);
    else if (what.starts_with("zenflow.select_interval")) what = "--select-interval" + what.substr(23);
    else if (what.starts_with("zenflow.pt_reserved_cores_perc")) what = "--reserved-cores" + what.substr(30);
    throw user_error(what);
  }

  // Sub-groups: every weight, cut along its columns; Muon's hidden matrices whole.
  const bool muon = o.optimizer == optimizer_kind::muon;
  for (const auto& w : plan.model.embedding) add_chunks(w, false, o.sub_group_elements, plan.chunks);
  for (std::size_t l = 0; l < plan.model.layers.size(); ++l) {
    for (const auto& w : plan.model.layers[l]) {
      if (w.matrix()) add_chunks(w, muon, o.sub_group_elements, plan.chunks);
    }
    add_vectors(plan.model.layers[l], "layer" + std::to_string(l) + ".vectors", plan.chunks);
  }
  for (const auto& w : plan.model.head) {
    if (w.matrix()) add_chunks(w, false, o.sub_group_elements, plan.chunks);
  }
  add_vectors(plan.model.head, "head.vectors", plan.chunks);

  // Host memory: gradient windows and staging first, the stream tier gets the rest.
  const std::uint64_t states = muon ? 2 : 3;  // master + moments (AdamW: 2, Muon: momentum)
  std::uint64_t largest = 0, total = 0, elements = 0;
  std::uint64_t largest_elements = 0, matrix_elements = 0, vector_elements = 0;
  for (const auto& c : plan.chunks) {
    const std::uint64_t n = c.shape.elements();
    // AdamW chunks inside a Muon run still keep two moments.
    const std::uint64_t k = (muon && !c.muon) ? 3 : states;
    const std::uint64_t bytes = k * aligned_size(n * sizeof(float));
    largest = std::max(largest, bytes);
    total += bytes;
    elements += n;
    largest_elements = std::max(largest_elements, n);
    (c.shape.matrix() ? matrix_elements : vector_elements) += n;
  }
  plan.memory.state_bytes = total;
  plan.memory.largest_sub_group = largest;
  plan.gradient_bytes = 2 * elements;
  plan.parameter_bytes = 2 * elements;
  plan.memory.gradient_staging = aligned_size(largest_elements * sizeof(float));
  if (o.strategy == strategy::zenflow) {
    plan.memory.accumulators = (o.overlap ? 2 : 1) * matrix_elements * sizeof(float);
  }
  const std::uint64_t fixed = plan.memory.accumulators + plan.memory.gradient_staging;
  const std::uint64_t minimum_stream = o.depth * largest + (1u << 20);
  if (o.host_memory < fixed + minimum_stream) {
    throw user_error("--host-memory: " + format_bytes(static_cast<double>(o.host_memory)) + " cannot hold " +
                     (plan.memory.accumulators ? "the gradient windows (" +
                                                     format_bytes(static_cast<double>(plan.memory.accumulators)) + ") and " : std::string()) +
                     std::to_string(o.depth) + " sub-groups of " + format_bytes(static_cast<double>(largest)) +
                     "; it needs at least " + format_bytes(static_cast<double>(fixed + minimum_stream)) +
                     " (or a smaller --sub-group)");
  }
  plan.memory.stream_tier = o.host_memory - fixed;
  plan.memory.state_on_nvme = !o.nvme_dir.empty();
  if (plan.memory.state_on_nvme) {
    struct statvfs fs{};
    if (::statvfs(o.nvme_dir.c_str(), &fs) != 0)
      throw user_error("--nvme-dir: cannot use '" + o.nvme_dir + "': " + std::strerror(errno));
    const std::uint64_t free = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
    if (free < total + nvme_slack)
      throw user_error("--nvme-dir: '" + o.nvme_dir + "' has " + format_bytes(static_cast<double>(free)) +
                       " free; the optimizer state needs " + format_bytes(static_cast<double>(total + nvme_slack)));
  }
  if (!plan.memory.state_on_nvme && total > plan.memory.stream_tier) {
    throw user_error("--host-memory: the optimizer state (" + format_bytes(static_cast<double>(total)) +
                     ") does not fit in the " + format_bytes(static_cast<double>(plan.memory.stream_tier)) +
                     " left for it; give --nvme-dir to keep it on NVMe, or at least " +
                     format_bytes(static_cast<double>(total + fixed)) + " of --host-memory");
  }

  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  plan.optimizer_threads =
      o.threads ? o.threads
                : std::max(1u, static_cast<unsigned>(std::lround(cores * (1.0 - o.reserved_cores))));
  plan.step_compute_seconds = o.device_model.compute_seconds(plan.model.step_flops(o.batch_tokens));

  // The device: what it must hold, against what it has.
  device_memory_plan& dm = plan.device_memory;
  dm.parameters = plan.parameter_bytes;
  dm.gradients = plan.gradient_bytes;
  if (o.strategy == strategy::zenflow) {
    const auto selected = static_cast<std::uint64_t>(std::ceil(o.topk_ratio * static_cast<double>(matrix_elements)));
    // fp32 master and two moments of what the device owns, and a bf16
    // staging copy of every 2-D weight for the windows' uploads.
    dm.zenflow_state = 12 * (selected + vector_elements) + 2 * matrix_elements;
  }
  std::uint64_t widest = 0, largest_matrix = 0;
  for (const auto& w : plan.model.matmuls()) {
    widest = std::max({widest, w.rows, w.cols});
    largest_matrix = std::max(largest_matrix, w.elements());
  }
  dm.micro_batch_tokens = std::min<std::uint64_t>(o.batch_tokens, 8192);
  dm.working_set = 2 * (2 * dm.micro_batch_tokens * widest) + 2 * (2 * largest_matrix);  // bf16
  std::uint64_t device_bytes = o.device_model.memory_bytes;
  const char* memory_flag = "--device-memory";
  if (o.device == device_kind::cuda) {
    if (o.strategy == strategy::zenflow && o.optimizer == optimizer_kind::muon)
      throw user_error("--device cuda: ZenFlow with Muon runs on the simulated device only; the CUDA device side "
                       "updates with Adam/AdamW (use --optimizer adamw, or --strategy sync or pipelined)");
    const tiers::gpu g = find_cuda_device(o);
    device_bytes = g.memory_bytes;
    memory_flag = "--device cuda";
    plan.device_description = "CUDA device " + std::to_string(g.index) + ": " + g.name + " (sm_" +
                              std::to_string(g.compute_capability_major) +
                              std::to_string(g.compute_capability_minor) + ", " +
                              format_bytes(static_cast<double>(g.memory_bytes)) + ", " +
                              std::to_string(g.copy_engines) + " copy engines)";
  } else {
    plan.device_description = o.device_model.describe();
  }
  if (dm.total() > device_bytes) {
    throw user_error(std::string(memory_flag) + ": the device's " + format_bytes(static_cast<double>(device_bytes)) +
                     " cannot hold the bf16 parameters and gradients (" +
                     format_bytes(static_cast<double>(dm.parameters + dm.gradients)) + ")" +
                     (dm.zenflow_state ? ", ZenFlow's device state (" +
                                             format_bytes(static_cast<double>(dm.zenflow_state)) + ")"
                                       : std::string()) +
                     " and one layer's working set at " + std::to_string(dm.micro_batch_tokens) + " tokens (" +
                     format_bytes(static_cast<double>(dm.working_set)) + "); it needs at least " +
                     format_bytes(static_cast<double>(dm.total())));
  }
  return plan;
}

}  // namespace tierflow::bench
