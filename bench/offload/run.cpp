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

#include "offload/repeats.hpp"
#include "offload/steps.hpp"
#include "tierflow/core/affinity.hpp"
#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/optimizer_stream.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/core/telemetry.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/optim/zenflow_rule.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace tierflow::bench {
namespace {

using clock = offload_clock;

std::span<float> as_floats(std::span<std::byte> bytes, std::uint64_t elements) {
  TF_ASSERT(bytes.size() >= elements * sizeof(float));
  return {reinterpret_cast<float*>(bytes.data()), static_cast<std::size_t>(elements)};
}

// The optimizer arithmetic of the run (optim's zenflow_rule): AdamW with its
// defaults, or Muon for the hidden matrices, on the optimizer threads.
std::vector<optim::optimizer_kind> optimizer_kinds(const std::vector<chunk>& chunks) {
  std::vector<optim::optimizer_kind> kinds;
  for (const chunk& c : chunks) kinds.push_back(c.muon ? optim::optimizer_kind::muon : optim::optimizer_kind::adamw);
  return kinds;
}

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

double seconds_of(std::chrono::nanoseconds d) { return std::chrono::duration<double>(d).count(); }

// The baselines' loop, as DeepSpeed runs ZeRO-Offload and ZeRO-Infinity: the
// device computes, the gradient comes down during the backward, the whole
// optimizer step runs on every core, the parameters go back up, and only
// then does the next step start.
void run_baseline_steps(const step_loop_inputs& in, device_timeline& device, step_loop_output& out) {
  const std::uint64_t steps = in.plan.options.steps;
  for (std::uint64_t s = 0; s < steps; ++s) {
    device.launch(s);
    device.receive_gradient(s);
    const auto host_start = clock::now();
    out.optimizer_seconds.push_back(seconds_of(in.optimizer_step()));
    device.send_parameters();
    const double host_seconds = seconds_between(host_start, clock::now());
    out.steps.push_back({.step = s, .host_seconds = host_seconds, .boundary = true});
    out.events.push_back({"host: optimizer step", host_track, host_start, host_seconds});
  }
  device.mark_next_start(steps);
}

// The previous window applied during step s's backward (a fixed interval
// says when a window ends), so the next step need not wait for the gradient's
// trip to the host; returns the wait for its CPU step.
double apply_window_early(zenflow::engine& engine, step_loop_output& out) {
  const auto start = clock::now();
  const double waited = seconds_of(engine.apply_previous_window());
  out.events.push_back({"host: apply window", host_track, start, seconds_between(start, clock::now())});
  return waited;
}

// ZenFlow's loop: after step s's backward the device side updates the
// columns it owns, the next step is launched at once unless the engine says
// it must see this step's host part (a refresh, a window applied at once),
// and the host's part of step s runs while the device computes.
void run_zenflow_steps(const step_loop_inputs& in, device_timeline& device, step_loop_output& out) {
  const std::uint64_t steps = in.plan.options.steps;
  std::vector<zenflow::weight_shape> shapes;
  for (const auto& c : in.plan.chunks) shapes.push_back(c.shape);
  zenflow::engine engine(in.plan.zenflow, std::move(shapes), device.zenflow_device(), *in.host_state, in.rule);
  device.launch(0);
  for (std::uint64_t s = 0; s < steps; ++s) {
    step_record record{.step = s};
    device.order_after_backward(s);
    if (engine.will_update()) record.cpu_wait_seconds += apply_window_early(engine, out);
    device.begin_side(s);
    engine.update_device();  // the first selection, when due, reads the state here: the device waits for it
    device.end_side(s);
    const bool next_waits = engine.device_waits_for_step();
    auto launch_next = [&] { s + 1 < steps ? device.launch(s + 1) : device.mark_next_start(steps); };
    if (!next_waits) launch_next();
    const auto host_start = clock::now();
    const zenflow::step_report report = engine.step();
    if (next_waits) launch_next();
    record.boundary = report.update_boundary;
    record.refreshed = report.refreshed;
    record.cpu_wait_seconds += seconds_of(report.wait_for_cpu);
    record.host_seconds = seconds_of(report.host_work);
    const char* host_event = report.refreshed            ? "host: step + hand-over"
                             : report.selection_decided ? "host: step + selection"
                             : record.boundary          ? "host: step + window"
                                                        : "host: accumulate";
    out.events.push_back({host_event,
                          host_track, host_start, seconds_between(host_start, clock::now())});
    out.steps.push_back(record);
  }
  // The drain: the last window's CPU step, applied, so the device holds the newest values.
  const auto drain_start = clock::now();
  engine.finish();
  out.drain_seconds += seconds_between(drain_start, clock::now());
  out.engine_stats = engine.stats();
}

// The device's side of the trace: each step, the device side's work after
// it, and the stall before the next.
void add_device_events(const device_timeline_result& timeline, const std::vector<step_record>& steps,
                       std::vector<trace_event>& events) {
  for (std::size_t s = 0; s < timeline.spans.size(); ++s) {
    const step_span& span = timeline.spans[s];
    events.push_back({"step " + std::to_string(s), device_track, span.start, seconds_between(span.start, span.end)});
    if (span.side_seconds > 0) events.push_back({"device side", device_track, span.end, span.side_seconds});
    const double gap = steps[s].seconds - steps[s].compute_seconds;
    if (steps[s].stall_seconds > 0)
      events.push_back({"stall", stall_track, span.end + span_of(gap - steps[s].stall_seconds),
                        steps[s].stall_seconds});
  }
}

}  // namespace

