// The steps of a run on the simulated device (--device sim).
//
// The device is a timeline anchored to the wall clock. Step s starts when the
// device is free and its inputs are ready; it computes for the modelled time,
// then its gradient goes down the D2H link. The host thread waits for that
// gradient, does the strategy's host work for real, and the time it finishes
// decides when later steps may start:
//   sync, pipelined: step s+1 needs the whole optimizer step and the upload of
//                    every parameter (ZeRO-Offload / ZeRO-Infinity);
//   zenflow:         step s+1 needs the host only when the engine says the
//                    device must wait for it (device_waits_for_step: a
//                    refresh, a window applied at once); at other update
//                    boundaries the previous window's upload; otherwise only
//                    that the host has consumed the gradient of step s-1 (two
//                    pinned staging buffers).
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "offload/steps.hpp"

namespace tierflow::bench {
namespace {

using clock = offload_clock;

// The simulated device's PCIe host → device link: transfers queue one after
// another at the modelled rate. Thread-safe (the CPU step uploads from its thread).
class upload_link {
 public:
  explicit upload_link(const sim_device& model) : model_(model) {}
  // Queues `bytes`; returns when they will have arrived.
  clock::time_point send(std::uint64_t bytes) {
    std::lock_guard lock(mutex_);
    const auto start = std::max(clock::now(), free_at_);
    free_at_ = start + span_of(model_.transfer_seconds(bytes));
    bytes_ += bytes;
    return free_at_;
  }
  std::uint64_t bytes() const {
    std::lock_guard lock(mutex_);
    return bytes_;
  }

 private:
  const sim_device& model_;
  mutable std::mutex mutex_;
  clock::time_point free_at_{};
  std::uint64_t bytes_ = 0;
};

// ZenFlow's device side, simulated: no device memory, only time and bytes on
// the modelled link. The gradient it hands down is a fixed random buffer, so
// the host's accumulation reads real bytes.
class sim_device_side final : public zenflow::device_side {
 public:
  sim_device_side(const offload_plan& plan, upload_link& link, std::span<const float> gradient)
      : plan_(plan), link_(link), gradient_(gradient), uploaded_at_(plan.chunks.size()) {}

  void column_importance(std::size_t w, zenflow::importance_norm, std::span<float> out) override {
    // Heavy-tailed scores that drift between refreshes: a few columns matter.
    ++calls_;
    for (std::size_t c = 0; c < out.size(); ++c) {
      std::uint64_t h = (w + 1) * 0x9E3779B97F4A7C15ull ^ (c * 0xBF58476D1CE4E5B9ull) ^ (calls_ / 8);
      h ^= h >> 31;
      h *= 0x94D049BB133111EBull;
      h ^= h >> 29;
      const double u = static_cast<double>(h >> 11) * 0x1p-53;
      out[c] = static_cast<float>(std::pow(u, 8.0));
    }
  }
  void update_owned(std::size_t w, std::int64_t) override {
    // The selected columns' Adam on the device: memory-bound at HBM speed
    // (read p, g, m, v; write p, m, v, and the bf16 copy), 3 TB/s.
    device_bytes_ += selected_elements(w) * 30;
  }
  std::span<const float> download_gradient(std::size_t w) override {
    return gradient_.first(static_cast<std::size_t>(plan_.chunks[w].shape.elements()));
  }
  void stage_upload(std::size_t w, std::span<const zenflow::column_run> runs, std::span<const float>) override {
    std::uint64_t columns = 0;
    for (const auto r : runs) columns += r.end - r.begin;
    const auto arrived = link_.send(columns * plan_.chunks[w].shape.rows * 2);  // bf16
    std::lock_guard lock(mutex_);
    uploaded_at_[w] = arrived;
  }
  void apply_staged(std::size_t w, std::span<const zenflow::column_run>) override {
    std::lock_guard lock(mutex_);
    ready_at_ = std::max(ready_at_, uploaded_at_[w]);
  }
  void hand_over(std::size_t w, std::span<const std::uint32_t> selected, const zenflow::selection_change& change,
                 const zenflow::host_buffers&) override {
    selected_[w] = selected.size();
    // Master and two moments of each column crossing, fp32, over the link.
    link_.send((change.entering.size() + change.leaving.size()) * plan_.chunks[w].shape.rows * 12);
  }

  // Device seconds of the selective updates since the last call.
  double take_device_seconds() {
    const double s = static_cast<double>(device_bytes_) / 3e12;
    device_bytes_ = 0;
    return s;
  }
  // When the uploads of the windows applied since the last call arrive.
  clock::time_point take_ready_at() {
    std::lock_guard lock(mutex_);
    return std::exchange(ready_at_, clock::time_point{});
  }

