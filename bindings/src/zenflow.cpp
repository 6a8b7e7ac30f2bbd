// tierflow._core.ZenFlowEngine: the C++ ZenFlow engine (core/zenflow) over a
// model's parameters handed in as DLPack views, with optim's zenflow_rule
// (AdamW / Adam by columns, Muon whole-matrix) and the host's state in host
// memory, or on NVMe (nvme_dir: zenflow::streamed_host_state over a store of
// its own, the host budget holding a few weights' state at a time).
//
// CPU parameters (fp32, C-contiguous): the device side is
// zenflow::cpu_device over the tensors themselves, each step's gradients
// named anew (zero-copy both). Without overlap_step the host's master
// values are the parameters too; with it the host keeps its own copy.
// CUDA parameters: optim::cuda_zenflow_device over the tensors in GPU
// memory (Adam only), the host's master an fp32 copy. That path compiles in
// every CUDA build but has not been run from Python here: no GPU was at
// hand when it was written.
//
// With nvme_dir the host's master values and state are blocks in files
// there, streamed through `host_memory` bytes of pinned memory by every CPU
// step; the host's master is then always its own copy, as with overlap_step.
//
// Layout: a parameter of shape (out, in, ...) is the engine's weight of
// rows = in·... and cols = out (column c is the contiguous row c of the
// row-major tensor, one output unit); of shape (n,) or () one column.
//
// Threads: every method runs with the GIL released while the engine works,
// one call at a time per object (a mutex taken with the GIL released). The
// engine's CPU-step thread (overlap_step) touches no Python object: it reads
// and writes the host state and the staging copies this object owns.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>
#include <nlohmann/json.hpp>

