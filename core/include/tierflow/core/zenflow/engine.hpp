// The ZenFlow engine: what happens after each backward pass.
//
// Every step (after full_warm_up_rounds full steps):
//   1. at a selection refresh, score the columns of every 2-D gradient on the
//      device and pick the top topk_ratio of each weight;
//   2. update the selected columns (and every 1-D weight) on the device,
//      with their master values and optimizer state kept there;
//   3. bring the gradient down and add its host-owned columns into the
//      accumulation buffer of the current window.
// Every update window (update_interval steps, or "auto"):
//   4. wait for the previous window's CPU step, upload its result (the device
//      keeps its own newer values for the selected columns);
//   5. start the CPU step over this window's accumulated gradient, on the
//      optimizer threads, overlapped with the next window's steps
//      (overlap_step), or run it at once (no overlap). Overlapped, with a
//      fixed update_interval, it is paced over 3/4 of the window (as long as
//      the steps so far took): a host state streamed from storage spreads
//      its reads and writes (host_state::for_each_paced) instead of taking
//      the storage from the next steps' own reads in one burst.
// Staleness is bounded by one window: the host-owned columns the device
// computes with are at most one window behind (asserted at every upload).
//
// Column ownership: every column of every weight is owned by exactly one side
// at every moment. A refresh is decided at a select boundary, from that
// step's gradient, and takes effect at the end of the next window, so that
// its passes over the host's state run in the CPU steps, off the trainer's
// thread: the CPU step of the deciding window copies the entering columns'
// master values and state out as it streams them (a pass it makes anyway),
// the columns change sides at the next boundary in host memory alone, and
// the CPU step that follows writes the leaving columns' state in. Columns
// entering the device first get the gradient they accumulated in the window
// just ended applied on the host, so no gradient is lost and none is applied
// twice. With a fixed update_interval they enter in update_device() of the
// window's last step, before the device's update, and the leaving columns
// leave in its step(), after the host's accumulation: step() then changes
// nothing the next forward reads. Each side counts its own steps (the device one per step, the host
// one per window), so the state that crosses is rebased to the count of the
// side it enters (update_rule::rebase_state): Adam's bias-corrected moments
// are the same just after the crossing as just before. With update_interval
// 1 and no overlap the counts agree and ZenFlow computes exactly what the
// plain optimizer computes, whatever the selection. The first selection has
// no window before it: it reads the selected columns' state at once, and
// the step that makes it holds the next forward.
//
// Weights whose unit is the whole matrix (Muon) are selected whole: the top
// topk_ratio of those weights by gradient mass are updated on the device
// every step, the others asynchronously on the host.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tierflow/core/affinity.hpp"
#include "tierflow/core/optimizer_stream.hpp"
#include "tierflow/core/thread_annotations.hpp"
#include "tierflow/core/zenflow/config.hpp"
#include "tierflow/core/zenflow/selection.hpp"

