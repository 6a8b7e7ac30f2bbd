// The simulated device (--device sim): a timeline anchored to the wall clock.
//
// A step starts when the device is free, its inputs have arrived and the
// trainer has issued it; it computes for the modelled time. Transfers queue
// on their PCIe direction at the modelled rate and latency; a call that
// waits for one on a GPU (a download, ZenFlow's uploads and hand-overs,
// which cuda_zenflow_device synchronises) sleeps until it has arrived, so
// the host's real work meets the modelled device as a trainer's would.
// ZenFlow's selective update and its window copies take device time at the
// modelled HBM bandwidth after the step's backward, before the next step.
// Bytes are counted as the CUDA path counts them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <numbers>
#include <thread>
#include <utility>

#include "offload/steps.hpp"
#include "tierflow/core/affinity.hpp"
#include "tierflow/core/assert.hpp"
#include "tierflow/optim/executor.hpp"
#include "tierflow/optim/gradients.hpp"

namespace tierflow::bench {
namespace {

using clock = offload_clock;

// One direction of the modelled PCIe link: transfers queue one after another.
// Thread-safe (the CPU step uploads from its own thread).
class pcie_direction {
 public:
  explicit pcie_direction(const sim_device& model) : model_(model) {}
  // Queues `bytes`, to start no earlier than `not_before`; returns when they will have arrived.
  clock::time_point send(std::uint64_t bytes, clock::time_point not_before = {}) {
    std::lock_guard lock(mutex_);
    const auto start = std::max({clock::now(), free_at_, not_before});
    free_at_ = start + span_of(model_.transfer_seconds(bytes));
    bytes_ += bytes;
    return free_at_;
  }
  void count(std::uint64_t bytes) {
    std::lock_guard lock(mutex_);
    bytes_ += bytes;
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

// A standard normal value fixed by `key`: two hashed uniforms, Box–Muller.
double normal_of(std::uint64_t key) {
  auto mix = [](std::uint64_t h) {
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    return h ^ (h >> 32);
  };
  const double u1 = (static_cast<double>(mix(key) >> 11) + 0.5) * 0x1p-53;
  const double u2 = static_cast<double>(mix(key ^ 0x9E3779B97F4A7C15ull) >> 11) * 0x1p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

// bf16's bit pattern of x, rounded to nearest even (x finite).
std::uint16_t bf16_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// ZenFlow's device side, simulated: no device memory, only time and bytes.
// The gradient it hands down is a fixed random buffer, so the host's
// accumulation reads real bytes: bf16, widened and added into the window on
// one thread per CPU of the constructing thread (the trainer's), as
// cuda_zenflow_device does with its downloads.
class sim_zenflow_device final : public zenflow::device_side {
 public:
  sim_zenflow_device(const offload_plan& plan, pcie_direction& down, pcie_direction& up,
                     std::span<const float> gradient)
      : plan_(plan), model_(plan.options.device_model), down_(down), up_(up), gradient_(gradient),
        host_threads_(static_cast<int>(current_affinity().size()), "auto", current_affinity()),
        selected_columns_(plan.chunks.size(), 0) {
    gradient_bf16_.reserve(gradient.size());
    for (const float g : gradient) gradient_bf16_.push_back(bf16_bits(g));
    // The first upload, as cuda_zenflow_device::initialize counts it: every
    // weight's compute copy (bf16) and the 1-D weights' fp32 masters.
    for (const auto& c : plan.chunks) up_.count(c.shape.elements() * (c.shape.matrix() ? 2 : 6));
  }

  // The step whose gradient the device holds, and when its backward ends.
  // As cuda_zenflow_device does once the gradients are ready, the downloads
  // of the weights the host will add up start into its pinned slots, in the
  // order the host asks for them, each later one once the host has read the
  // one a slot's worth before it.
  void set_step(std::uint64_t step, clock::time_point backward_end) {
    step_ = step;
    backward_end_ = backward_end;
    download_order_.clear();
    downloads_.clear();
    next_download_ = 0;
    {
      std::lock_guard lock(mutex_);
      for (std::size_t w = 0; w < plan_.chunks.size(); ++w) {
        const zenflow::weight_shape& shape = plan_.chunks[w].shape;
        if (shape.matrix() && selected_columns_[w] < shape.cols) download_order_.push_back(w);
      }
    }
    for (unsigned slot = 0; slot < download_slots; ++slot) issue_download();
  }

  // Column importances, log-normal: ln of a column's squared gradient norm
  // is sigma·z with sigma = 3.65, so the top 1% of columns carry 90% of the
  // squared norm. z mixes a draw fixed per column with one redrawn every
  // step (correlation 0.9 between any two steps): a stable core of important
  // columns and churn at its edge. l1 scores a column by its norm, l2 by its
  // squared norm.
  void column_importance(std::size_t w, zenflow::importance_norm norm, std::span<float> out) override {
    constexpr double sigma = 3.65, kept = 0.9;
    const double exponent = norm == zenflow::importance_norm::l2 ? sigma : sigma / 2;
    for (std::size_t c = 0; c < out.size(); ++c) {
      const std::uint64_t column = (static_cast<std::uint64_t>(w) << 32) ^ c;
      const double z = std::sqrt(kept) * normal_of(column * 0x9E3779B97F4A7C15ull) +
                       std::sqrt(1 - kept) * normal_of(column * 0xD1B54A32D192ED03ull + step_ + 1);
      out[c] = static_cast<float>(std::exp(exponent * z));
    }
    arrive(down_.send(out.size() * sizeof(float), backward_end_));
  }
  void update_owned(std::size_t w, std::int64_t) override {
    // Adam over the owned elements, memory-bound: read the fp32 master and
    // moments and the bf16 gradient, write the three and the bf16 copy.
    add_device_bytes(owned_elements(w) * 28);
  }
  std::span<const float> download_gradient(std::size_t w) override {
    const std::uint64_t n = plan_.chunks[w].shape.elements();
    arrive(down_.send(n * 2, backward_end_));  // bf16, the whole weight
    return gradient_.first(static_cast<std::size_t>(n));
  }
  bool accumulate_gradient(std::size_t w, std::span<const zenflow::column_run> runs, std::span<float> sum) override {
    const zenflow::weight_shape& shape = plan_.chunks[w].shape;
    const auto issued = downloads_.find(w);
    if (issued == downloads_.end()) {
      arrive(down_.send(shape.elements() * 2, backward_end_));  // asked out of order: fetched now
    } else {
      arrive(issued->second);
      downloads_.erase(issued);
    }
    optim::accumulate_gradient(host_threads_, gradient_bf16_.data(), dtype::bf16, runs, shape.rows, sum);
    issue_download();  // its slot is free again
    return true;
  }
  void stage_upload(std::size_t w, std::span<const zenflow::column_run> runs, std::span<const float>) override {
    if (runs.empty()) return;
    // One bf16 copy over the span the runs cover, and the columns' indices.
    const std::uint64_t rows = plan_.chunks[w].shape.rows;
    arrive(up_.send((runs.back().end - runs.front().begin) * rows * 2 + columns_in(runs) * 4));
  }
  void apply_staged(std::size_t w, std::span<const zenflow::column_run> runs) override {
    add_device_bytes(columns_in(runs) * plan_.chunks[w].shape.rows * 4);  // a bf16 copy: read and write
  }
  void hand_over(std::size_t w, std::span<const std::uint32_t> selected, const zenflow::packed_columns& entering,
                 const zenflow::packed_columns& leaving) override {
    const std::uint64_t rows = plan_.chunks[w].shape.rows, slots = selected.size();
    // Up, one copy laid out as cuda_zenflow_device lays it out: the entering
    // columns' master and moments (fp32), then each slot's source, the
    // leaving slots and the selection; down: the leaving columns' three planes.
    auto align = [](std::uint64_t n) { return (n + 15) / 16 * 16; };
    const std::uint64_t sources_at = align(3 * entering.columns.size() * rows * 4);
    const std::uint64_t leaving_at = align(sources_at + slots * 8);
    const std::uint64_t columns_at = align(leaving_at + leaving.columns.size() * 8);
    const auto up_done = up_.send(columns_at + slots * 4);
    const auto down_done = down_.send(3 * leaving.columns.size() * rows * 4);
    arrive(std::max(up_done, down_done) + span_of(model_.hbm_seconds(slots * rows * 24)));  // and the repack
    std::lock_guard lock(mutex_);
    selected_columns_[w] = slots;
  }

  // Device seconds of the side's work since the last call.
  double take_device_seconds() {
    std::lock_guard lock(mutex_);
    return model_.hbm_seconds(std::exchange(device_bytes_, 0));
  }

 private:
  static void arrive(clock::time_point when) { std::this_thread::sleep_until(when); }
  void issue_download() {
    if (next_download_ == download_order_.size()) return;
    const std::size_t w = download_order_[next_download_++];
    downloads_[w] = down_.send(plan_.chunks[w].shape.elements() * 2, backward_end_);  // bf16, the whole weight
  }
  static std::uint64_t columns_in(std::span<const zenflow::column_run> runs) {
    std::uint64_t n = 0;
    for (const auto run : runs) n += run.end - run.begin;
    return n;
  }
  std::uint64_t owned_elements(std::size_t w) {
    const auto& shape = plan_.chunks[w].shape;
    std::lock_guard lock(mutex_);
    return shape.matrix() ? selected_columns_[w] * shape.rows : shape.elements();
  }
  void add_device_bytes(std::uint64_t bytes) {
    std::lock_guard lock(mutex_);
    device_bytes_ += bytes;
  }

  const offload_plan& plan_;
  const sim_device& model_;
  pcie_direction& down_;
  pcie_direction& up_;
  std::span<const float> gradient_;
  std::vector<std::uint16_t> gradient_bf16_;  // the same values, as the device holds them
  optim::executor host_threads_;
  std::uint64_t step_ = 0;
  clock::time_point backward_end_{};
  // This step's gradient downloads: the host's order, and when each issued one arrives.
  static constexpr unsigned download_slots = 2;  // as cuda_zenflow_device's pinned slots
  std::vector<std::size_t> download_order_;
  std::size_t next_download_ = 0;
  std::map<std::size_t, clock::time_point> downloads_;
  std::mutex mutex_;
  std::vector<std::uint64_t> selected_columns_;  // per weight
  std::uint64_t device_bytes_ = 0;
};

class sim_timeline final : public device_timeline {
 public:
  sim_timeline(const offload_plan& plan, std::span<const float> gradient)
      : plan_(plan), down_(plan.options.device_model), up_(plan.options.device_model),
        zenflow_(plan, down_, up_, gradient) {
    result_.description = plan.options.device_model.describe();
    result_.compute_seconds = plan.step_compute_seconds;
  }

  void launch(std::uint64_t s) override {
    TF_ASSERT(s == result_.spans.size(), "steps are launched in order");
    const auto start = could_start();
    result_.spans.push_back({start, start + span_of(plan_.step_compute_seconds), 0});
    device_free_ = result_.spans.back().end;
  }
  void mark_next_start(std::uint64_t s) override {
    TF_ASSERT(s == result_.spans.size());
    result_.next_start = could_start();
  }
  void receive_gradient(std::uint64_t s) override {
    // Sent as the last backward produces it: it ends with the backward, or
    // a transfer after the backward began, whichever is later.
    const step_span& span = result_.spans.at(s);
    const auto backward_start = span.end - span_of(plan_.last_backward_seconds);
    const auto arrived = down_.send(plan_.gradient_bytes, backward_start);
    std::this_thread::sleep_until(std::max(arrived, span.end));
  }
  void send_parameters() override { parameters_at_ = up_.send(plan_.parameter_bytes); }
  zenflow::device_side& zenflow_device() override { return zenflow_; }
  void order_after_backward(std::uint64_t s) override { zenflow_.set_step(s, result_.spans.at(s).end); }
  void begin_side(std::uint64_t s) override { std::this_thread::sleep_until(result_.spans.at(s).end); }
  void end_side(std::uint64_t s) override {
    // Issued once the trainer's update_device() returned: a first selection's
    // hand-over holds it up, as on a GPU.
    step_span& span = result_.spans.at(s);
    const double busy = zenflow_.take_device_seconds();
    device_free_ = std::max(span.end, clock::now()) + span_of(busy);
    span.side_seconds = busy;
  }
  device_timeline_result finish() override {
    result_.d2h_bytes = down_.bytes();
    result_.h2d_bytes = up_.bytes();
    return std::move(result_);
  }

 private:
  clock::time_point could_start() const { return std::max({device_free_, parameters_at_, clock::now()}); }

  const offload_plan& plan_;
  pcie_direction down_, up_;
  sim_zenflow_device zenflow_;
  device_timeline_result result_;
  clock::time_point device_free_ = clock::now();
  clock::time_point parameters_at_{};
};

}  // namespace

std::unique_ptr<device_timeline> make_sim_timeline(const offload_plan& plan, std::span<const float> gradient) {
  return std::make_unique<sim_timeline>(plan, gradient);
}

}  // namespace tierflow::bench