#include "arrays.hpp"
#include "bindings.hpp"
#include "offloaded_state.hpp"
#include "tierflow/core/affinity.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/zenflow/config.hpp"
#include "tierflow/core/zenflow/cpu_device.hpp"
#include "tierflow/core/zenflow/engine.hpp"
#include "tierflow/core/zenflow/standin.hpp"
#include "tierflow/core/zenflow/streamed_host_state.hpp"
#include "tierflow/optim/executor.hpp"
#include "tierflow/optim/zenflow_cuda.hpp"
#include "tierflow/optim/zenflow_rule.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {
namespace {

using any_array = nb::ndarray<nb::c_contig>;
using any_const_array = nb::ndarray<nb::ro, nb::c_contig>;

bool on_cuda(const any_array& a) { return a.device_type() == nb::device::cuda::value; }
bool on_cpu(int device_type) { return device_type == nb::device::cpu::value; }

// A Python value as JSON, for zenflow::from_json (which names the key of a
// bad value); `where` names the value in errors.
nlohmann::json to_json(nb::handle v, const std::string& where) {
  if (v.is_none()) return nullptr;
  if (nb::isinstance<nb::bool_>(v)) return nb::cast<bool>(v);
  if (nb::isinstance<nb::int_>(v)) return nb::cast<std::int64_t>(v);
  if (nb::isinstance<nb::float_>(v)) return nb::cast<double>(v);
  if (nb::isinstance<nb::str>(v)) return nb::cast<std::string>(v);
  if (nb::isinstance<nb::dict>(v)) {
    nlohmann::json out = nlohmann::json::object();
    for (auto [key, value] : nb::borrow<nb::dict>(v)) {
      if (!nb::isinstance<nb::str>(key))
        throw user_error(where + ": keys must be strings, got " + nb::cast<std::string>(nb::repr(key)));
      const std::string k = nb::cast<std::string>(key);
      out[k] = to_json(value, where + "." + k);
    }
    return out;
  }
  if (nb::isinstance<nb::list>(v) || nb::isinstance<nb::tuple>(v)) {
    nlohmann::json out = nlohmann::json::array();
    for (nb::handle item : v) out.push_back(to_json(item, where));
    return out;
  }
  throw user_error(where + ": " + nb::cast<std::string>(nb::repr(v)) + " is not a number, string, bool or None");
}

optim::lr_adjustment lr_adjustment_of(const std::string& name) {
  if (name == "original") return optim::lr_adjustment::original;
  if (name == "match_rms_adamw") return optim::lr_adjustment::match_rms_adamw;
  if (name == "spectral_unclamped") return optim::lr_adjustment::spectral_unclamped;
  throw user_error("muon_adjust_lr_fn: '" + name + "' is not 'original', 'match_rms_adamw' or 'spectral_unclamped'");
}

// The engine's weight for a tensor of `shape` (see the file's comment).
zenflow::weight_shape weight_of(const std::string& name, const any_array& a) {
  zenflow::weight_shape w;
  w.name = name;
  if (a.ndim() <= 1) {
    w.rows = a.ndim() == 0 ? 1 : a.shape(0);
    w.cols = 1;
  } else {
    w.cols = a.shape(0);
    w.rows = 1;
    for (std::size_t d = 1; d < a.ndim(); ++d) w.rows *= a.shape(d);
  }
  if (w.elements() == 0) throw user_error("params: \"" + name + "\" has no elements (leave it out)");
  return w;
}

std::span<float> floats(const any_array& a) { return {static_cast<float*>(a.data()), a.size()}; }

using size_given = std::variant<std::uint64_t, std::string>;

// Where the host's state goes: host memory, or the files of `dir` through a
// host budget.
struct host_placement {
  std::optional<std::string> dir;
  std::optional<size_given> host_memory;
  std::uint64_t file_size = 0;
  io::engine_config io{};  // the files' I/O engine (the config's aio section)
};

class zenflow_engine {
 public:
  zenflow_engine(std::vector<any_array> params, std::vector<std::string> names, nb::handle config,
                 std::vector<std::size_t> groups, std::vector<bool> muon, std::optional<int> threads,
                 std::optional<std::vector<any_array>> masters, std::uintptr_t stream,
                 std::optional<std::string> nvme_dir, std::optional<size_given> host_memory, std::uint64_t file_size,
                 const std::optional<nb::dict>& aio)
      : params_(std::move(params)) {
    if (!nvme_dir && aio) throw user_error("aio: the I/O options are for state on NVMe; give nvme_dir too");
    const host_placement placement{std::move(nvme_dir), std::move(host_memory), file_size,
                                   aio ? parse_engine_options(*aio) : io::engine_config{}};
    if (!placement.dir && placement.host_memory)
      throw user_error("host_memory: the host budget is for state on NVMe; give nvme_dir too");
    const std::size_t n = params_.size();
    if (n == 0) throw user_error("params: no parameters to optimize");
    if (names.size() != n || groups.size() != n || muon.size() != n)
      throw user_error("ZenFlowEngine: names, groups and muon must have one entry per parameter");
    config_ = zenflow::from_json(to_json(config, "zenflow"));
    cuda_ = on_cuda(params_[0]);
    for (std::size_t i = 0; i < n; ++i) {
      const any_array& p = params_[i];
      const std::string what = "params[" + std::to_string(i) + "] (\"" + names[i] + "\")";
      if (on_cuda(p) != cuda_ || (!cuda_ && !on_cpu(p.device_type())) ||
          (cuda_ && p.device_id() != params_[0].device_id()))
        throw user_error(what + ": every parameter must be on the CPU, or every one on the same CUDA device");
      const dtype t = element_type(p, what);
      if (!cuda_ && t != dtype::fp32)
        throw user_error(what + ": CPU parameters must be float32 (the engine computes on them in place)");
      if (cuda_ && t != element_type(params_[0], "params[0]"))
        throw user_error(what + ": CUDA parameters must all have one dtype");
      if (muon[i] && p.ndim() != 2) throw user_error(what + ": Muon takes 2-D parameters only");
      weights_.push_back(weight_of(names[i], p));
      kinds_.push_back(muon[i] ? optim::optimizer_kind::muon : optim::optimizer_kind::adamw);
    }
    groups_ = std::move(groups);
    for (const std::size_t g : groups_) group_count_ = std::max(group_count_, g + 1);

    const core_split cores = split_cores(config_.pt_reserved_cores_perc);
    const int host_threads = threads.value_or(static_cast<int>(cores.optimizer.size()));
    if (host_threads < 1) throw user_error("threads: " + std::to_string(host_threads) + " is not ≥ 1");
    host_threads_ = std::make_unique<optim::executor>(host_threads, "auto", cores.optimizer);
    device_threads_ = std::make_unique<optim::executor>(static_cast<int>(std::max<std::size_t>(1, cores.trainer.size())));
    rule_ = std::make_unique<optim::zenflow_rule>(kinds_, *device_threads_, *host_threads_);

    if (!cuda_) {
      if (masters) throw user_error("masters: CPU parameters are their own master values; give none");
      std::vector<std::span<float>> views;
      for (const any_array& p : params_) views.push_back(floats(p));
      cpu_ = std::make_unique<zenflow::cpu_device>(weights_, *rule_, views);
      device_ = cpu_.get();
      if (placement.dir || config_.overlap_step) {
        make_host_state({views.begin(), views.end()}, placement);
      } else {
        host_ = std::make_unique<zenflow::memory_host_state>(weights_, rule_->state_count(), views);
      }
    } else {
      make_cuda_device(masters, stream, cores, placement);
    }
    engine_ = std::make_unique<zenflow::engine>(config_, weights_, *device_, *host_, *rule_);
  }

  ~zenflow_engine() {
    nb::gil_scoped_release unlocked;  // waits for a CPU step in flight
    engine_.reset();
  }
  zenflow_engine(const zenflow_engine&) = delete;
  zenflow_engine& operator=(const zenflow_engine&) = delete;