namespace tierflow::zenflow {

// One parameter. A 2-D weight is stored transposed, column after column:
// column c is elements [c·rows, (c+1)·rows) of its flat buffer. A 1-D weight
// has cols == 1.
struct weight_shape {
  std::string name;
  std::uint64_t rows = 0;
  std::uint64_t cols = 1;
  bool matrix() const noexcept { return cols > 1; }
  std::uint64_t elements() const noexcept { return rows * cols; }
};

// Columns [begin, end) of one weight.
struct column_run {
  std::uint32_t begin = 0;
  std::uint32_t end = 0;
  friend bool operator==(const column_run&, const column_run&) = default;
};

// The ascending runs of columns that `split` gives to the host.
std::vector<column_run> host_runs(const column_split& split);

// Calls fn(run, position) for each run of consecutive columns in the
// ascending `columns`, `position` being the index of its first column there
// (where the run starts in state packed column after column).
template <class Fn>
void for_each_packed_run(std::span<const std::uint32_t> columns, Fn&& fn) {
  std::size_t first = 0;
  for (std::size_t k = 1; k <= columns.size(); ++k) {
    if (k < columns.size() && columns[k] == columns[k - 1] + 1) continue;
    fn(column_run{columns[first], columns[k - 1] + 1}, first);
    first = k;
  }
}

enum class side { device, host };
enum class granularity { columns, matrix };

// One optimizer step over contiguous columns of one weight. Spans hold
// `columns · rows` elements: fp32 master values, the gradient (mean over the
// window on the host, this step's on the device) and the states.
struct update_args {
  const weight_shape* weight = nullptr;
  std::size_t weight_index = 0;
  std::uint32_t first_column = 0;
  std::uint32_t columns = 0;
  std::span<float> param;
  std::span<const float> grad;
  std::span<float> state0;  // Adam: exp_avg; Muon: momentum buffer
  std::span<float> state1;  // Adam: exp_avg_sq; empty for Muon
  std::int64_t step = 1;    // this side's 1-based step count for the columns
  zenflow::side where = side::host;
};

// The state of contiguous columns of one weight crossing sides at a
// refresh. Each side counts its own steps: the device one per step, the host
// one per window.
struct crossing_args {
  const weight_shape* weight = nullptr;
  std::size_t weight_index = 0;
  std::uint32_t first_column = 0;
  std::uint32_t columns = 0;
  std::span<float> state0;  // `columns · rows` elements, as in update_args
  std::span<float> state1;  // empty for a rule with one state
  std::int64_t from_step = 1;  // the count of the side left: the step of the state's last update (≥ 1)
  std::int64_t to_step = 1;    // the count of the side entered: its next update is to_step + 1 (≥ 1)
};

// The master values and states of some columns of one weight, packed in the
// order of `columns` (ascending): the i-th column is elements
// [i·rows, (i+1)·rows) of each span. What crosses sides at a refresh.
struct packed_columns {
  std::span<const std::uint32_t> columns;
  std::span<float> param;
  std::span<float> state0;
  std::span<float> state1;  // empty for a rule with one state
};

// Adam's moments rebased from one step count to another: m·(1−β1^to)/(1−β1^from)
// and v·(1−β2^to)/(1−β2^from), so that the bias-corrected moments Adam divides
// by at to_step are exactly those it had at from_step.
void rebase_adam_moments(const crossing_args& a, double beta1, double beta2);

// The optimizer arithmetic, supplied by the program (optim/ implements it);
// core only schedules it. apply() is called from one thread at a time per
// side; it may parallelise inside.
class update_rule {
 public:
  virtual ~update_rule() = default;
  // How weight `w` may be split between the sides: any columns (Adam), or only
  // as a whole (Muon's hidden matrices). A mixed rule (Muon with AdamW for
  // embeddings) answers per weight.
  virtual granularity unit(std::size_t w) const noexcept = 0;
  // State buffers per element, the most any weight uses (Adam 2, Muon 1); a
  // weight whose host buffers have no second state gets an empty state1.
  virtual std::size_t state_count() const noexcept = 0;
  virtual void apply(const update_args& args) = 0;
  // Columns crossing sides keep their state, but their side's step count
  // changes under them. A rule that corrects its state by the step count
  // (Adam's bias corrections: call rebase_adam_moments) rescales it here so
  // that the corrected state at to_step is what it was at from_step;
  // without it an entering column's first device updates come out about
  // 1.85× too large after 400 steps at update_interval 4, and a leaving
  // column's host updates about 0.54×. The default leaves the state as it
  // is, which is right for state without a step-dependent correction
  // (Muon's momentum). Called on the trainer's thread, never while a CPU
  // step runs.
  virtual void rebase_state(const crossing_args& args) { (void)args; }
  // Called on the trainer's thread once for each host step count, at the
  // step that ends the window it belongs to: before any apply() with
  // `host_step` on either thread, and before the CPU step that applies it
  // is handed to the engine's thread (whose hand-off orders this call's
  // writes before that step's reads). A rule whose hyper-parameters change
  // between steps (an LR schedule) fixes here the values the host's step
  // `host_step` applies, so that the trainer may change them for the next
  // steps while that CPU step runs. The default does nothing.
  virtual void begin_host_step(std::int64_t host_step) { (void)host_step; }
};

// Where the host's fp32 master values and optimizer state live (pinned
// memory, or blocks streamed from NVMe through the store). The engine asks
// for one weight's buffers at a time.
struct host_buffers {
  std::span<float> param;
  std::span<float> state0;
  std::span<float> state1;
};

class host_state {
 public:
  virtual ~host_state() = default;
  // Runs `fn(index, buffers)` for each weight index in `weights`, in order,
  // with the weight's buffers; the buffers are written back after fn
  // returns. May stream (read ahead, write behind).
  virtual void for_each(std::span<const std::size_t> weights,
                        const std::function<void(std::size_t, const host_buffers&)>& fn) = 0;
  // The same pass with a pace, for the CPU step that runs beside training
  // (overlap_step): a state streamed from storage spreads its I/O by `pace`
  // (stream_pace), so the training step's own reads of that storage are
  // not crowded out in one burst at the window's start. A state in memory
  // has no I/O to spread and runs the pass at once (the default).
  virtual void for_each_paced(std::span<const std::size_t> weights,
                              const std::function<void(std::size_t, const host_buffers&)>& fn,
                              stream_pace& pace) {
    (void)pace;
    for_each(weights, fn);
  }
};

// The device side of ZenFlow: the device's copy of the parameters and the
// gradients, the selected columns' master values and state. Implemented over
// CUDA, over host memory (the stand-in), or as a simulation. The engine calls
// stage_upload() from its CPU-step thread and everything else from the
// trainer's thread, so an implementation keeps the staging area apart from
// the compute copy.
class device_side {
 public:
  virtual ~device_side() = default;
  // The importance of each column of this step's gradient of weight `w`.
  virtual void column_importance(std::size_t w, importance_norm norm, std::span<float> out) = 0;
  // Updates the device-owned columns of `w` (all of a 1-D weight) with this
  // step's gradient, at step `step`, and refreshes their compute copy.
  virtual void update_owned(std::size_t w, std::int64_t step) = 0;
  // This step's gradient of `w` in host memory (fp32, the whole weight),
  // brought down device → host; valid until the next download_gradient()
  // call, for any weight (the engine adds each up before asking for the
  // next, so one host buffer may serve every weight).
  virtual std::span<const float> download_gradient(std::size_t w) = 0;
  // Optional: adds this step's gradient of `w` over the column `runs`
  // (ascending) into `sum` (fp32, the whole weight) in one fused pass, the
  // same values as download_gradient() added by hand. Returns false when the
  // device side does not offer it; the engine then downloads and adds itself.
  virtual bool accumulate_gradient(std::size_t w, std::span<const column_run> runs, std::span<float> sum) {
    (void)w;
    (void)runs;
    (void)sum;
    return false;
  }
  // Sends the new master values of the host-owned `runs` of `w` (host memory
  // laid out as the whole weight) up to a staging area on the device, host →
  // device, while the device keeps computing with its current copy.
  virtual void stage_upload(std::size_t w, std::span<const column_run> runs, std::span<const float> master) = 0;
  // Makes the staged `runs` of `w` the compute copy's (device-local, quick).
  virtual void apply_staged(std::size_t w, std::span<const column_run> runs) = 0;
  // Makes `selected` the device-owned columns of `w`: takes the master
  // values and states of entering.columns from `entering`, and writes those
  // of leaving.columns (columns it owned that `selected` leaves out) into
  // `leaving`. Both are small (the columns that move), in host memory.
  virtual void hand_over(std::size_t w, std::span<const std::uint32_t> selected, const packed_columns& entering,
                         const packed_columns& leaving) = 0;
  // Optional, for checkpoints (engine::read_state): copies the master values
  // and states of the columns of `w` the device owns (ascending; column 0 of
  // a 1-D weight) into `out`, packed in that order, and changes nothing.
  // Returns false when the device side does not offer it.
  virtual bool read_owned(std::size_t w, const packed_columns& out) {
    (void)w;
    (void)out;
    return false;
  }
  // Optional, for checkpoints (engine::restore): replaces the master values
  // and states of the columns of `w` the device owns with `in` (the same
  // columns, packed), and their compute copy with the master values.
  // Returns false when the device side does not offer it.
  virtual bool write_owned(std::size_t w, const packed_columns& in) {
    (void)w;
    (void)in;
    return false;
  }
};

struct step_report {
  std::uint64_t step = 0;
  bool warm_up = false;
  bool refreshed = false;       // columns changed sides after this step
  bool selection_decided = false;  // the next selection was chosen; it takes effect at the next window's end
  bool update_boundary = false;
  bool cpu_step_started = false;
  std::chrono::nanoseconds wait_for_cpu{0};  // the device waited for the previous CPU step (the stall)
  std::chrono::nanoseconds host_work{0};     // accumulation, uploads, hand-overs on the trainer thread
};

struct engine_stats {
  std::uint64_t steps = 0;
  std::uint64_t cpu_steps = 0;
  std::uint64_t refreshes = 0;  // hand-overs, the first selection among them
  std::chrono::nanoseconds wait_for_cpu{0};
  std::chrono::nanoseconds cpu_step_time{0};  // summed duration of the CPU steps, their pacing included
  // The span the last overlapped CPU step was asked to spread its pass over
  // (host_state::for_each_paced); zero when it was not paced.
  std::chrono::nanoseconds cpu_step_pace{0};
};

// The engine's own state at a quiet moment (after finish()): with the
// master values and optimizer state (engine::read_state), what resuming
// exactly needs.
struct engine_checkpoint {
  std::uint64_t steps = 0;      // steps done: the device's step count
  std::int64_t host_steps = 0;  // CPU steps done: the host's step count
  bool selection_made = false;  // false: the first step after warm-up makes the first selection
  // Per weight, the columns the device owns (ascending; {0} for a 1-D weight).
  std::vector<std::vector<std::uint32_t>> selected;
  update_trigger::state trigger;  // update_interval "auto": the masses seen since the last CPU step
};

class engine {
 public:
  // `weights` in the order of their index everywhere. `device`, `host` and
  // `rule` must outlive the engine. Throws user_error for an invalid config
  // (validated), no weights, or a rule/weight mismatch.
  engine(const config& cfg, std::vector<weight_shape> weights, device_side& device, host_state& host,
         update_rule& rule);
  // Waits for the CPU step in flight (its result is dropped if finish() was
  // not called).
  ~engine();
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  // Runs ZenFlow's work for the step whose backward just produced the
  // gradients on the device. Rethrows an error of the previous CPU step.
  step_report step();
  // Steps 1 and 2 of step() alone: the first selection when it is due, the
  // columns of a refresh chosen a window ago joining the device when this
  // step ends the window (a fixed update_interval; it waits for the CPU
  // step that staged them, as apply_previous_window() does), and the
  // device's update of the columns it owns with this step's gradient.
  // step() calls it itself when the trainer has not. A trainer that overlaps
  // the host's part of a step with the next forward calls update_device()
  // once the backward is done, launches the next forward (unless
  // device_waits_for_step()), then calls step(); this step's gradient must
  // stay readable on the device until step() returns (a second gradient
  // buffer, as the next backward writes its own).
  void update_device();
  // Whether the next step() may change what the device computes with, so
  // the next forward has to wait for it: with update_interval "auto", a
  // window end at which columns change sides (a refresh chosen a window
  // earlier; with a fixed interval update_device() moves them), a warm-up
  // step or a step without overlap_step that ends a window
  // (its CPU step is applied at once), or a window boundary whose previous
  // window apply_previous_window() has not applied yet. With
  // update_interval "auto" any step may end a window, and answers as one.
  bool device_waits_for_step() const;
  // Waits for the CPU step in flight (if any) and makes its result the
  // device's; returns how long it waited. step() does this itself at an
  // update boundary, after the step's gradient; a trainer that knows the
  // boundary is coming (a fixed update_interval: will_update()) calls it
  // earlier, during that step's backward, so the next step does not wait for
  // the gradient's trip to the host. Applying early changes no value: the
  // window in flight never touches the columns the device updates.
  std::chrono::nanoseconds apply_previous_window();
  // Whether the step about to run (the next step() call) ends an update
  // window; unknown (false) with update_interval "auto" until it has run.
  bool will_update() const;
  // Waits for the CPU step in flight and uploads its result, then closes the
  // open window at once, so the device holds the newest parameters (before
  // evaluation or a checkpoint). A refresh decided and not yet made is
  // dropped: the selection stays as it is until the next select boundary.
  void finish();

