#include "tierflow/core/zenflow/engine.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::zenflow {
namespace {

using clock = std::chrono::steady_clock;

// The share of an update window over which the overlapped CPU step spreads
// its pass (close_window). Measured on a 25M-parameter model with its state
// on NVMe at update_interval 4: 3/4 took the step from 0.354 s to 0.338 s
// (0.557 s to 0.494 s on a busier disk); 9/10 no faster, and the trainer
// then waited at a third of the boundaries for the end of the pass.
constexpr double pace_share = 0.75;

// The sorted columns of `a` that are not in `b` (both ascending).
std::vector<std::uint32_t> difference(std::span<const std::uint32_t> a, std::span<const std::uint32_t> b) {
  std::vector<std::uint32_t> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

std::size_t count_matrices(const std::vector<weight_shape>& weights) {
  return static_cast<std::size_t>(std::count_if(weights.begin(), weights.end(),
                                                [](const weight_shape& w) { return w.matrix(); }));
}

}  // namespace

std::vector<column_run> host_runs(const column_split& split) {
  std::vector<column_run> runs;
  for (std::uint32_t c = 0; c < split.columns(); ++c) {
    if (split.on_device(c)) continue;
    if (!runs.empty() && runs.back().end == c) ++runs.back().end;
    else runs.push_back({c, c + 1});
  }
  return runs;
}

engine::engine(const config& cfg, std::vector<weight_shape> weights, device_side& device, host_state& host,
               update_rule& rule)
    : config_(cfg),
      schedule_(resolve(cfg)),
      weights_(std::move(weights)),
      device_(device),
      host_(host),
      rule_(rule),
      trigger_(std::max<std::size_t>(1, count_matrices(weights_)), cfg.auto_ratio) {
  if (weights_.empty()) throw user_error("zenflow: no weights to optimize");
  if (rule_.state_count() != 1 && rule_.state_count() != 2)
    throw user_error("zenflow: the update rule must keep one or two state buffers");
  for (const auto& w : weights_) {
    if (w.rows == 0 || w.cols == 0) throw user_error("zenflow: weight \"" + w.name + "\" has an empty shape");
    if (w.cols > UINT32_MAX) throw user_error("zenflow: weight \"" + w.name + "\" has too many columns");
  }
  const int window_count = config_.overlap_step ? 2 : 1;
  for (std::size_t w = 0; w < weights_.size(); ++w) {
    if (weights_[w].matrix()) {
      matrices_.push_back(w);
      splits_.emplace_back(weights_[w].cols);  // the host owns every column until the first selection
    } else {
      splits_.emplace_back(1);
      const std::uint32_t only = 0;
      splits_.back().refresh(std::span(&only, 1));  // 1-D weights: always the device's
    }
    owned_by_host_.push_back(host_runs(splits_.back()));
  }
  for (int k = 0; k < window_count; ++k) {
    windows_[k].grad.resize(weights_.size());
    windows_[k].runs.resize(weights_.size());
    windows_[k].entering.resize(weights_.size());
    windows_[k].leaving.resize(weights_.size());
    for (const std::size_t w : matrices_) windows_[k].grad[w].assign(weights_[w].elements(), 0.0f);
  }
  cores_ = split_cores(config_.pt_reserved_cores_perc);
  if (config_.overlap_step) {
    worker_ = std::thread(&engine::worker_loop, this);
    try {
      pin_thread(worker_.native_handle(), cores_.optimizer);
    } catch (...) {
      {
        lock_guard lock(mutex_);
        stop_ = true;
      }
      cv_.notify_all();
      worker_.join();
      throw;
    }
  }
}

engine::~engine() {
  pace_.hurry();  // a paced CPU step in flight finishes at once
  {
    lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

bool engine::device_owns(std::size_t w, std::uint32_t column) const {
  TF_ASSERT(w < splits_.size() && column < splits_[w].columns());
  return splits_[w].on_device(column);
}

void engine::update_device() {
  if (device_updated_) return;
  const auto started = clock::now();
  const bool warm = step_ < schedule_.warm_up_steps;
  first_selection_ = false;
  entered_now_ = false;
  device_update_wait_ = {};
  if (!warm && !selection_made_) {
    make_first_selection();
    selection_made_ = true;
    first_selection_ = true;
  }
  // A refresh chosen a window ago, with a fixed update_interval that says
  // this step ends the window: its entering columns join the device before
  // its update, so that this step's gradient of theirs is the device's and
  // the host's part of the step has nothing to hand over that the next
  // forward reads. (With "auto" the window's end is known only once the
  // step's gradient is in: step() hands over there.)
  if (decided_by_ != nullptr && schedule_.update_interval &&
      (is_update_boundary(schedule_, step_) || is_select_boundary(schedule_, step_))) {
    const auto wait_start = clock::now();
    wait_and_apply();  // the deciding window's CPU step staged the entering state
    device_update_wait_ = clock::now() - wait_start;
    enter_decided(windows_[current_]);
    entered_now_ = true;
  }
  // 2. The device-owned columns and the 1-D weights, on the device, every step.
  const auto device_step = static_cast<std::int64_t>(step_) + 1;
  for (std::size_t w = 0; w < weights_.size(); ++w) {
    if (!splits_[w].selected().empty()) device_.update_owned(w, device_step);
  }
  device_updated_ = true;
  device_update_time_ =
      std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - started) - device_update_wait_;
}

bool engine::device_waits_for_step() const {
  const bool warm = step_ < schedule_.warm_up_steps;
  if (warm) return true;  // every warm-up step ends a window, and applies it at once
  const bool may_end_window =
      !schedule_.update_interval || is_update_boundary(schedule_, step_) || is_select_boundary(schedule_, step_);
  if (!may_end_window) return false;
  // With "auto", columns chosen a window ago join the device in step().
  if (decided_by_ != nullptr && !schedule_.update_interval) return true;
  // Without overlap the window's CPU step is applied at once; with it, the
  // boundary applies the previous window unless apply_previous_window() has.
  return !config_.overlap_step || next_window_ != applied_window_;
}

step_report engine::step() {
  const auto started = clock::now();
  if (last_step_at_ != clock::time_point{}) {
    auto interval = std::chrono::duration_cast<std::chrono::nanoseconds>(started - last_step_at_);
    // A step far slower than usual (an evaluation or a checkpoint between
    // two) counts as twice the usual at most.
    if (step_interval_.count() > 0) interval = std::min(interval, 2 * step_interval_);
    step_interval_ = step_interval_.count() == 0 ? interval : (3 * step_interval_ + interval) / 4;
  }
  last_step_at_ = started;
  const bool updated_before = device_updated_;
  update_device();
  step_report report;
  report.step = step_;
  const bool warm = step_ < schedule_.warm_up_steps;
  report.warm_up = warm;
  report.refreshed = first_selection_ || entered_now_;
  report.wait_for_cpu = device_update_wait_;
  const bool auto_interval = !schedule_.update_interval;

  // 3. The host-owned columns' gradient, added into the window.
  accumulate(windows_[current_], !warm && auto_interval);
  windows_[current_].steps += 1;

  const bool select = !warm && is_select_boundary(schedule_, step_);
  const bool boundary = warm || select || (auto_interval ? trigger_.due() : is_update_boundary(schedule_, step_));
  if (boundary) {
    report.update_boundary = true;
    const auto wait_start = clock::now();
    wait_and_apply();  // 4. the previous window's result
    report.wait_for_cpu += clock::now() - wait_start;
    if (decided_by_ != nullptr) {
      enter_decided(windows_[current_]);  // "auto": chosen a window ago, staged by that window's CPU step
      report.refreshed = true;
    }
    if (entered_) leave_decided(windows_[current_]);
    if (select) {
      decide_selection(windows_[current_]);
      report.selection_decided = true;
    }
    close_window();  // 5. this window's CPU step
    report.cpu_step_started = true;
    if (auto_interval) trigger_.reset();
  }
  ++step_;
  device_updated_ = false;
  stats_.steps += 1;
  stats_.wait_for_cpu += report.wait_for_cpu;
  report.host_work = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - started) - report.wait_for_cpu;
  if (updated_before) report.host_work += device_update_time_;
  return report;
}

void engine::accumulate(window& win, bool observe) {
  for (std::size_t i = 0; i < matrices_.size(); ++i) {
    const std::size_t w = matrices_[i];
    const column_split& split = splits_[w];
    if (observe) {
      importance_.resize(split.columns());
      device_.column_importance(w, config_.norm, importance_);
      double important = 0, unimportant = 0;
      for (std::uint32_t c = 0; c < split.columns(); ++c)
        (split.on_device(c) ? important : unimportant) += importance_[c];
      trigger_.observe(i, important, unimportant);
    }
    if (owned_by_host_[w].empty()) continue;
    if (device_.accumulate_gradient(w, owned_by_host_[w], win.grad[w])) continue;
    const std::span<const float> g = device_.download_gradient(w);
    TF_ASSERT(g.size() == weights_[w].elements(), "download_gradient returned a wrong size");
    float* sum = win.grad[w].data();
    const std::uint64_t rows = weights_[w].rows;
    for (const column_run r : owned_by_host_[w]) {
      const std::uint64_t begin = r.begin * rows, end = r.end * rows;
      for (std::uint64_t k = begin; k < end; ++k) sum[k] += g[k];
    }
  }
}

std::vector<std::vector<std::uint32_t>> engine::choose_selection() {
  // The next selection of every 2-D weight, from this step's gradient.
  std::vector<std::vector<std::uint32_t>> next(weights_.size());
  std::vector<std::size_t> whole;  // weights selected as a whole
  std::vector<float> mass;
  for (const std::size_t w : matrices_) {
    importance_.resize(weights_[w].cols);
    device_.column_importance(w, config_.norm, importance_);
    if (rule_.unit(w) == granularity::columns) {
      next[w] = top_columns(importance_, columns_to_keep(weights_[w].cols, config_.topk_ratio));
    } else {
      double sum = 0;
      for (const float x : importance_) sum += x;
      whole.push_back(w);
      mass.push_back(static_cast<float>(sum));
    }
  }
  if (!whole.empty()) {
    // The top topk_ratio of the whole-matrix weights by gradient mass.
    for (const std::uint32_t i : top_columns(mass, columns_to_keep(whole.size(), config_.topk_ratio))) {
      const std::size_t w = whole[i];
      next[w].resize(weights_[w].cols);
      for (std::uint32_t c = 0; c < next[w].size(); ++c) next[w][c] = c;
    }
  }
  return next;
}

void engine::make_first_selection() {
  // No window precedes it to stage the entering state: read it now, while
  // the next forward waits (nothing has accumulated yet, nothing leaves).
  const std::vector<std::vector<std::uint32_t>> next = choose_selection();
  std::vector<selection_change> changes(weights_.size());
  std::vector<std::size_t> changed;
  for (const std::size_t w : matrices_) {
    changes[w] = splits_[w].refresh(next[w]);
    owned_by_host_[w] = host_runs(splits_[w]);
    if (!changes[w].entering.empty() || !changes[w].leaving.empty()) changed.push_back(w);
  }
  window& win = windows_[current_];
  host_.for_each(changed, [&](std::size_t w, const host_buffers& buffers) {
    column_state entering = pack(w, changes[w].entering, buffers);
    unpack(w, cross(win, w, changes[w], entering), buffers);
  });
  stats_.refreshes += 1;
}

void engine::decide_selection(window& win) {
  // Columns change sides at the next window's end; this window's CPU step,
  // which updates every host-owned column, copies the entering ones out.
  decided_ = choose_selection();
  bool moves = false;
  for (const std::size_t w : matrices_) {
    const std::span<const std::uint32_t> now = splits_[w].selected();
    win.entering[w] = {};
    win.entering[w].columns = difference(decided_[w], now);
    moves = moves || !std::ranges::equal(now, decided_[w]);
  }
  decided_by_ = moves ? &win : nullptr;
}

void engine::enter_decided(window& win) {
  // The device takes the entering columns, and keeps the leaving ones until
  // leave_decided(): for a moment it owns both.
  window& staged = *decided_by_;
  for (const std::size_t w : matrices_) {
    const std::span<const std::uint32_t> now = splits_[w].selected();
    std::vector<std::uint32_t> both;
    std::set_union(now.begin(), now.end(), decided_[w].begin(), decided_[w].end(), std::back_inserter(both));
    const selection_change change = splits_[w].refresh(both);
    if (change.entering.empty()) continue;
    column_state entering = std::move(staged.entering[w]);
    TF_ASSERT(entering.columns == change.entering, "zenflow: the staged columns are not the entering ones");
    cross(win, w, change, entering);
    owned_by_host_[w] = host_runs(splits_[w]);
  }
  for (column_state& e : staged.entering) e = {};
  decided_by_ = nullptr;
  entered_ = true;
  stats_.refreshes += 1;
}

void engine::leave_decided(window& win) {
  // The leaving columns' state comes into host memory, rebased to the host's
  // count; win's CPU step writes it into the host's state first, and the
  // next window's is the first to update them, so win's runs stay as they
  // were accumulated.
  for (const std::size_t w : matrices_) {
    win.runs[w] = owned_by_host_[w];
    win.leaving[w] = {};
    const selection_change change = splits_[w].refresh(decided_[w]);
    TF_ASSERT(change.entering.empty(), "zenflow: columns entering as others leave");
    if (change.leaving.empty()) continue;
    column_state none;
    win.leaving[w] = cross(win, w, change, none);
    owned_by_host_[w] = host_runs(splits_[w]);
  }
  win.runs_fixed = true;
  entered_ = false;
  decided_.clear();
}

void engine::drop_decided() {
  // Columns that entered stay the device's, those that were to leave too:
  // nothing is lost, the selection is only larger until the next refresh.
  if (decided_by_ != nullptr) {
    for (column_state& e : decided_by_->entering) e = {};
  }
  decided_by_ = nullptr;
  entered_ = false;
  decided_.clear();
}

engine::column_state engine::cross(window& win, std::size_t w, const selection_change& change,
                                   column_state& entering) {
  // Columns entering the device first get this window's gradient applied on
  // the host (at the step count the window's CPU step will use), so nothing
  // accumulated is lost; then master values and state cross over, the state
  // rebased to the step count of the side it enters: the device's steps so
  // far, or the host's once this window's CPU step has run (the first step
  // that updates a leaving column is the next window's).
  const std::int64_t window_step = host_step_ + 1;
  const std::int64_t device_count = static_cast<std::int64_t>(step_) + (device_updated_ ? 1 : 0);
  std::int64_t host_count = host_step_;
  if (win.steps > 0 && !entering.columns.empty()) {
    begin_host_step();  // at the window's end: the update below applies the coming host step
    const std::uint64_t rows = weights_[w].rows;
    for_each_packed_run(entering.columns, [&](column_run run, std::size_t at) {
      const std::size_t begin = at * rows, n = (run.end - run.begin) * rows;
      update_run(win, w, run, std::span(entering.param).subspan(begin, n),
                 std::span(entering.state0).subspan(begin, n),
                 entering.state1.empty() ? std::span<float>() : std::span(entering.state1).subspan(begin, n),
                 window_step);
    });
    host_count = window_step;
  }
  rebase_state(w, entering, host_count, device_count);
  const std::size_t n = change.leaving.size() * weights_[w].rows;
  column_state leaving;
  leaving.columns = change.leaving;
  leaving.param.resize(n);
  leaving.state0.resize(n);
  if (rule_.state_count() > 1) leaving.state1.resize(n);
  device_.hand_over(w, splits_[w].selected(), entering.view(), leaving.view());
  rebase_state(w, leaving, device_count, window_step);
  return leaving;
}

engine::column_state engine::pack(std::size_t w, std::span<const std::uint32_t> columns,
                                  const host_buffers& buffers) const {
  const std::uint64_t rows = weights_[w].rows;
  column_state out;
  out.columns.assign(columns.begin(), columns.end());
  const std::size_t n = columns.size() * rows;
  out.param.resize(n);
  out.state0.resize(n);
  if (!buffers.state1.empty()) out.state1.resize(n);
  for_each_packed_run(columns, [&](column_run run, std::size_t at) {
    const std::size_t from = run.begin * rows, to = at * rows, count = (run.end - run.begin) * rows;
    std::copy_n(buffers.param.begin() + from, count, out.param.begin() + to);
    std::copy_n(buffers.state0.begin() + from, count, out.state0.begin() + to);
    if (!out.state1.empty()) std::copy_n(buffers.state1.begin() + from, count, out.state1.begin() + to);
  });
  return out;
}

void engine::unpack(std::size_t w, const column_state& state, const host_buffers& buffers) const {
  const std::uint64_t rows = weights_[w].rows;
  for_each_packed_run(state.columns, [&](column_run run, std::size_t at) {
    const std::size_t from = at * rows, to = run.begin * rows, count = (run.end - run.begin) * rows;
    std::copy_n(state.param.begin() + from, count, buffers.param.begin() + to);
    std::copy_n(state.state0.begin() + from, count, buffers.state0.begin() + to);
    if (!buffers.state1.empty() && !state.state1.empty())
      std::copy_n(state.state1.begin() + from, count, buffers.state1.begin() + to);
  });
}

void engine::rebase_state(std::size_t w, column_state& state, std::int64_t from_step, std::int64_t to_step) {
  // A state never updated is zero at any count; equal counts need nothing.
  if (state.columns.empty() || from_step == 0 || from_step == to_step) return;
  const weight_shape& shape = weights_[w];
  const std::uint64_t rows = shape.rows;
  for_each_packed_run(state.columns, [&](column_run run, std::size_t at) {
    const std::size_t begin = at * rows, n = (run.end - run.begin) * rows;
    crossing_args args;
    args.weight = &shape;
    args.weight_index = w;
    args.first_column = run.begin;
    args.columns = run.end - run.begin;
    args.state0 = std::span(state.state0).subspan(begin, n);
    if (!state.state1.empty()) args.state1 = std::span(state.state1).subspan(begin, n);
    args.from_step = from_step;
    args.to_step = to_step;
    rule_.rebase_state(args);
  });
}

void rebase_adam_moments(const crossing_args& a, double beta1, double beta2) {
  TF_ASSERT(a.from_step >= 1 && a.to_step >= 1, "rebase_adam_moments: step counts are 1-based");
  auto factor = [&](double beta) {
    return static_cast<float>((1.0 - std::pow(beta, static_cast<double>(a.to_step))) /
                              (1.0 - std::pow(beta, static_cast<double>(a.from_step))));
  };
  const float f0 = factor(beta1), f1 = factor(beta2);
  for (float& m : a.state0) m *= f0;
  for (float& v : a.state1) v *= f1;
}

void engine::close_window() {
  window& win = windows_[current_];
  win.index = next_window_++;
  // Bounded staleness: a window's CPU step starts only once every earlier
  // window's result is on the device, so at most one window is in flight.
  TF_ASSERT(win.index == applied_window_, "zenflow staleness bound: an earlier window is not applied yet");
  begin_host_step();  // before the CPU step is run or handed to the engine's thread
  win.host_step = ++host_step_;
  if (!win.runs_fixed) {
    for (const std::size_t w : matrices_) win.runs[w] = owned_by_host_[w];
  }
  win.runs_fixed = false;
  if (decided_by_ != &win) {
    for (column_state& e : win.entering) e = {};
  }

  const bool overlap = config_.overlap_step && step_ >= schedule_.warm_up_steps;
  if (!overlap) {
    run_cpu_step(win);
    stats_.cpu_steps += 1;
    stats_.cpu_step_time += win.duration;
    apply_window(win);
    return;
  }
  // The CPU step has the next window to finish in: with a state streamed
  // from storage it spreads its pass over three quarters of it (the steps
  // measured so far tell how long that is), rather than reading and writing
  // the whole state in one burst while the next steps read their own data
  // from the same storage. The last quarter leaves room for a slower step,
  // and a trainer that waits for the pass hurries it (wait_and_apply).
  std::chrono::nanoseconds spread{0};
  if (schedule_.update_interval && step_interval_.count() > 0) {
    spread = std::chrono::duration_cast<std::chrono::nanoseconds>(
        step_interval_ * static_cast<double>(*schedule_.update_interval) * pace_share);
  }
  pace_.reset(spread);
  stats_.cpu_step_pace = spread;
  {
    lock_guard lock(mutex_);
    TF_ASSERT(pending_ == nullptr && finished_ == nullptr);
    pending_ = &win;
    started_ = false;
  }
  cv_.notify_all();
  current_ ^= 1;  // the other window was applied and emptied: it accumulates next
}

void engine::run_cpu_step(window& win, stream_pace* pace) {
  const auto started = clock::now();
  const bool updates = win.steps > 0;
  std::vector<std::size_t> todo;
  for (const std::size_t w : matrices_) {
    if ((updates && !win.runs[w].empty()) || !win.leaving[w].columns.empty() || !win.entering[w].columns.empty())
      todo.push_back(w);
  }
  if (!todo.empty()) {
    const auto each = [&](std::size_t w, const host_buffers& buffers) {
      // The columns that left the device at this window's end come home
      // first; the window's own columns are updated; then the columns a
      // refresh will move to the device are copied out, as updated.
      unpack(w, win.leaving[w], buffers);
      win.leaving[w] = {};
      if (updates && !win.runs[w].empty()) {
        update_host_columns(win, w, win.runs[w], buffers, win.host_step);
        device_.stage_upload(w, win.runs[w], buffers.param);
      }
      if (!win.entering[w].columns.empty()) {
        std::vector<std::uint32_t> columns = std::move(win.entering[w].columns);
        win.entering[w] = pack(w, columns, buffers);
      }
    };
    if (pace != nullptr) {
      host_.for_each_paced(todo, each, *pace);
    } else {
      host_.for_each(todo, each);
    }
  }
  win.steps = 0;
  win.duration = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - started);
}