  // The hyper-parameters of every parameter in `group`, from the next step on.
  void set_group(std::size_t group, double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool decoupled, double muon_momentum, bool muon_nesterov, const std::string& muon_adjust_lr_fn,
                 int muon_ns_steps) {
    if (group >= group_count_) throw user_error("group " + std::to_string(group) + " does not exist");
    optim::adam_options adam{.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay,
                             .decay = decoupled ? optim::weight_decay_mode::decoupled : optim::weight_decay_mode::l2};
    optim::muon_options muon;
    muon.lr = static_cast<float>(lr);
    muon.weight_decay = static_cast<float>(weight_decay);
    muon.momentum = static_cast<float>(muon_momentum);
    muon.nesterov = muon_nesterov ? optim::nesterov::on : optim::nesterov::off;
    muon.ns_steps = muon_ns_steps;
    muon.adjust_lr = lr_adjustment_of(muon_adjust_lr_fn);
    // Checked before any weight takes them, so that a refused value changes nothing.
    (void)optim::adam_optimizer(adam);
    (void)optim::muon_optimizer(muon);
    if (cuda_device_ && group_count_ > 1)
      throw user_error("CUDA parameters: the device's Adam takes one set of hyper-parameters; use one group");
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    for (std::size_t w = 0; w < weights_.size(); ++w) {
      if (groups_[w] != group) continue;
      if (kinds_[w] == optim::optimizer_kind::muon) rule_->set_muon(w, muon);
      else rule_->set_adam(w, adam);
    }
    if (cuda_device_) cuda_device_->set_adam(adam);
  }

  void update_device(std::vector<any_const_array> grads) {
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    name_gradients(grads);
    try {
      engine_->update_device();
    } catch (...) {
      forget_gradients();
      throw;
    }
    device_updated_ = true;
  }

  bool device_waits_for_step() {
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    return engine_->device_waits_for_step();
  }

  nb::dict step(std::optional<std::vector<any_const_array>> grads) {
    zenflow::step_report r;
    {
      nb::gil_scoped_release unlocked;
      const std::lock_guard<std::mutex> hold(in_use_);
      if (device_updated_ && grads)
        throw user_error("grads: update_device() took this step's gradients; call step() without them");
      if (!device_updated_ && !grads) throw user_error("grads: this step's gradients are needed");
      if (grads) name_gradients(*grads);
      try {
        r = engine_->step();
      } catch (...) {
        forget_gradients();
        throw;
      }
      forget_gradients();
    }
    nb::dict out;
    out["step"] = r.step;
    out["warm_up"] = r.warm_up;
    out["refreshed"] = r.refreshed;
    out["selection_decided"] = r.selection_decided;
    out["update_boundary"] = r.update_boundary;
    out["cpu_step_started"] = r.cpu_step_started;
    out["wait_for_cpu_s"] = std::chrono::duration<double>(r.wait_for_cpu).count();
    out["host_work_s"] = std::chrono::duration<double>(r.host_work).count();
    return out;
  }

  void finish() {
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    engine_->finish();
  }

  // The CPU parameters' values were replaced in place: the host's copies of
  // its columns are taken from them again (engine::reload_values).
  void reload_values() {
    if (cuda_)
      throw user_error("reload_values: CUDA parameters keep their fp32 masters apart; load the optimizer's "
                       "state_dict again instead");
    std::vector<std::span<const float>> values;
    for (const any_array& p : params_) values.push_back(floats(p));
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    engine_->reload_values(values);
  }

  nb::dict stats() {
    zenflow::engine_stats s;
    std::uint64_t steps = 0;
    std::int64_t host_steps = 0;
    {
      nb::gil_scoped_release unlocked;
      const std::lock_guard<std::mutex> hold(in_use_);
      s = engine_->stats();
      steps = engine_->steps();
      host_steps = engine_->host_steps();
    }
    nb::dict out;
    out["steps"] = steps;  // the step count, a restored checkpoint's included
    out["host_steps"] = host_steps;
    out["steps_run"] = s.steps;       // by this engine
    out["cpu_steps"] = s.cpu_steps;
    out["refreshes"] = s.refreshes;
    out["wait_for_cpu_s"] = std::chrono::duration<double>(s.wait_for_cpu).count();
    out["cpu_step_s"] = std::chrono::duration<double>(s.cpu_step_time).count();
    out["cpu_step_pace_s"] = std::chrono::duration<double>(s.cpu_step_pace).count();
    return out;
  }