  // The parameters' values were replaced from outside the optimizer (a
  // model's load_state_dict): after finish(), the host's copy of each column
  // it owns is taken again from values[w] (weight w whole, in its layout:
  // the new compute values), through host_state::for_each — a weight at a
  // time, so a state streamed from storage never comes whole into memory —
  // and every state is left as it is, as torch's optimizers keep theirs when
  // a model's weights are loaded. The device's columns are the device's
  // own: for a device side that computes on the parameters (cpu_device) they
  // are the new values already. Throws user_error unless the engine is
  // quiet, or for values not of the weights' sizes.
  void reload_values(std::span<const std::span<const float>> values);

  // ---- checkpoints ----
  // A checkpoint is taken at a quiet moment: after finish(), before the
  // next step. Columns on either side keep their own step count (the
  // device's, the host's); what read_state() gives and restore() takes is
  // the state as one optimizer over the whole weight would hold it at the
  // device's count, steps(): the host-owned columns' state rebased to it
  // (update_rule::rebase_state) on the way out and back on the way in, so
  // a resumed run equals the one that went on, up to one rounding of the
  // host-owned columns' state when the two counts differ (bit for bit
  // when they agree, as with update_interval 1 without overlap).

  // The engine's state. Throws user_error unless the engine is quiet.
  engine_checkpoint checkpoint() const;
  // Copies every weight's master values and state into `out` (out[w]: the
  // whole weight in its layout; state1 empty for a one-state rule), the
  // state at the device's count steps(). Reads the host's state through
  // host_state::for_each and the device's through device_side::read_owned.
  // Throws user_error unless the engine is quiet, or the device side does
  // not offer read_owned.
  void read_state(std::span<const host_buffers> out);
  // Resumes from `c` on an engine that has run no step: the counts, the
  // selection and the trigger become c's, and in[w] (the whole weight, as
  // read_state() gives it, its state at step count counts[w]; 0: never
  // updated) is split between the host (its columns' state rebased to
  // c.host_steps) and the device (hand_over() for a matrix's selected
  // columns, write_owned() for a 1-D weight, rebased to c.steps). Throws
  // user_error for an engine that has stepped, a checkpoint that does not
  // fit the weights (sizes, columns out of order or range, part of a
  // whole-matrix weight) or a device side without write_owned.
  void restore(const engine_checkpoint& c, std::span<const host_buffers> in, std::span<const std::int64_t> counts);