void engine::update_host_columns(window& win, std::size_t w, std::span<const column_run> runs,
                                 const host_buffers& buffers, std::int64_t host_step) {
  const weight_shape& shape = weights_[w];
  const std::uint64_t rows = shape.rows;
  TF_ASSERT(buffers.param.size() == shape.elements(), "host buffers of the wrong size");
  if (rule_.unit(w) == granularity::matrix) {
    TF_ASSERT(runs.size() == 1 && runs[0].begin == 0 && runs[0].end == shape.cols,
              "a matrix-granular rule updates whole matrices");
  }
  for (const column_run r : runs) {
    const std::uint64_t begin = r.begin * rows, n = (r.end - r.begin) * rows;
    update_run(win, w, r, buffers.param.subspan(begin, n), buffers.state0.subspan(begin, n),
               buffers.state1.empty() ? std::span<float>() : buffers.state1.subspan(begin, n), host_step);
  }
}

void engine::update_run(window& win, std::size_t w, column_run run, std::span<float> param, std::span<float> state0,
                        std::span<float> state1, std::int64_t host_step) {
  // The host applies the window's mean gradient, and consumes it.
  const weight_shape& shape = weights_[w];
  const std::uint64_t rows = shape.rows;
  const std::span<float> grad(win.grad[w].data() + run.begin * rows, (run.end - run.begin) * rows);
  if (win.steps > 1) {
    const float scale = 1.0f / static_cast<float>(win.steps);
    for (float& x : grad) x *= scale;
  }
  update_args args;
  args.weight = &shape;
  args.weight_index = w;
  args.first_column = run.begin;
  args.columns = run.end - run.begin;
  args.param = param;
  args.grad = grad;
  args.state0 = state0;
  args.state1 = state1;
  args.step = host_step;
  args.where = side::host;
  rule_.apply(args);
  std::fill(grad.begin(), grad.end(), 0.0f);  // consumed: the window can be reused
}