  nb::dict schedule() const {
    const zenflow::schedule& s = engine_->resolved();
    nb::dict out;
    out["warm_up_steps"] = s.warm_up_steps;
    out["select_interval"] = s.select_interval;
    out["update_interval"] = s.update_interval ? nb::cast(*s.update_interval) : nb::cast("auto");
    out["select_interval_source"] = s.select_interval_source;
    out["overlap_step"] = config_.overlap_step;
    out["optimizer_cpus"] = engine_->cores().optimizer;
    out["trainer_cpus"] = engine_->cores().trainer;
    out["device"] = cuda_ ? "cuda" : "cpu";
    out["host_state"] = store_ ? "nvme" : "cpu";
    return out;
  }

  // With the state on NVMe: its directory, the host budget, the bytes of its
  // files' blocks and the store's counters (None otherwise).
  std::optional<std::string> nvme_dir() const { return store_ ? std::optional(nvme_dir_) : std::nullopt; }
  // The I/O engine of the host state's files, or None without them.
  std::optional<nb::dict> io_config() const {
    return store_ ? std::optional(engine_options_of(io_)) : std::nullopt;
  }
  std::optional<std::uint64_t> host_memory() const {
    return store_ ? std::optional(host_memory_) : std::nullopt;
  }
  std::optional<std::uint64_t> nvme_bytes() {
    if (!store_) return std::nullopt;
    return static_cast<zenflow::streamed_host_state&>(*host_).home_bytes();
  }
  nb::object telemetry() {
    if (!store_) return nb::none();
    return nb::module_::import_("json").attr("loads")(store_->telemetry_json());
  }

  std::vector<std::uint32_t> selected(std::size_t w) {
    check_index(w);
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    const auto s = engine_->selected(w);
    return {s.begin(), s.end()};
  }

  std::uintptr_t parameter_address(std::size_t w) const {
    check_index(w);
    if (cpu_) return reinterpret_cast<std::uintptr_t>(cpu_->parameters(w).data());
    return reinterpret_cast<std::uintptr_t>(params_[w].data());
  }

  nb::list shapes() const {
    nb::list out;
    for (const auto& w : weights_) out.append(nb::make_tuple(w.name, w.rows, w.cols));
    return out;
  }

  nb::dict checkpoint() {
    zenflow::engine_checkpoint c;
    {
      nb::gil_scoped_release unlocked;
      const std::lock_guard<std::mutex> hold(in_use_);
      c = engine_->checkpoint();
    }
    nb::dict out;
    out["steps"] = c.steps;
    out["host_steps"] = c.host_steps;
    out["selection_made"] = c.selection_made;
    out["selected"] = c.selected;
    out["trigger_important"] = c.trigger.important;
    out["trigger_unimportant"] = c.trigger.unimportant;
    std::vector<int> seen(c.trigger.seen.begin(), c.trigger.seen.end());
    out["trigger_seen"] = seen;
    return out;
  }

  void read_state(std::vector<any_array> state0, std::vector<any_array> state1,
                  std::optional<std::vector<any_array>> master) {
    const std::vector<zenflow::host_buffers> out = buffers_of(state0, state1, master, "read_state");
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    engine_->read_state(out);
  }

  void restore(nb::dict checkpoint, std::vector<any_array> state0, std::vector<any_array> state1,
               std::optional<std::vector<any_array>> master, std::vector<std::int64_t> counts) {
    const zenflow::engine_checkpoint c = checkpoint_of(checkpoint);
    const std::vector<zenflow::host_buffers> in = buffers_of(state0, state1, master, "restore");
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    engine_->restore(c, in, counts);
  }

  // The checkpoint that leaves the host's state on NVMe where it lies
  // (engine::read_device_state): save_state() writes the store's blocks into
  // its crash-safe checkpoint in `directory` through the host budget and
  // returns its generation; read_device_state() copies the device-owned
  // columns out, packed; load_state() gives a new engine both.
  std::uint64_t save_state(const std::string& directory) {
    require_store("save_state");
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    (void)engine_->checkpoint();  // refused unless quiet: no block may change while it is read
    return save_store(*store_, directory);
  }

  void read_device_state(std::vector<any_array> param, std::vector<any_array> state0,
                         std::vector<any_array> state1) {
    std::vector<std::vector<std::uint32_t>> columns;
    {
      nb::gil_scoped_release unlocked;
      const std::lock_guard<std::mutex> hold(in_use_);
      for (std::size_t w = 0; w < weights_.size(); ++w) {
        const auto s = engine_->selected(w);
        columns.emplace_back(s.begin(), s.end());
      }
    }
    const std::vector<zenflow::packed_columns> out = packed_of(columns, param, state0, state1, "read_device_state");
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    engine_->read_device_state(out);
  }

  void load_state(const std::string& directory, std::uint64_t generation, nb::dict checkpoint,
                  std::vector<any_array> param, std::vector<any_array> state0, std::vector<any_array> state1) {
    require_store("load_state");
    const zenflow::engine_checkpoint c = checkpoint_of(checkpoint);
    const std::vector<zenflow::packed_columns> in = packed_of(c.selected, param, state0, state1, "load_state");
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> hold(in_use_);
    // The store first: it is this engine's own, and a checkpoint it refuses
    // (verified before a byte is written) leaves an engine the caller drops.
    // The device's side writes into the parameters, which the caller may
    // still step with another engine: only once the rest has succeeded, and
    // after checking `c` against the engine.
    load_store(*store_, directory, generation, "load_state");
    engine_->restore_device_state(c, in);
  }