  // A checkpoint that leaves the host's state where it lies, for a host
  // state in a store (streamed_host_state: the store's own checkpoint saves
  // its blocks as they are, through its host budget, and restores them
  // into a new store of the same weights): the host's bytes keep their own
  // count, nothing is rebased, and a resumed run is the one that went on,
  // bit for bit. These two move the rest, the device's columns.
  //
  // Copies the master values and state of the columns the device owns into
  // `out` (out[w].columns: selected(w), ascending; {0} for a 1-D weight;
  // each span columns × rows floats, state1 empty for a one-state rule), at
  // the device's count. Throws user_error unless the engine is quiet, for
  // buffers not of that shape, or a device side without read_owned.
  void read_device_state(std::span<const packed_columns> out);
  // Resumes from `c` and `in` (read_device_state()'s, of c.selected) on an
  // engine that has run no step and whose host state the caller has made
  // the saved engine's: the counts, the selection and the trigger become
  // c's, and the device takes `in` (hand_over() for a matrix's selected
  // columns, write_owned() for a 1-D weight). Throws user_error as restore()
  // does, or for `in` not of c's selection's shape (the engine unchanged
  // then), or for a device side without write_owned.
  void restore_device_state(const engine_checkpoint& c, std::span<const packed_columns> in);

  // Steps done (the device's step count), and CPU steps done (the host's).
  std::uint64_t steps() const noexcept { return step_; }
  std::int64_t host_steps() const noexcept { return host_step_; }