void engine::wait_and_apply() {
  window* done = nullptr;
  if (config_.overlap_step) {
    pace_.hurry();  // the trainer waits: the CPU step in flight goes at full speed
    unique_lock lock(mutex_);
    while (pending_ != nullptr) lock.wait(cv_);
    done = std::exchange(finished_, nullptr);
    if (cpu_error_) {
      drop_decided();  // its entering state was not staged
      std::rethrow_exception(std::exchange(cpu_error_, nullptr));
    }
  }
  if (done != nullptr) {
    stats_.cpu_steps += 1;
    stats_.cpu_step_time += done->duration;
    apply_window(*done);
  }
}

void engine::apply_window(window& win) {
  TF_ASSERT(win.index == applied_window_, "zenflow staleness bound: windows are applied in order");
  for (const std::size_t w : matrices_) {
    if (!win.runs[w].empty()) device_.apply_staged(w, win.runs[w]);
  }
  applied_window_ = win.index + 1;
}

void engine::worker_loop() {
  for (;;) {
    window* win = nullptr;
    {
      unique_lock lock(mutex_);
      while (!stop_ && (pending_ == nullptr || started_)) lock.wait(cv_);
      if (stop_) return;
      win = pending_;
      started_ = true;
    }
    std::exception_ptr error;
    try {
      run_cpu_step(*win, &pace_);
    } catch (...) {
      error = std::current_exception();
    }
    {
      lock_guard lock(mutex_);
      // Published under the lock: the trainer thread reads the window after
      // it sees pending_ cleared, so the CPU step's writes happen-before.
      finished_ = win;
      pending_ = nullptr;
      cpu_error_ = error;
    }
    cv_.notify_all();
  }
}