 private:
  static zenflow::engine_checkpoint checkpoint_of(nb::dict checkpoint) {
    zenflow::engine_checkpoint c;
    try {
      c.steps = nb::cast<std::uint64_t>(checkpoint["steps"]);
      c.host_steps = nb::cast<std::int64_t>(checkpoint["host_steps"]);
      c.selection_made = nb::cast<bool>(checkpoint["selection_made"]);
      c.selected = nb::cast<std::vector<std::vector<std::uint32_t>>>(checkpoint["selected"]);
      c.trigger.important = nb::cast<std::vector<double>>(checkpoint["trigger_important"]);
      c.trigger.unimportant = nb::cast<std::vector<double>>(checkpoint["trigger_unimportant"]);
      for (const int s : nb::cast<std::vector<int>>(checkpoint["trigger_seen"]))
        c.trigger.seen.push_back(static_cast<std::uint8_t>(s != 0));
    } catch (const nb::python_error& e) {
      throw user_error(std::string("zenflow checkpoint: a key is missing or of the wrong type (") + e.what() + ")");
    } catch (const nb::cast_error&) {
      throw user_error("zenflow checkpoint: a value is of the wrong type");
    }
    return c;
  }

  void require_store(const char* what) const {
    if (!store_)
      throw user_error(std::string(what) + ": the host's state is in host memory, not on NVMe (no nvme_dir)");
  }

  // Each weight's packed device columns over the given float32 CPU arrays
  // (their sizes are the engine's to check).
  std::vector<zenflow::packed_columns> packed_of(const std::vector<std::vector<std::uint32_t>>& columns,
                                                 std::vector<any_array>& param, std::vector<any_array>& state0,
                                                 std::vector<any_array>& state1, const char* what) const {
    const std::size_t n = weights_.size();
    if (columns.size() != n || param.size() != n || state0.size() != n || state1.size() != n)
      throw user_error(std::string(what) + ": one buffer per parameter in each list");
    std::vector<zenflow::packed_columns> out;
    for (std::size_t w = 0; w < n; ++w) {
      const std::string name = std::string(what) + ": device state of parameter " + std::to_string(w);
      auto check = [&](const any_array& a) {
        if (!on_cpu(a.device_type()) || element_type(a, name) != dtype::fp32)
          throw user_error(name + ": float32 CPU tensors expected");
        return floats(a);
      };
      out.push_back({columns[w], check(param[w]), check(state0[w]), check(state1[w])});
    }
    return out;
  }

  void check_index(std::size_t w) const {
    if (w >= weights_.size())
      throw user_error("weight " + std::to_string(w) + " does not exist (" + std::to_string(weights_.size()) +
                       " weights)");
  }

  // The host's state apart from the parameters, its master values
  // `initial`: in host memory, or streamed from the files of placement.dir.
  void make_host_state(std::vector<std::span<const float>> initial, const host_placement& placement) {
    if (!placement.dir) {
      auto own = std::make_unique<zenflow::memory_host_state>(weights_, rule_->state_count());
      for (std::size_t w = 0; w < weights_.size(); ++w)
        std::copy(initial[w].begin(), initial[w].end(), own->buffers(w).param.begin());
      host_ = std::move(own);
      return;
    }
    // By default room for four weights of the largest (one worked on, the
    // next loading, the last writing back, one spare), or the whole state.
    std::uint64_t largest = 0, total = 0;
    for (const zenflow::weight_shape& w : weights_) {
      if (!w.matrix()) continue;
      const std::uint64_t bytes = zenflow::streamed_host_state::weight_bytes(w, rule_->state_count());
      largest = std::max(largest, bytes);
      total += bytes;
    }
    const std::uint64_t fallback = std::max<std::uint64_t>(std::min(total, 4 * largest), block_alignment);
    host_memory_ = host_memory_of(placement.host_memory.value_or(size_given(fallback)), block_alignment,
                                  " (ZenFlow's state on NVMe streams through host memory)");
    nvme_dir_ = *placement.dir;
    nb::gil_scoped_release unlocked;  // maps the budget, opens the directory, writes the initial state
    io_ = placement.io;
    store_ = make_offload_store(nvme_dir_, host_memory_, placement.file_size, io_);
    host_ = std::make_unique<zenflow::streamed_host_state>(*store_, weights_, rule_->state_count(), initial);
  }