  const schedule& resolved() const noexcept { return schedule_; }
  // The CPUs split by pt_reserved_cores_perc. With overlap_step the engine's
  // CPU-step thread is pinned to cores().optimizer; the trainer pins its own
  // thread to cores().trainer if it wants to, and builds the optimizer's
  // executor on cores().optimizer (the rule's threads are the program's).
  const core_split& cores() const noexcept { return cores_; }
  const engine_stats& stats() const noexcept { return stats_; }
  const std::vector<weight_shape>& weights() const noexcept { return weights_; }
  // The device-owned columns of weight `w` (empty until the first selection;
  // all for a 1-D weight).
  std::span<const std::uint32_t> selected(std::size_t w) const { return splits_[w].selected(); }
  bool device_owns(std::size_t w, std::uint32_t column) const;

 private:
  // Master values and states of some columns of one weight, packed (the
  // storage behind a packed_columns).
  struct column_state {
    std::vector<std::uint32_t> columns;
    std::vector<float> param, state0, state1;
    packed_columns view() { return {columns, param, state0, state1}; }
  };

  struct window {
    std::vector<std::vector<float>> grad;       // per weight, the gradient summed over the window
    std::vector<std::vector<column_run>> runs;  // per weight, the columns its CPU step updates
    bool runs_fixed = false;                    // set by a hand-over, not recomputed at submission
    // Per weight, for the refresh decided at this window's end: the columns
    // entering the device, whose state its CPU step copies out once updated.
    std::vector<column_state> entering;
    // Per weight, the columns that left the device at this window's end:
    // their state, which its CPU step writes into the host's first.
    std::vector<column_state> leaving;
    std::uint64_t steps = 0;                    // steps accumulated
    std::uint64_t index = 0;                    // which window
    std::int64_t host_step = 0;                 // the host step count its CPU step applies
    std::chrono::nanoseconds duration{0};       // how long its CPU step took
  };