std::chrono::nanoseconds engine::apply_previous_window() {
  const auto start = clock::now();
  wait_and_apply();
  const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start);
  stats_.wait_for_cpu += waited;
  return waited;
}

bool engine::will_update() const {
  if (step_ < schedule_.warm_up_steps) return true;
  return is_select_boundary(schedule_, step_) ||
         (schedule_.update_interval && is_update_boundary(schedule_, step_));
}

void engine::finish() {
  wait_and_apply();
  drop_decided();
  if (windows_[current_].steps > 0) {
    // Close the open window at once, as if this step ended one.
    window& win = windows_[current_];
    win.index = next_window_++;
    TF_ASSERT(win.index == applied_window_);
    begin_host_step();
    win.host_step = ++host_step_;
    for (const std::size_t w : matrices_) win.runs[w] = owned_by_host_[w];
    win.runs_fixed = false;
    run_cpu_step(win);
    stats_.cpu_steps += 1;
    stats_.cpu_step_time += win.duration;
    apply_window(win);
  }
}

void engine::begin_host_step() {
  // Once per count, on the trainer's thread, while no CPU step runs (every
  // caller comes after wait_and_apply() or in a step without overlap): the
  // rule's writes here reach the engine's thread through the hand-off of
  // the window under mutex_ (close_window()).
  if (begun_host_step_ == host_step_ + 1) return;
  begun_host_step_ = host_step_ + 1;
  rule_.begin_host_step(begun_host_step_);
}