std::vector<step_record> account_steps(const device_timeline_result& timeline) {
  std::vector<step_record> records;
  const std::size_t steps = timeline.spans.size();
  for (std::size_t s = 0; s < steps; ++s) {
    const step_span& span = timeline.spans[s];
    const auto next = s + 1 < steps ? timeline.spans[s + 1].start : timeline.next_start;
    const double compute = seconds_between(span.start, span.end);
    const double gap = std::max(0.0, seconds_between(span.end, next));
    records.push_back({.step = s,
                       .seconds = compute + gap,
                       .compute_seconds = compute,
                       .stall_seconds = std::max(0.0, gap - span.side_seconds)});
  }
  return records;
}

step_loop_output run_steps(const step_loop_inputs& in, device_timeline& device) {
  step_loop_output out;
  if (in.plan.options.strategy == strategy::zenflow) run_zenflow_steps(in, device, out);
  else run_baseline_steps(in, device, out);
  const auto finish_start = clock::now();
  out.device = device.finish();
  out.drain_seconds += seconds_between(finish_start, clock::now());
  const std::vector<step_record> accounted = account_steps(out.device);
  TF_ASSERT(accounted.size() == out.steps.size(), "one device span per step");
  for (std::size_t s = 0; s < accounted.size(); ++s) {
    out.steps[s].seconds = accounted[s].seconds;
    out.steps[s].compute_seconds = accounted[s].compute_seconds;
    out.steps[s].stall_seconds = accounted[s].stall_seconds;
  }
  add_device_events(out.device, out.steps, out.events);
  return out;
}

step_summary summarize(std::span<const step_record> steps) {
  step_summary sum;
  std::vector<std::size_t> boundaries;
  for (std::size_t s = 0; s < steps.size(); ++s)
    if (steps[s].boundary) boundaries.push_back(s);
  // Whole windows after the first; a run of one window (or none closed) counts whole.
  std::size_t begin = 0, end = boundaries.empty() ? steps.size() : boundaries.back() + 1;
  if (boundaries.size() >= 2) begin = boundaries.front() + 1;
  sum.warm_up_steps = begin;
  sum.counted_steps = end - begin;
  const auto counted = steps.subspan(begin, end - begin);
  std::vector<double> times;
  double total = 0, stall = 0, cpu_wait = 0, host_open = 0;
  std::uint64_t open_steps = 0;
  for (const auto& rec : counted) {
    times.push_back(rec.seconds);
    total += rec.seconds;
    stall += rec.stall_seconds;
    cpu_wait += rec.cpu_wait_seconds;
    sum.windows += rec.boundary;
    if (!rec.boundary) {
      host_open += rec.host_seconds;
      ++open_steps;
    }
  }
  if (times.empty()) return sum;
  const auto n = static_cast<double>(times.size());
  sum.step_seconds = total / n;
  sum.median_step_seconds = spread_of(times).median;
  sum.max_step_seconds = *std::max_element(times.begin(), times.end());
  sum.stall_fraction = total > 0 ? stall / total : 0;
  sum.cpu_wait_per_step_seconds = cpu_wait / n;
  sum.host_work_per_step_seconds = open_steps ? host_open / static_cast<double>(open_steps) : 0;
  return sum;
}