  void accumulate(window& win, bool observe);
  std::vector<std::vector<std::uint32_t>> choose_selection();
  void make_first_selection();
  void decide_selection(window& win);
  void enter_decided(window& win);
  void leave_decided(window& win);
  void drop_decided();
  column_state cross(window& win, std::size_t w, const selection_change& change, column_state& entering);
  column_state pack(std::size_t w, std::span<const std::uint32_t> columns, const host_buffers& buffers) const;
  void unpack(std::size_t w, const column_state& state, const host_buffers& buffers) const;
  void rebase_state(std::size_t w, column_state& state, std::int64_t from_step, std::int64_t to_step);
  void close_window();
  void run_cpu_step(window& win, stream_pace* pace = nullptr);
  void update_host_columns(window& win, std::size_t w, std::span<const column_run> runs,
                           const host_buffers& buffers, std::int64_t host_step);
  void update_run(window& win, std::size_t w, column_run run, std::span<float> param, std::span<float> state0,
                  std::span<float> state1, std::int64_t host_step);
  void wait_and_apply();
  void apply_window(window& win);
  void worker_loop();
  void begin_host_step();
  bool quiet() const;
  // restore()'s checks of `c` against this engine (user_error), and making
  // its counts, trigger and selection the engine's.
  void check_resumable(const engine_checkpoint& c) const;
  void adopt(const engine_checkpoint& c);
  // read_state()'s and read_device_state()'s checks: a quiet engine, and
  // one buffer set per weight (user_error naming `what`).
  void check_readable(std::size_t buffers, const char* what) const;
  // Whether `p` holds `columns` of weight `w` packed, with `two` states.
  bool packed_shape(std::size_t w, std::span<const std::uint32_t> columns, const packed_columns& p, bool two) const;
  void rebase_runs(std::size_t w, std::span<const column_run> runs, const host_buffers& buffers,
                   std::int64_t from_step, std::int64_t to_step);