bool engine::quiet() const {
  // Every window closed was applied (nothing in flight or waiting), none has
  // accumulated a step since, and no refresh is half made.
  return next_window_ == applied_window_ && windows_[0].steps == 0 && windows_[1].steps == 0 &&
         !device_updated_ && decided_by_ == nullptr && !entered_ && decided_.empty();
}

void engine::rebase_runs(std::size_t w, std::span<const column_run> runs, const host_buffers& buffers,
                         std::int64_t from_step, std::int64_t to_step) {
  // A state never updated is zero at any count; equal counts need nothing.
  if (from_step <= 0 || to_step <= 0 || from_step == to_step) return;
  const weight_shape& shape = weights_[w];
  for (const column_run r : runs) {
    const std::size_t begin = r.begin * shape.rows, n = (r.end - r.begin) * shape.rows;
    crossing_args args;
    args.weight = &shape;
    args.weight_index = w;
    args.first_column = r.begin;
    args.columns = r.end - r.begin;
    args.state0 = buffers.state0.subspan(begin, n);
    if (!buffers.state1.empty()) args.state1 = buffers.state1.subspan(begin, n);
    args.from_step = from_step;
    args.to_step = to_step;
    rule_.rebase_state(args);
  }
}

engine_checkpoint engine::checkpoint() const {
  if (!quiet()) throw user_error("zenflow: a checkpoint needs a quiet engine: call finish() first");
  engine_checkpoint c;
  c.steps = step_;
  c.host_steps = host_step_;
  c.selection_made = selection_made_;
  for (const column_split& split : splits_) c.selected.emplace_back(split.selected().begin(), split.selected().end());
  c.trigger = trigger_.save();
  return c;
}