namespace {

// The state of a run in its store: master values and optimizer state of
// every chunk, at home on NVMe (in a directory of the run's own, removed
// once its files are) or in host memory, streamed through the host tier.
struct offload_store {
  struct run_directory {
    std::string path;
    ~run_directory() {
      if (!path.empty()) ::rmdir(path.c_str());
    }
  } nvme_dir;
  clock::time_point made;
  std::unique_ptr<block_store> store;
  std::vector<std::vector<block_id>> blocks;  // per chunk: master, state0[, state1]
  std::vector<sub_group> all;
  optimizer_stream_options stream;
};

void make_offload_store(const offload_plan& plan, offload_store& st) {
  tiers::store_config config;
  config.host = tiers::host_tier_options{.budget = plan.memory.stream_tier / block_alignment * block_alignment};
  if (plan.memory.state_on_nvme) {
    st.nvme_dir.path = plan.options.nvme_dir + "/tierflow-offload-" + std::to_string(::getpid());
    config.nvme = tiers::nvme_tier_options{.directory = st.nvme_dir.path,
                                           .budget = plan.memory.state_bytes + nvme_slack,
                                           .file_size = 256ull << 20};
  }
  config.store.trace = !plan.options.trace_path.empty();
  st.made = clock::now();
  st.store = tiers::make_store(std::move(config));
  const tier_kind home = plan.memory.state_on_nvme ? tier_kind::nvme : tier_kind::host;
  st.blocks.resize(plan.chunks.size());
  for (std::size_t i = 0; i < plan.chunks.size(); ++i) {
    const chunk& c = plan.chunks[i];
    const std::uint64_t bytes = c.shape.elements() * sizeof(float);
    const char* suffixes[] = {".master", ".state0", ".state1"};
    for (int k = 0; k < (c.muon ? 2 : 3); ++k) {
      st.blocks[i].push_back(st.store->create_block(
          {.name = c.shape.name + suffixes[k], .size_bytes = bytes, .type = dtype::fp32, .home = home}));
    }
    st.all.push_back({st.blocks[i], {}});
  }
  st.stream.depth = plan.options.depth;
  st.stream.evict_after_update = plan.memory.state_on_nvme;
  st.stream.overlap_io = true;  // DeepSpeed's pipelined swapper: read(i+1) ‖ update(i) ‖ write(i-1)
}

constexpr float initial_parameter = 0.02f;

// Parameters 0.02, state zero: every byte written once.
void initialise_state(const offload_plan& plan, offload_store& st) {
  run_optimizer_stream(*st.store, st.all, [&](std::size_t i, std::span<const std::span<std::byte>> b) {
    const std::uint64_t n = plan.chunks[i].shape.elements();
    std::ranges::fill(as_floats(b[0], n), initial_parameter);
    for (std::size_t k = 1; k < b.size(); ++k) std::ranges::fill(as_floats(b[k], n), 0.0f);
  }, st.stream);
}

// The gradient the host's optimizer works with (and the simulated device
// hands down; a GPU's ZenFlow side downloads its own): random, fixed, real bytes.
std::vector<float> fixed_gradient(const offload_plan& plan) {
  std::uint64_t largest = 0;
  for (const auto& c : plan.chunks) largest = std::max(largest, c.shape.elements());
  std::vector<float> gradient(largest);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  for (auto& g : gradient) g = normal(rng);
  return gradient;
}

// Restores this thread's CPU mask on the way out, so a caller running several
// strategies in one process gets its CPUs back.
struct affinity_guard {
  std::vector<int> saved = current_affinity();
  ~affinity_guard() {
    try {
      pin_current_thread(saved);
    } catch (const std::exception&) {
    }
  }
};

// The baselines' whole optimizer step over the streamed state, and its bounds.
class whole_step {
 public:
  whole_step(const offload_plan& plan, offload_store& st, optim::zenflow_rule& rule, std::span<const float> gradient)
      : plan_(plan), st_(st), rule_(rule), gradient_(gradient) {}

