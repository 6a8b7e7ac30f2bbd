#include "offload/run.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "offload/steps.hpp"
#include "tierflow/core/affinity.hpp"
#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/optimizer_stream.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/core/telemetry.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/optim/adam.hpp"
#include "tierflow/optim/muon.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace tierflow::bench {
namespace {

using clock = offload_clock;

std::span<float> as_floats(std::span<std::byte> bytes, std::uint64_t elements) {
  TF_ASSERT(bytes.size() >= elements * sizeof(float));
  return {reinterpret_cast<float*>(bytes.data()), static_cast<std::size_t>(elements)};
}

// The optimizer arithmetic of the run: optim's AdamW, or Muon for the hidden
// matrices, on the optimizer threads.
class optim_rule final : public zenflow::update_rule {
 public:
  optim_rule(const std::vector<chunk>& chunks, optim::executor& ex)
      : chunks_(chunks), ex_(ex), adam_(optim::adam_options::adamw()), muon_(optim::muon_options{}) {}

  zenflow::granularity unit(std::size_t w) const noexcept override {
    return chunks_[w].muon ? zenflow::granularity::matrix : zenflow::granularity::columns;
  }
  std::size_t state_count() const noexcept override { return 2; }
  void apply(const zenflow::update_args& a) override {
    if (chunks_[a.weight_index].muon) {
      optim::muon_matrix m;
      m.param = a.param;
      m.grad = optim::fp32_ref(a.grad);
      m.momentum_buffer = a.state0;
      m.rows = a.weight->cols;
      m.cols = a.weight->rows;
      muon_.step(ex_, m);
      return;
    }
    optim::adam_sub_group g;
    g.param = a.param;
    g.grad = optim::fp32_ref(a.grad);
    g.exp_avg = optim::fp32_ref(a.state0);
    g.exp_avg_sq = optim::fp32_ref(a.state1);
    adam_.step(ex_, g, {.step = a.step});
  }

 private:
  const std::vector<chunk>& chunks_;
  optim::executor& ex_;
  optim::adam_optimizer adam_;
  optim::muon_optimizer muon_;
};

// ZenFlow's host state in the store: each chunk's blocks streamed through
// the host tier, from NVMe when the state lives there.
class store_host_state final : public zenflow::host_state {
 public:
  store_host_state(block_store& store, const offload_plan& plan, const std::vector<std::vector<block_id>>& blocks,
                   optimizer_stream_options options)
      : store_(store), plan_(plan), blocks_(blocks), options_(options) {}

  void for_each(std::span<const std::size_t> weights,
                const std::function<void(std::size_t, const zenflow::host_buffers&)>& fn) override {
    std::vector<sub_group> groups;
    for (const std::size_t w : weights) groups.push_back({blocks_[w], {}});
    run_optimizer_stream(
        store_, groups,
        [&](std::size_t i, std::span<const std::span<std::byte>> b) {
          const std::size_t w = weights[i];
          const std::uint64_t n = plan_.chunks[w].shape.elements();
          fn(w, {as_floats(b[0], n), as_floats(b[1], n), b.size() > 2 ? as_floats(b[2], n) : std::span<float>()});
        },
        options_);
  }

 private:
  block_store& store_;
  const offload_plan& plan_;
  const std::vector<std::vector<block_id>>& blocks_;
  optimizer_stream_options options_;
};

// The store's trace with the device timeline and the host's work added.
void write_trace(const std::string& path, const block_store& store, clock::time_point store_origin,
                 const std::vector<trace_event>& events) {
  std::stringstream ss;
  store.write_trace(ss);
  nlohmann::json doc = nlohmann::json::parse(ss.str());
  auto& list = doc["traceEvents"];
  const std::map<std::string, int> tracks = {{device_track, 1}, {host_track, 2}, {stall_track, 3}};
  list.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", 10}, {"tid", 0},
                  {"args", {{"name", "bench offload"}}}});
  for (const auto& [name, tid] : tracks) {
    list.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", 10}, {"tid", tid}, {"args", {{"name", name}}}});
  }
  for (const auto& e : events) {
    list.push_back({{"ph", "X"}, {"name", e.name}, {"cat", e.track}, {"pid", 10}, {"tid", tracks.at(e.track)},
                    {"ts", seconds_between(store_origin, e.start) * 1e6}, {"dur", e.seconds * 1e6}});
  }
  std::ofstream out(path);
  if (!out) throw error(errno, error_context{"open"}.at(path));
  out << doc.dump();
  if (!out.flush()) throw error(errno, error_context{"write"}.at(path));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