namespace {

void copy_floats(std::span<const float> from, std::span<float> to) {
  TF_ASSERT(from.size() == to.size());
  // The same buffer on both sides (a host master that is the parameter itself).
  if (from.data() != to.data() && !from.empty()) std::copy(from.begin(), from.end(), to.begin());
}

}  // namespace

void engine::read_state(std::span<const host_buffers> out) {
  check_readable(out.size(), "read_state");
  const bool two = rule_.state_count() > 1;
  for (std::size_t w = 0; w < weights_.size(); ++w) {
    const std::uint64_t n = weights_[w].elements();
    if (out[w].param.size() != n || out[w].state0.size() != n || out[w].state1.size() != (two ? n : 0))
      throw user_error("zenflow: read_state: the buffers of weight \"" + weights_[w].name + "\" are not of its size");
  }
  const auto device_count = static_cast<std::int64_t>(step_);
  // The host's own columns, their state rebased to the device's count. Only
  // those: the host's copy of a device-owned column is stale, and `out` may
  // be where the device keeps it (the CPU device's parameters).
  host_.for_each(matrices_, [&](std::size_t w, const host_buffers& buffers) {
    const std::uint64_t rows = weights_[w].rows;
    for (const column_run r : owned_by_host_[w]) {
      const std::size_t begin = r.begin * rows, n = (r.end - r.begin) * rows;
      copy_floats(buffers.param.subspan(begin, n), out[w].param.subspan(begin, n));
      copy_floats(buffers.state0.subspan(begin, n), out[w].state0.subspan(begin, n));
      if (two) copy_floats(buffers.state1.subspan(begin, n), out[w].state1.subspan(begin, n));
    }
    rebase_runs(w, owned_by_host_[w], out[w], host_step_, device_count);
  });
  // The device's, packed, then put in place.
  for (std::size_t w = 0; w < weights_.size(); ++w) {
    const std::span<const std::uint32_t> owned = splits_[w].selected();
    if (owned.empty()) continue;
    column_state packed;
    packed.columns.assign(owned.begin(), owned.end());
    const std::size_t elements = owned.size() * weights_[w].rows;
    packed.param.resize(elements);
    packed.state0.resize(elements);
    if (two) packed.state1.resize(elements);
    if (!device_.read_owned(w, packed.view()))
      throw user_error("zenflow: this device side cannot be read for a checkpoint (no read_owned)");
    unpack(w, packed, out[w]);
  }
}