  std::chrono::nanoseconds run() {
    ++steps_;
    return run_optimizer_stream(*st_.store, st_.all, [&](std::size_t i, std::span<const std::span<std::byte>> b) {
      const std::uint64_t n = plan_.chunks[i].shape.elements();
      update(i, as_floats(b[0], n), as_floats(b[1], n), b.size() > 2 ? as_floats(b[2], n) : std::span<float>(),
             steps_);
    }, st_.stream).total;
  }
  // The same state moved with no work (I/O alone), and worked on in memory
  // (compute alone): the bounds a pipelined step is measured against.
  void measure_bounds(offload_result& result) {
    const auto io_start = clock::now();
    run_optimizer_stream(*st_.store, st_.all, [](std::size_t, std::span<const std::span<std::byte>>) {}, st_.stream);
    result.io_alone_seconds = seconds_between(io_start, clock::now());
    const std::size_t largest = gradient_.size();
    std::vector<float> p(largest, initial_parameter), m(largest, 0.0f), v(largest, 0.0f);
    const auto compute_start = clock::now();
    for (std::size_t i = 0; i < plan_.chunks.size(); ++i) {
      const auto n = static_cast<std::size_t>(plan_.chunks[i].shape.elements());
      update(i, std::span(p).first(n), std::span(m).first(n),
             plan_.chunks[i].muon ? std::span<float>() : std::span(v).first(n), 1);
    }
    result.compute_alone_seconds = seconds_between(compute_start, clock::now());
  }

 private:
  void update(std::size_t i, std::span<float> param, std::span<float> state0, std::span<float> state1,
              std::int64_t step) {
    const chunk& c = plan_.chunks[i];
    zenflow::update_args a;
    a.weight = &c.shape;
    a.weight_index = i;
    a.columns = static_cast<std::uint32_t>(c.shape.cols);
    a.param = param;
    a.grad = gradient_.first(param.size());
    a.state0 = state0;
    a.state1 = state1;
    a.step = step;
    rule_.apply(a);
  }