offload_result run_offload(const offload_plan& plan) {
  const offload_options& o = plan.options;
  offload_result r;
  r.strategy = to_string(o.strategy);

  // The store: a pinned host tier to stream through, NVMe extents for the state
  // in a directory of this run's own, removed (once its files are) at the end.
  struct run_directory {
    std::string path;
    ~run_directory() {
      if (!path.empty()) ::rmdir(path.c_str());
    }
  } nvme_dir;
  tiers::store_config sc;
  sc.host = tiers::host_tier_options{.budget = plan.memory.stream_tier / block_alignment * block_alignment};
  if (plan.memory.state_on_nvme) {
    nvme_dir.path = o.nvme_dir + "/tierflow-offload-" + std::to_string(::getpid());
    sc.nvme = tiers::nvme_tier_options{.directory = nvme_dir.path,
                                       .budget = plan.memory.state_bytes + nvme_slack,
                                       .file_size = 256ull << 20};
  }
  sc.store.trace = !o.trace_path.empty();
  const auto store_made = clock::now();
  std::unique_ptr<block_store> store = tiers::make_store(std::move(sc));
  const tier_kind home = plan.memory.state_on_nvme ? tier_kind::nvme : tier_kind::host;

  // Master values and optimizer state of every chunk.
  std::vector<std::vector<block_id>> blocks(plan.chunks.size());
  std::vector<sub_group> all;
  for (std::size_t i = 0; i < plan.chunks.size(); ++i) {
    const chunk& c = plan.chunks[i];
    const std::uint64_t bytes = c.shape.elements() * sizeof(float);
    const char* suffixes[] = {".master", ".state0", ".state1"};
    for (int k = 0; k < (c.muon ? 2 : 3); ++k) {
      blocks[i].push_back(store->create_block({.name = c.shape.name + suffixes[k], .size_bytes = bytes,
                                               .type = dtype::fp32, .home = home}));
    }
    all.push_back({blocks[i], {}});
  }
  optimizer_stream_options stream;
  stream.depth = o.depth;
  stream.evict_after_update = plan.memory.state_on_nvme;

  // Initial values: parameters 0.02, state zero — every byte written once.
  constexpr float initial_parameter = 0.02f;
  run_optimizer_stream(*store, all, [&](std::size_t i, std::span<const std::span<std::byte>> b) {
    const std::uint64_t n = plan.chunks[i].shape.elements();
    std::ranges::fill(as_floats(b[0], n), initial_parameter);
    for (std::size_t k = 1; k < b.size(); ++k) std::ranges::fill(as_floats(b[k], n), 0.0f);
  }, stream);

  // The gradient the host's optimizer works with (and the simulated device
  // hands down; a GPU's ZenFlow side downloads its own): random, fixed, real bytes.
  std::uint64_t largest = 0;
  for (const auto& c : plan.chunks) largest = std::max(largest, c.shape.elements());
  std::vector<float> gradient(largest);
  {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1e-3f);
    for (auto& g : gradient) g = normal(rng);
  }

  // ZenFlow splits the cores as pt_reserved_cores_perc says: the optimizer's
  // threads (and the engine's CPU-step thread) on their share, this thread —
  // the trainer's, which drives the device and accumulates gradients — on
  // the rest. The other strategies leave placement to the OS.
  core_split cores;
  if (o.strategy == strategy::zenflow) {
    cores = split_cores(plan.zenflow.pt_reserved_cores_perc);
    r.optimizer_cpus = cores.optimizer;
    r.trainer_cpus = cores.trainer;
  }
  optim::executor ex(static_cast<int>(plan.optimizer_threads), "auto", cores.optimizer);
  // Restores this thread's mask on the way out, so a caller running several
  // strategies in one process gets its CPUs back.
  struct affinity_guard {
    std::vector<int> saved = current_affinity();
    ~affinity_guard() {
      try {
        pin_current_thread(saved);
      } catch (const std::exception&) {
      }
    }
  } restore;
  if (!cores.trainer.empty()) pin_current_thread(cores.trainer);
  optim_rule rule(plan.chunks, ex);

  // One whole chunk's optimizer step on the given buffers, with the fixed gradient.
  auto update_chunk = [&](std::size_t i, std::span<float> param, std::span<float> state0, std::span<float> state1,
                          std::int64_t step) {
    const chunk& c = plan.chunks[i];
    zenflow::update_args a;
    a.weight = &c.shape;
    a.weight_index = i;
    a.columns = static_cast<std::uint32_t>(c.shape.cols);
    a.param = param;
    a.grad = std::span<const float>(gradient).first(param.size());
    a.state0 = state0;
    a.state1 = state1;
    a.step = step;
    rule.apply(a);
  };

  // The whole optimizer step over the streamed state (sync and pipelined).
  std::int64_t optimizer_steps = 0;
  auto full_optimizer_step = [&](bool overlap) {
    ++optimizer_steps;
    optimizer_stream_options opts = stream;
    opts.overlap_io = overlap;
    return run_optimizer_stream(*store, all, [&](std::size_t i, std::span<const std::span<std::byte>> b) {
      const std::uint64_t n = plan.chunks[i].shape.elements();
      update_chunk(i, as_floats(b[0], n), as_floats(b[1], n), b.size() > 2 ? as_floats(b[2], n) : std::span<float>(),
                   optimizer_steps);
    }, opts);
  };

  if (o.strategy != strategy::zenflow) {
    // The same state moved with no work (I/O alone) and worked on in memory
    // (compute alone): the bounds a pipelined step is measured against.
    const auto io_start = clock::now();
    run_optimizer_stream(*store, all, [](std::size_t, std::span<const std::span<std::byte>>) {}, stream);
    r.io_alone_seconds = seconds_between(io_start, clock::now());
    std::vector<float> p(largest, initial_parameter), m(largest, 0.0f), v(largest, 0.0f);
    const auto compute_start = clock::now();
    for (std::size_t i = 0; i < plan.chunks.size(); ++i) {
      const std::size_t n = static_cast<std::size_t>(plan.chunks[i].shape.elements());
      update_chunk(i, std::span(p).first(n), std::span(m).first(n),
                   plan.chunks[i].muon ? std::span<float>() : std::span(v).first(n), 1);
    }
    r.compute_alone_seconds = seconds_between(compute_start, clock::now());
  }

  std::unique_ptr<store_host_state> host_state;
  if (o.strategy == strategy::zenflow) host_state = std::make_unique<store_host_state>(*store, plan, blocks, stream);
  const step_loop_inputs inputs{
      .plan = plan,
      .rule = rule,
      .host_state = host_state.get(),
      .gradient = gradient,
      .initial_parameter = initial_parameter,
      .optimizer_step = [&] { return full_optimizer_step(o.strategy == strategy::pipelined).total; },
  };
  step_loop_output loop = o.device == device_kind::cuda ? cuda_steps(inputs) : simulate_steps(inputs);
  const auto flush_start = clock::now();
  store->flush();
  loop.drain_seconds += seconds_between(flush_start, clock::now());

  r.device_model = loop.device_description;
  r.compute_seconds = loop.compute_seconds;
  r.steps = std::move(loop.steps);
  r.drain_seconds = loop.drain_seconds;

  // Summary.
  // The summary is over the steady state: the first update window warms up
  // (first selection, first reads of the state) and is shown but not counted.
  r.warm_up_steps = std::min<std::uint64_t>(o.update_interval, o.steps / 2);
  std::vector<double> times;
  double total = 0, stall = 0, host_nonboundary = 0;
  std::uint64_t nonboundary = 0;
  for (const auto& rec : r.steps) {
    if (rec.step < r.warm_up_steps) continue;
    times.push_back(rec.seconds);
    total += rec.seconds;
    stall += rec.stall_seconds;
    if (!rec.boundary) {
      host_nonboundary += rec.host_seconds;
      ++nonboundary;
    }
  }
  r.step_seconds = total / static_cast<double>(times.size());
  r.median_step_seconds = median(times);
  r.max_step_seconds = *std::max_element(times.begin(), times.end());
  r.stall_fraction = total > 0 ? stall / total : 0;
  r.host_work_per_step_seconds = nonboundary ? host_nonboundary / static_cast<double>(nonboundary) : 0;
  if (!loop.optimizer_seconds.empty())
    r.optimizer_step_seconds = std::accumulate(loop.optimizer_seconds.begin(), loop.optimizer_seconds.end(), 0.0) /
                               static_cast<double>(loop.optimizer_seconds.size());

  r.bytes["pcie_d2h"] = loop.d2h_bytes;
  r.bytes["pcie_h2d"] = loop.h2d_bytes;
  const store_telemetry t = store->telemetry();
  for (const auto& link : t.links) r.bytes[link.name] = link.bytes;
  r.telemetry_json = to_json(t);

  if (loop.engine_stats) {
    const auto& st = *loop.engine_stats;
    const double k = static_cast<double>(o.update_interval);
    r.window_compute_seconds = k * r.compute_seconds;
    r.cpu_step_seconds = st.cpu_steps ? std::chrono::duration<double>(st.cpu_step_time).count() /
                                            static_cast<double>(st.cpu_steps)
                                      : 0;
    const double need = 1.5 * r.cpu_step_seconds;
    std::ostringstream h;
    h.precision(3);
    const bool window_ok = r.window_compute_seconds >= need;
    const bool step_ok = r.host_work_per_step_seconds <= r.compute_seconds;
    if (window_ok && step_ok) {
      h << "hideable: a window computes " << r.window_compute_seconds << " s on the device, "
        << r.window_compute_seconds / std::max(r.cpu_step_seconds, 1e-9) << "x its CPU step with I/O ("
        << r.cpu_step_seconds << " s)";
    } else {
      const double per_token = r.compute_seconds / static_cast<double>(o.batch_tokens);
      const double want = std::max(need / k, r.host_work_per_step_seconds);
      const auto batch = static_cast<std::uint64_t>(std::ceil(want / per_token));
      const auto interval = static_cast<std::uint64_t>(std::ceil(need / r.compute_seconds));
      h << "not hideable: a window computes " << r.window_compute_seconds << " s against a CPU step with I/O of "
        << r.cpu_step_seconds << " s (1.5x needed) and " << r.host_work_per_step_seconds
        << " s of host accumulation per step; --batch-tokens " << batch;
      if (step_ok) h << " or --update-interval " << interval;
      h << " would hide it";
    }
    r.hideability = h.str();
  }

  if (!o.trace_path.empty()) {
    // The store's trace counts from its creation.
    write_trace(o.trace_path, *store, store_made, loop.events);
  }
  return r;
}

}  // namespace tierflow::bench