void engine::reload_values(std::span<const std::span<const float>> values) {
  if (!quiet())
    throw user_error("zenflow: reload_values: a window is open or a CPU step is in flight; call finish() before "
                     "the values are replaced");
  if (values.size() != weights_.size())
    throw user_error("zenflow: reload_values: " + std::to_string(values.size()) + " values for " +
                     std::to_string(weights_.size()) + " weights");
  for (std::size_t w = 0; w < weights_.size(); ++w) {
    if (values[w].size() != weights_[w].elements())
      throw user_error("zenflow: reload_values: the values of weight \"" + weights_[w].name + "\" are not of its size");
  }
  host_.for_each(matrices_, [&](std::size_t w, const host_buffers& buffers) {
    const std::uint64_t rows = weights_[w].rows;
    for (const column_run r : owned_by_host_[w]) {
      const std::size_t begin = r.begin * rows, n = (r.end - r.begin) * rows;
      copy_floats(values[w].subspan(begin, n), buffers.param.subspan(begin, n));
    }
  });
}

void engine::check_resumable(const engine_checkpoint& c) const {
  if (step_ != 0 || selection_made_ || !quiet())
    throw user_error("zenflow: restore needs an engine that has run no step");
  const std::size_t n = weights_.size();
  if (c.selected.size() != n)
    throw user_error("zenflow: the checkpoint has " + std::to_string(c.selected.size()) + " weights' selections for " +
                     std::to_string(n) + " weights");
  if (c.host_steps < 0 || static_cast<std::uint64_t>(c.host_steps) > c.steps)
    throw user_error("zenflow: the checkpoint's host step count " + std::to_string(c.host_steps) +
                     " is not within its " + std::to_string(c.steps) + " steps");
  if (c.selection_made && c.steps < schedule_.warm_up_steps)
    throw user_error("zenflow: the checkpoint has a selection within its warm-up (" + std::to_string(c.steps) +
                     " of " + std::to_string(schedule_.warm_up_steps) + " steps)");
  const auto trigger_size = trigger_.weights();
  if (c.trigger.important.size() != trigger_size || c.trigger.unimportant.size() != trigger_size ||
      c.trigger.seen.size() != trigger_size)
    throw user_error("zenflow: the checkpoint's update trigger is not of this engine's " +
                     std::to_string(trigger_size) + " weights");
  for (std::size_t w = 0; w < n; ++w) {
    const weight_shape& shape = weights_[w];
    const std::string name = "zenflow: weight \"" + shape.name + "\"";
    const std::vector<std::uint32_t>& sel = c.selected[w];
    for (std::size_t i = 0; i < sel.size(); ++i) {
      if (sel[i] >= shape.cols || (i > 0 && sel[i] <= sel[i - 1]))
        throw user_error(name + ": its selected columns are not ascending, unique and below " +
                         std::to_string(shape.cols));
    }
    if (!shape.matrix() && sel.size() != 1) throw user_error(name + ": a 1-D weight's selection must be {0}");
    if (shape.matrix() && !c.selection_made && !sel.empty())
      throw user_error(name + ": columns are selected although the checkpoint has made no selection");
    if (shape.matrix() && rule_.unit(w) == granularity::matrix && !sel.empty() && sel.size() != shape.cols)
      throw user_error(name + ": its rule updates the whole matrix, but only part of it is selected");
  }
}

void engine::adopt(const engine_checkpoint& c) {
  step_ = c.steps;
  host_step_ = c.host_steps;
  begun_host_step_ = c.host_steps;
  selection_made_ = c.selection_made;
  trigger_.load(c.trigger);
  for (const std::size_t w : matrices_) {
    splits_[w].refresh(c.selected[w]);
    owned_by_host_[w] = host_runs(splits_[w]);
  }
}