  const offload_plan& plan_;
  offload_store& st_;
  optim::zenflow_rule& rule_;
  std::span<const float> gradient_;
  std::int64_t steps_ = 0;
};

// Whether one window's device compute hides its CPU step, and if not, what would.
std::string hideability(const offload_plan& plan, const offload_result& r) {
  const step_summary& sum = r.summary;
  const double need = 1.5 * r.cpu_step_seconds;
  std::ostringstream h;
  h.precision(3);
  const bool window_ok = r.window_compute_seconds >= need;
  const bool step_ok = sum.host_work_per_step_seconds <= r.compute_seconds;
  if (window_ok && step_ok) {
    h << "hideable: a window computes " << r.window_compute_seconds << " s on the device, "
      << r.window_compute_seconds / std::max(r.cpu_step_seconds, 1e-9) << "x its CPU step with I/O ("
      << r.cpu_step_seconds << " s)";
    return h.str();
  }
  const double steps_per_window = r.window_compute_seconds / std::max(r.compute_seconds, 1e-12);
  const double per_token = r.compute_seconds / static_cast<double>(plan.options.batch_tokens);
  const double want = std::max(need / steps_per_window, sum.host_work_per_step_seconds);
  const auto batch = static_cast<std::uint64_t>(std::ceil(want / per_token));
  const auto interval = static_cast<std::uint64_t>(std::ceil(need / r.compute_seconds));
  h << "not hideable: a window computes " << r.window_compute_seconds << " s against a CPU step with I/O of "
    << r.cpu_step_seconds << " s (1.5x needed) and " << sum.host_work_per_step_seconds
    << " s of host accumulation per step; --batch-tokens " << batch;
  if (step_ok) h << " or --update-interval " << interval;
  h << " would hide it";
  return h.str();
}

void fill_result(const offload_plan& plan, step_loop_output& loop, const block_store& store, offload_result& r) {
  r.device_model = loop.device.description;
  r.compute_seconds = loop.device.compute_seconds;
  r.steps = std::move(loop.steps);
  r.summary = summarize(r.steps);
  r.drain_seconds = loop.drain_seconds;
  if (!loop.optimizer_seconds.empty())
    r.optimizer_step_seconds = std::accumulate(loop.optimizer_seconds.begin(), loop.optimizer_seconds.end(), 0.0) /
                               static_cast<double>(loop.optimizer_seconds.size());
  r.bytes["pcie_d2h"] = loop.device.d2h_bytes;
  r.bytes["pcie_h2d"] = loop.device.h2d_bytes;
  const store_telemetry t = store.telemetry();
  for (const auto& link : t.links) r.bytes[link.name] = link.bytes;
  r.telemetry_json = to_json(t);
  if (!loop.engine_stats) return;
  const zenflow::engine_stats& st = *loop.engine_stats;
  const double steps_per_window =
      r.summary.windows ? static_cast<double>(r.summary.counted_steps) / static_cast<double>(r.summary.windows) : 1;
  r.window_compute_seconds = steps_per_window * r.compute_seconds;
  r.cpu_step_seconds = st.cpu_steps ? seconds_of(st.cpu_step_time) / static_cast<double>(st.cpu_steps) : 0;
  r.refreshes = st.refreshes;
  r.hideability = hideability(plan, r);
}

}  // namespace

offload_result run_offload(const offload_plan& plan) {
  const offload_options& options = plan.options;
  offload_result result;
  result.strategy = to_string(options.strategy);
  offload_store st;
  make_offload_store(plan, st);
  initialise_state(plan, st);
  const std::vector<float> gradient = fixed_gradient(plan);

  // ZenFlow splits the cores as pt_reserved_cores_perc says: the optimizer's
  // threads (and the engine's CPU-step thread) on their share, this thread —
  // the trainer's, which drives the device and accumulates gradients — on
  // the rest. The baselines' CPU Adam takes every core, as DeepSpeed's does.
  core_split cores;
  if (options.strategy == strategy::zenflow) {
    cores = split_cores(plan.zenflow.pt_reserved_cores_perc);
    result.optimizer_cpus = cores.optimizer;
    result.trainer_cpus = cores.trainer;
  }
  optim::executor executor(static_cast<int>(plan.optimizer_threads), "auto", cores.optimizer);
  const affinity_guard restore;
  if (!cores.trainer.empty()) pin_current_thread(cores.trainer);
  optim::zenflow_rule rule(optimizer_kinds(plan.chunks), executor, executor);

  whole_step baseline_step(plan, st, rule, gradient);
  if (options.strategy != strategy::zenflow) baseline_step.measure_bounds(result);
  std::unique_ptr<store_host_state> host_state;
  if (options.strategy == strategy::zenflow)
    host_state = std::make_unique<store_host_state>(*st.store, plan, st.blocks, st.stream);
  const step_loop_inputs inputs{.plan = plan,
                                .rule = rule,
                                .host_state = host_state.get(),
                                .optimizer_step = [&] { return baseline_step.run(); }};
  const std::unique_ptr<device_timeline> device = options.device == device_kind::cuda
                                                      ? make_cuda_timeline(plan, gradient, initial_parameter)
                                                      : make_sim_timeline(plan, gradient);
  step_loop_output loop = run_steps(inputs, *device);
  const auto flush_start = clock::now();
  st.store->flush();
  loop.drain_seconds += seconds_between(flush_start, clock::now());
  fill_result(plan, loop, *st.store, result);
  // The store's trace counts from its creation.
  if (!options.trace_path.empty()) write_trace(options.trace_path, *st.store, st.made, loop.events);
  return result;
}

}  // namespace tierflow::bench