 private:
  std::uint64_t selected_elements(std::size_t w) const {
    const auto it = selected_.find(w);
    const auto& shape = plan_.chunks[w].shape;
    if (!shape.matrix()) return shape.elements();
    return it == selected_.end() ? 0 : it->second * shape.rows;
  }

  const offload_plan& plan_;
  upload_link& link_;
  std::span<const float> gradient_;
  std::uint64_t calls_ = 0;
  std::uint64_t device_bytes_ = 0;
  std::map<std::size_t, std::size_t> selected_;
  std::mutex mutex_;
  std::vector<clock::time_point> uploaded_at_;
  clock::time_point ready_at_{};
};

}  // namespace

step_loop_output simulate_steps(const step_loop_inputs& in) {
  const offload_plan& plan = in.plan;
  const offload_options& o = plan.options;
  step_loop_output out;
  out.device_description = o.device_model.describe();
  out.compute_seconds = plan.step_compute_seconds;
  upload_link h2d(o.device_model);

  std::unique_ptr<sim_device_side> device;
  std::unique_ptr<zenflow::engine> engine;
  if (o.strategy == strategy::zenflow) {
    device = std::make_unique<sim_device_side>(plan, h2d, in.gradient);
    std::vector<zenflow::weight_shape> shapes;
    for (const auto& c : plan.chunks) shapes.push_back(c.shape);
    engine = std::make_unique<zenflow::engine>(plan.zenflow, std::move(shapes), *device, *in.host_state, in.rule);
  }

  clock::time_point device_free = clock::now();
  clock::time_point d2h_free = device_free;
  clock::time_point params_ready = device_free;
  std::vector<clock::time_point> host_done;
  double device_extra = 0;
  for (std::uint64_t s = 0; s < o.steps; ++s) {
    const auto start = std::max(device_free, params_ready);
    step_record rec;
    rec.step = s;
    rec.stall_seconds = std::max(0.0, seconds_between(device_free, start));
    const auto compute_end = start + span_of(plan.step_compute_seconds + device_extra);
    rec.seconds = seconds_between(device_free, compute_end);
    if (rec.stall_seconds > 0) out.events.push_back({"stall", stall_track, device_free, rec.stall_seconds});
    out.events.push_back({"step " + std::to_string(s), device_track, start, seconds_between(start, compute_end)});
    device_free = compute_end;
    // The gradient goes down on the D2H copy engine, overlapping later compute.
    d2h_free = std::max(compute_end, d2h_free) + span_of(o.device_model.transfer_seconds(plan.gradient_bytes));
    out.d2h_bytes += plan.gradient_bytes;
    // While the device computes step s: a boundary step needs the previous
    // window's result applied before step s+1; the trainer does that during
    // the backward, not after the gradient came down.
    clock::time_point applied_at{};
    if (engine && engine->will_update()) {
      const auto apply_start = clock::now();
      engine->apply_previous_window();
      applied_at = clock::now();
      out.events.push_back({"host: apply window", host_track, apply_start, seconds_between(apply_start, applied_at)});
    }
    std::this_thread::sleep_until(d2h_free);

    const auto host_start = clock::now();
    if (engine) {
      const bool waits = engine->device_waits_for_step();
      const zenflow::step_report report = engine->step();
      rec.boundary = report.update_boundary;
      device_extra = device->take_device_seconds();
      const auto uploads = device->take_ready_at();
      if (waits) {
        params_ready = std::max(clock::now(), uploads);  // the host's step decides the next one
      } else if (rec.boundary) {
        params_ready = std::max(applied_at, uploads);  // the previous window, applied early
      } else {
        params_ready = s >= 1 ? host_done[s - 1] : clock::time_point{};  // two staging buffers
      }
    } else {
      out.optimizer_seconds.push_back(std::chrono::duration<double>(in.optimizer_step()).count());
      params_ready = h2d.send(plan.parameter_bytes);  // every parameter back up
      rec.boundary = true;
    }
    const auto host_end = clock::now();
    host_done.push_back(host_end);
    rec.host_seconds = seconds_between(host_start, host_end);
    out.events.push_back({rec.boundary ? "host: step + update" : "host: accumulate", host_track, host_start,
                          rec.host_seconds});
    out.steps.push_back(rec);
  }
  // The device's last step must also see its inputs: the drain.
  const auto drain_start = clock::now();
  if (engine) {
    engine->finish();
    out.engine_stats = engine->stats();
  }
  out.drain_seconds = seconds_between(drain_start, clock::now());
  out.h2d_bytes = h2d.bytes();
  return out;
}

}  // namespace tierflow::bench