void engine::check_readable(std::size_t buffers, const char* what) const {
  if (!quiet()) throw user_error("zenflow: reading the state needs a quiet engine: call finish() first");
  if (buffers != weights_.size())
    throw user_error(std::string("zenflow: ") + what + ": " + std::to_string(buffers) + " buffers for " +
                     std::to_string(weights_.size()) + " weights");
}

bool engine::packed_shape(std::size_t w, std::span<const std::uint32_t> columns, const packed_columns& p,
                          bool two) const {
  const std::uint64_t elements = columns.size() * weights_[w].rows;
  return std::ranges::equal(p.columns, columns) && p.param.size() == elements && p.state0.size() == elements &&
         p.state1.size() == (two ? elements : 0);
}

void engine::restore(const engine_checkpoint& c, std::span<const host_buffers> in,
                     std::span<const std::int64_t> counts) {
  check_resumable(c);
  const std::size_t n = weights_.size();
  if (in.size() != n || counts.size() != n)
    throw user_error("zenflow: the checkpoint has " + std::to_string(in.size()) + " buffers and " +
                     std::to_string(counts.size()) + " step counts for " + std::to_string(n) + " weights");
  const bool two = rule_.state_count() > 1;
  for (std::size_t w = 0; w < n; ++w) {
    const std::string name = "zenflow: weight \"" + weights_[w].name + "\"";
    const std::uint64_t elements = weights_[w].elements();
    if (in[w].param.size() != elements || in[w].state0.size() != elements ||
        in[w].state1.size() != (two ? elements : 0))
      throw user_error(name + ": its checkpoint buffers are not of its size");
    if (counts[w] < 0 || static_cast<std::uint64_t>(counts[w]) > c.steps)
      throw user_error(name + ": its step count " + std::to_string(counts[w]) + " is not within the checkpoint's " +
                       std::to_string(c.steps) + " steps");
  }

  adopt(c);
  const auto device_count = static_cast<std::int64_t>(step_);
  // The host takes every column (those the device owns are dead there), its
  // own columns' state rebased to its count; the device's are packed from
  // `in` and handed over, rebased to the device's count.
  host_.for_each(matrices_, [&](std::size_t w, const host_buffers& buffers) {
    copy_floats(in[w].param, buffers.param);
    copy_floats(in[w].state0, buffers.state0);
    if (two) copy_floats(in[w].state1, buffers.state1);
    rebase_runs(w, owned_by_host_[w], buffers, counts[w], host_step_);
    if (c.selected[w].empty()) return;
    column_state entering = pack(w, c.selected[w], in[w]);
    rebase_state(w, entering, counts[w], device_count);
    column_state none;
    device_.hand_over(w, c.selected[w], entering.view(), none.view());
  });
  for (std::size_t w = 0; w < n; ++w) {
    if (weights_[w].matrix()) continue;
    const std::uint32_t only = 0;
    column_state state = pack(w, std::span(&only, 1), in[w]);
    rebase_state(w, state, counts[w], device_count);
    if (!device_.write_owned(w, state.view()))
      throw user_error("zenflow: this device side cannot be restored from a checkpoint (no write_owned)");
  }
}

void engine::read_device_state(std::span<const packed_columns> out) {
  check_readable(out.size(), "read_device_state");
  const bool two = rule_.state_count() > 1;
  for (std::size_t w = 0; w < weights_.size(); ++w) {
    if (!packed_shape(w, splits_[w].selected(), out[w], two))
      throw user_error("zenflow: read_device_state: the buffers of weight \"" + weights_[w].name +
                       "\" are not its " + std::to_string(splits_[w].selected().size()) + " owned columns");
  }
  for (std::size_t w = 0; w < weights_.size(); ++w) {
    if (out[w].columns.empty()) continue;
    if (!device_.read_owned(w, out[w]))
      throw user_error("zenflow: this device side cannot be read for a checkpoint (no read_owned)");
  }
}

void engine::restore_device_state(const engine_checkpoint& c, std::span<const packed_columns> in) {
  check_resumable(c);
  const std::size_t n = weights_.size();
  if (in.size() != n)
    throw user_error("zenflow: the checkpoint has " + std::to_string(in.size()) + " weights' device state for " +
                     std::to_string(n) + " weights");
  const bool two = rule_.state_count() > 1;
  for (std::size_t w = 0; w < n; ++w) {
    if (!packed_shape(w, c.selected[w], in[w], two))
      throw user_error("zenflow: weight \"" + weights_[w].name + "\": its device state is not of its " +
                       std::to_string(c.selected[w].size()) + " selected columns");
  }
  adopt(c);
  for (std::size_t w = 0; w < n; ++w) {
    if (weights_[w].matrix()) {
      if (c.selected[w].empty()) continue;
      column_state none;
      device_.hand_over(w, c.selected[w], in[w], none.view());
    } else if (!device_.write_owned(w, in[w])) {
      throw user_error("zenflow: this device side cannot be restored from a checkpoint (no write_owned)");
    }
  }
}

}  // namespace tierflow::zenflow