  void make_cuda_device(const std::optional<std::vector<any_array>>& masters, std::uintptr_t stream,
                        const core_split& cores, const host_placement& placement) {
    for (std::size_t w = 0; w < weights_.size(); ++w) {
      if (kinds_[w] == optim::optimizer_kind::muon)
        throw user_error("params[" + std::to_string(w) +
                         "]: Muon is not run on the CUDA device side; keep Muon's matrices on the CPU");
    }
    if (!masters || masters->size() != weights_.size())
      throw user_error("masters: CUDA parameters need their fp32 master values on the CPU, one per parameter");
    std::vector<optim::cuda_zenflow_weight> tensors;
    for (const any_array& p : params_) tensors.push_back({p.data(), nullptr});
    optim::cuda_zenflow_options options;
    options.device = params_[0].device_id();
    options.compute_type = element_type(params_[0], "params[0]");
    options.grad_type = options.compute_type;
    options.adam = optim::adam_options::adamw();
    options.stream = stream;
    options.host_cpus = cores.trainer;
    cuda_device_ = std::make_unique<optim::cuda_zenflow_device>(weights_, std::move(tensors), options);
    device_ = cuda_device_.get();
    std::vector<std::span<const float>> initial;
    for (std::size_t w = 0; w < weights_.size(); ++w) {
      const any_array& m = (*masters)[w];
      const std::string what = "masters[" + std::to_string(w) + "]";
      if (!on_cpu(m.device_type()) || element_type(m, what) != dtype::fp32 || m.size() != weights_[w].elements())
        throw user_error(what + ": the fp32 master values on the CPU, as many as the parameter has");
      const std::span<const float> values(static_cast<const float*>(m.data()), m.size());
      cuda_device_->initialize(w, values);
      initial.push_back(values);
    }
    make_host_state(std::move(initial), placement);
  }

  // This step's gradients, checked, handed to the device side.
  void name_gradients(const std::vector<any_const_array>& grads) {
    if (grads.size() != weights_.size())
      throw user_error("grads: " + std::to_string(grads.size()) + " gradients for " +
                       std::to_string(weights_.size()) + " parameters");
    std::vector<const void*> pointers;
    for (std::size_t w = 0; w < grads.size(); ++w) {
      const any_const_array& g = grads[w];
      const std::string what = "grads[" + std::to_string(w) + "] (\"" + weights_[w].name + "\")";
      if (g.size() != weights_[w].elements())
        throw user_error(what + ": " + std::to_string(g.size()) + " elements, the parameter has " +
                         std::to_string(weights_[w].elements()));
      if (cuda_) {
        if (g.device_type() != nb::device::cuda::value || g.device_id() != params_[0].device_id() ||
            element_type(g, what) != element_type(params_[0], "params[0]"))
          throw user_error(what + ": must be on the parameters' CUDA device, of their dtype");
        pointers.push_back(g.data());
      } else {
        if (!on_cpu(g.device_type()) || element_type(g, what) != dtype::fp32)
          throw user_error(what + ": must be a float32 CPU tensor");
        cpu_->set_gradient(w, {static_cast<const float*>(g.data()), g.size()});
      }
    }
    if (cuda_) cuda_device_->gradients_ready(pointers);
  }

  void forget_gradients() {
    if (cpu_) cpu_->clear_gradients();
    device_updated_ = false;
  }

  std::vector<zenflow::host_buffers> buffers_of(std::vector<any_array>& state0, std::vector<any_array>& state1,
                                                std::optional<std::vector<any_array>>& master,
                                                const char* what) const {
    const std::size_t n = weights_.size();
    if (state0.size() != n || state1.size() != n || (master && master->size() != n))
      throw user_error(std::string(what) + ": one buffer per parameter in each list");
    if (cuda_ && !master) throw user_error(std::string(what) + ": CUDA parameters need master buffers");
    std::vector<zenflow::host_buffers> out;
    for (std::size_t w = 0; w < n; ++w) {
      const std::string name = std::string(what) + ": buffers of parameter " + std::to_string(w);
      auto check = [&](const any_array& a) {
        if (!on_cpu(a.device_type()) || element_type(a, name) != dtype::fp32 || a.size() != weights_[w].elements())
          throw user_error(name + ": float32 CPU tensors of the parameter's size expected");
        return floats(a);
      };
      zenflow::host_buffers b;
      b.state0 = check(state0[w]);
      b.state1 = check(state1[w]);
      // CPU parameters are their own masters: after finish() they hold the newest values.
      b.param = master ? check((*master)[w]) : floats(params_[w]);
      out.push_back(b);
    }
    return out;
  }