  config config_;
  schedule schedule_;
  core_split cores_;
  std::vector<weight_shape> weights_;
  device_side& device_;
  host_state& host_;
  update_rule& rule_;

  std::vector<column_split> splits_;
  std::vector<std::vector<column_run>> owned_by_host_;  // per weight, host_runs(splits_[w])
  std::vector<std::size_t> matrices_;   // indices of 2-D weights
  update_trigger trigger_;
  std::vector<float> importance_;       // scratch: one weight's column scores
  window windows_[2];
  int current_ = 0;                     // the window accumulating
  std::uint64_t step_ = 0;              // steps done
  std::int64_t host_step_ = 0;          // host step count (bias correction on the host)
  std::int64_t begun_host_step_ = 0;    // the last count update_rule::begin_host_step() was told
  std::uint64_t next_window_ = 0;       // index of the next window to open
  std::uint64_t applied_window_ = 0;    // windows whose results the device computes with
  bool selection_made_ = false;
  // A refresh decided at a select boundary, made at the next window's end:
  // per weight, the selection it makes; the window whose CPU step copies
  // the entering columns' state out.
  std::vector<std::vector<std::uint32_t>> decided_;
  window* decided_by_ = nullptr;  // set until the entering columns have crossed
  bool entered_ = false;          // they have, and the leaving ones are still to cross
  // update_device() ran for the step about to run: whether it made the first
  // selection, and how long it took (both go into the step's report).
  bool device_updated_ = false;
  bool first_selection_ = false;
  bool entered_now_ = false;                        // columns chosen a window ago entered the device
  std::chrono::nanoseconds device_update_time_{0};  // not counting device_update_wait_
  std::chrono::nanoseconds device_update_wait_{0};  // for the CPU step that staged them

  // The time between step() calls, smoothed: what an update window lasts,
  // for the pace of the CPU step overlapped with it.
  std::chrono::steady_clock::time_point last_step_at_{};
  std::chrono::nanoseconds step_interval_{0};
  // The pace of the CPU step in flight: reset when a window is handed to
  // the worker, hurried as soon as the trainer waits for it.
  stream_pace pace_;

  // The CPU step in flight: at most one (staleness ≤ one window).
  mutex mutex_;
  std::condition_variable cv_;
  window* pending_ TF_GUARDED_BY(mutex_) = nullptr;   // submitted, not yet finished
  window* finished_ TF_GUARDED_BY(mutex_) = nullptr;  // finished, not yet applied
  bool started_ TF_GUARDED_BY(mutex_) = false;        // the worker took pending_
  std::exception_ptr cpu_error_ TF_GUARDED_BY(mutex_);
  bool stop_ TF_GUARDED_BY(mutex_) = false;
  std::thread worker_;

  engine_stats stats_;
};

}  // namespace tierflow::zenflow