  // Declared first: the arrays outlive everything that points into them.
  std::vector<any_array> params_;
  std::vector<zenflow::weight_shape> weights_;
  std::vector<optim::optimizer_kind> kinds_;
  std::vector<std::size_t> groups_;
  std::size_t group_count_ = 0;
  zenflow::config config_;
  bool cuda_ = false;
  std::unique_ptr<optim::executor> host_threads_, device_threads_;
  std::unique_ptr<optim::zenflow_rule> rule_;
  std::unique_ptr<block_store> store_;  // the host state's, on NVMe; outlives host_
  std::string nvme_dir_;
  io::engine_config io_;  // the NVMe tier's, with nvme_dir
  std::uint64_t host_memory_ = 0;
  std::unique_ptr<zenflow::host_state> host_;
  std::unique_ptr<zenflow::cpu_device> cpu_;
  std::unique_ptr<optim::cuda_zenflow_device> cuda_device_;
  zenflow::device_side* device_ = nullptr;
  std::unique_ptr<zenflow::engine> engine_;  // last: destroyed first, with its CPU step
  bool device_updated_ = false;              // update_device() ran for the coming step()
  std::mutex in_use_;
};

}  // namespace

void bind_zenflow(nb::module_& m) {
  m.def("zenflow_schedule",
        [](nb::handle config) {
          const zenflow::config c = zenflow::from_json(to_json(config, "zenflow"));
          const zenflow::schedule s = zenflow::resolve(c);
          nb::dict out;
          out["warm_up_steps"] = s.warm_up_steps;
          out["select_interval"] = s.select_interval;
          out["update_interval"] = s.update_interval ? nb::cast(*s.update_interval) : nb::cast("auto");
          out["select_interval_source"] = s.select_interval_source;
          out["overlap_step"] = c.overlap_step;
          const core_split cores = split_cores(c.pt_reserved_cores_perc);
          out["optimizer_cpus"] = cores.optimizer;
          out["trainer_cpus"] = cores.trainer;
          return out;
        },
        "config"_a,
        "Reads a zenflow config (DeepSpeed's zero_optimization.zenflow keys, and importance_norm,\n"
        "steps_per_epoch) as the engine does and returns its resolved schedule, with the CPUs\n"
        "pt_reserved_cores_perc leaves to the trainer and gives the optimizer. Raises ValueError\n"
        "naming an unknown key or a bad value.");

  nb::class_<zenflow_engine>(m, "ZenFlowEngine",
      "ZenFlow (core/zenflow) over a model's parameters: every step the top topk_ratio of each\n"
      "matrix's columns (output units: rows of a (out, in) tensor) and every 1-D parameter are\n"
      "updated from this step's gradient; the other columns' gradients are summed on the host and\n"
      "applied once per window by the CPU step (on its own thread with overlap_step). The\n"
      "arithmetic is AdamW/Adam by columns, Muon over whole matrices for the parameters marked so.\n"
      "CPU parameters (float32, C-contiguous) are computed on in place and their gradients read\n"
      "where they lie; CUDA parameters go through the CUDA device side (Adam only; compiled in a\n"
      "CUDA build, not yet run from Python). Methods release the GIL while the engine works.\n"
      "Bad arguments, bad zenflow keys or values raise ValueError naming them.")
      .def(nb::init<std::vector<any_array>, std::vector<std::string>, nb::handle, std::vector<std::size_t>,
                    std::vector<bool>, std::optional<int>, std::optional<std::vector<any_array>>, std::uintptr_t,
                    std::optional<std::string>, std::optional<size_given>, std::uint64_t,
                    const std::optional<nb::dict>&>(),
           "params"_a, "names"_a, "config"_a, "groups"_a, "muon"_a, nb::kw_only(), "threads"_a.none() = nb::none(),
           "masters"_a.none() = nb::none(), "stream"_a = 0, "nvme_dir"_a.none() = nb::none(),
           "host_memory"_a.none() = nb::none(), "file_size"_a = 0, "aio"_a.none() = nb::none(),
           "`config` holds DeepSpeed's zero_optimization.zenflow keys (and importance_norm,\n"
           "steps_per_epoch). groups[i] is parameter i's group (set_group); muon[i] marks a 2-D\n"
           "parameter for Muon. threads: the CPU step's threads (default: the optimizer's share of\n"
           "the CPUs, pt_reserved_cores_perc). CUDA parameters need `masters` (fp32 CPU copies)\n"
           "and `stream` (the trainer's cudaStream_t as an int). nvme_dir puts the host's master\n"
           "values and state in files there (of file_size bytes), streamed a weight at a time\n"
           "through host_memory bytes of pinned memory (bytes or '2G'; at least the largest\n"
           "matrix's master and state; default: four of those, or the whole state if smaller);\n"
           "aio sets the files' I/O engine (a dict as Store's).")
      .def("set_group", &zenflow_engine::set_group, "group"_a, nb::kw_only(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a,
           "weight_decay"_a, "decoupled"_a, "muon_momentum"_a = 0.95, "muon_nesterov"_a = true,
           "muon_adjust_lr_fn"_a = "match_rms_adamw", "muon_ns_steps"_a = 5,
           "The hyper-parameters of the group's parameters from the next step on: the device's\n"
           "next update and the CPU step of the window that step ends. Muon's parameters take lr\n"
           "and weight_decay too, scaled by muon_adjust_lr_fn.")
      .def("update_device", &zenflow_engine::update_device, "grads"_a,
           "The device's part of the step (the first selection when due, the owned columns'\n"
           "update) with these gradients; step() (without gradients) completes it.")
      .def("device_waits_for_step", &zenflow_engine::device_waits_for_step,
           "Whether the coming step() may change what the next forward reads.")
      .def("step", &zenflow_engine::step, "grads"_a.none() = nb::none(),
           "One ZenFlow step with this step's gradients (one per parameter, as the parameter's\n"
           "layout), read until it returns; returns the step's report. Rethrows an error of the\n"
           "previous CPU step.")
      .def("finish", &zenflow_engine::finish,
           "Waits for the CPU step in flight and runs the open window at once: the parameters then\n"
           "hold the newest values (before evaluation or a checkpoint).")
      .def("reload_values", &zenflow_engine::reload_values,
           "After finish(): the CPU parameters' values were replaced in place (a model's\n"
           "load_state_dict); the host's copies of its own columns are taken from them again, a\n"
           "weight at a time through the host budget, and every moment is kept.")
      .def("stats", &zenflow_engine::stats, "The step counts (steps, host_steps: a restored run's included) and this engine's counters:\n"
           "steps run, CPU steps, refreshes, time waited for the CPU step and spent in it.")
      .def("schedule", &zenflow_engine::schedule, "The resolved schedule, the CPU split and where the host state is.")
      .def_prop_ro("nvme_dir", &zenflow_engine::nvme_dir, "The host state's directory (on NVMe), else None.")
      .def("io_config", &zenflow_engine::io_config,
           "The I/O engine of the host state's files ({'block_size', 'queue_depth', 'threads',\n"
           "'submit_batch'}), else None.")
      .def_prop_ro("host_memory", &zenflow_engine::host_memory,
                   "The host budget the state streams through, in bytes (on NVMe), else None.")
      .def_prop_ro("nvme_bytes", &zenflow_engine::nvme_bytes, "The bytes of the state's blocks on NVMe, else None.")
      .def("telemetry", &zenflow_engine::telemetry,
           "With the state on NVMe, the store's counters (per tier and link); else None.")
      .def("selected", &zenflow_engine::selected, "index"_a,
           "The device-owned columns (output units) of parameter `index`.")
      .def("parameter_address", &zenflow_engine::parameter_address, "index"_a,
           "Where the engine computes on parameter `index`: its tensor's data_ptr() on the CPU.")
      .def("shapes", &zenflow_engine::shapes, "(name, rows, cols) of each parameter as the engine sees it.")
      .def("checkpoint", &zenflow_engine::checkpoint,
           "The engine's own state after finish(): step counts, selections, the auto trigger.")
      .def("read_state", &zenflow_engine::read_state, "state0"_a, "state1"_a, "master"_a.none() = nb::none(),
           "After finish(): each parameter's state at the engine's step count, into float32 CPU\n"
           "buffers of its size (state0: exp_avg or Muon's momentum buffer, state1: exp_avg_sq),\n"
           "the host-owned columns' moments rebased to that count. `master` is needed for CUDA.")
      .def("restore", &zenflow_engine::restore, "checkpoint"_a, "state0"_a, "state1"_a, "master"_a.none(),
           "counts"_a,
           "Before the first step: resumes from checkpoint() and read_state()'s buffers, each\n"
           "parameter's state taken at counts[i] (rebased to each side's count).")
      .def("save_state", &zenflow_engine::save_state, "directory"_a,
           "With the state on NVMe, after finish(): the host's state, as its blocks are, into\n"
           "tierflow's crash-safe checkpoint in `directory` (manifest.json and blocks-<n>.bin,\n"
           "read through the host budget, never whole in RAM); returns its generation.")
      .def("read_device_state", &zenflow_engine::read_device_state, "param"_a, "state0"_a, "state1"_a,
           "After finish(): the master values and states of the device-owned columns of each\n"
           "parameter (selected(i); the whole of a 1-D one), packed column after column into\n"
           "float32 CPU buffers of len(selected(i)) x rows elements.")
      .def("load_state", &zenflow_engine::load_state, "directory"_a, "generation"_a, "checkpoint"_a, "param"_a,
           "state0"_a, "state1"_a,
           "Before the first step: resumes from save_state()'s checkpoint in `directory` (of that\n"
           "generation), checkpoint() and read_device_state()'s buffers, bit for bit. Raises\n"
           "ValueError for state of other parameters or an interrupted save, TierflowError for a\n"
           "missing or corrupt checkpoint; drop the engine after a failure.");
}

}  // namespace tierflow::python
