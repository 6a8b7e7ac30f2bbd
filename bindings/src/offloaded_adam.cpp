// tierflow._core.OffloadedAdam: Adam/AdamW whose state lives on NVMe and
// streams through a bounded host budget, one whole step over every parameter
// per call.
//
// This is where the pieces meet (the assembly the architecture leaves to the
// program): the store comes from tiers/ (a pinned host tier of exactly the
// budget, an NVMe tier of files in the user's directory; offloaded_state.hpp
// makes it, and keeps the slots, the checkpoint and close()), the chunked state
// and its pipelined pass from core/ (streamed_state over run_optimizer_stream:
// read(i+1) ‖ update(i) ‖ write(i-1)), the arithmetic from optim/ (the fused
// Adam kernel torch.optim.Adam's "cpu" offload runs too, so both give the same
// bits). Parameters and gradients stay where torch keeps them: each chunk's
// update reads and writes them in place through their DLPack views.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "offloaded_state.hpp"
#include "tierflow/core/block.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/core/streamed_state.hpp"
#include "tierflow/optim/adam.hpp"
#include "tierflow/optim/executor.hpp"
#include "tierflow/optim/gradients.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {
namespace {

// The state keys, in torch's names (the fp32 master under tierflow's).
enum state_key : std::size_t { master = 0, exp_avg = 1, exp_avg_sq = 2, max_exp_avg_sq = 3 };
const std::vector<std::string> key_names = {"master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
constexpr std::size_t key_count = 4;
static_assert(minimum_host_memory == sub_groups_in_budget * key_count * block_alignment,
              "the minimum budget is four sub-groups of a page per state buffer");

// Whether no element of `grad` is an inf or a nan, read on `ex`'s threads.
// On the bit patterns: an exponent of all ones is inf or nan in each of
// fp32, bf16 and fp16, and the test vectorizes as a mask and a compare.
template <class Bits>
bool all_finite_bits(optim::executor& ex, const Bits* data, std::size_t n, Bits exponent) {
  constexpr std::size_t grain = 1 << 16;  // elements per task: far above a task's cost
  std::atomic<bool> finite{true};
  ex.run([&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, grain), [&](const tbb::blocked_range<std::size_t>& r) {
      if (!finite.load(std::memory_order_relaxed)) return;  // a hint only: the result is the flag
      bool ok = true;
      for (std::size_t i = r.begin(); i != r.end(); ++i) ok &= (data[i] & exponent) != exponent;
      if (!ok) finite.store(false, std::memory_order_relaxed);
    });
  });
  // parallel_for returns once every task ran (it joins): the relaxed stores are visible here.
  return finite.load(std::memory_order_relaxed);
}

bool all_finite(optim::executor& ex, const optim::const_tensor_ref& grad) {
  switch (grad.type) {
    case dtype::fp32:
      return all_finite_bits<std::uint32_t>(ex, static_cast<const std::uint32_t*>(grad.data), grad.size,
                                            0x7F80'0000u);
    case dtype::bf16:
      return all_finite_bits<std::uint16_t>(ex, static_cast<const std::uint16_t*>(grad.data), grad.size, 0x7F80);
    case dtype::fp16:
      return all_finite_bits<std::uint16_t>(ex, static_cast<const std::uint16_t*>(grad.data), grad.size, 0x7C00);
  }
  return true;
}

std::size_t key_of(const std::string& name) {
  for (std::size_t k = 0; k < key_count; ++k) {
    if (key_names[k] == name) return k;
  }
  throw user_error("key: '" + name + "' is not master_param, exp_avg, exp_avg_sq or max_exp_avg_sq");
}

struct hyper_parameters {
  optim::adam_options options;
  optim::objective objective = optim::objective::minimize;
};

// One parameter of a step, as the update reads it (views of torch's memory).
struct step_entry {
  std::size_t slot = 0;
  optim::tensor_ref param;
  optim::const_tensor_ref grad;
  std::int64_t step = 1;
  std::size_t group = 0;
};

class offloaded_adam : public offloaded_state {
 public:
  offloaded_adam(const std::string& nvme_dir, const std::variant<std::uint64_t, std::string>& host_memory_given,
                 std::uint64_t file_size, const std::optional<nb::dict>& aio)
      : offloaded_state(nvme_dir, host_memory_given, file_size, key_names,
                        " (four sub-groups of a page per state buffer)", aio) {}

  // Registers a parameter of `elements` and makes its state's blocks on NVMe.
  std::size_t add_param(std::uint64_t elements, bool has_master, bool amsgrad) {
    std::lock_guard lock(mutex_);
    require_open();
    std::vector<std::size_t> keys;
    if (has_master) keys.push_back(master);
    keys.insert(keys.end(), {exp_avg, exp_avg_sq});
    if (amsgrad) keys.push_back(max_exp_avg_sq);
    const std::size_t slot = add_slot(elements, keys);
    has_master_.push_back(has_master);
    return slot;
  }

  // One step; see the docstring in bind_offloaded_adam. Returns the slots
  // skipped for a non-finite gradient (skip_nonfinite), in entries' order.
  std::vector<std::size_t> step(optim::executor& ex, const nb::list& entries, const nb::list& groups,
                                bool skip_nonfinite) {
    std::vector<hyper_parameters> hyper;
    for (nb::handle g : groups) hyper.push_back(parse_group(g));
    std::vector<optim::adam_optimizer> kernels;
    for (const auto& h : hyper) kernels.emplace_back(h.options);  // validates them

    // The views, kept alive (and released) with the GIL held.
    std::vector<buffer> params;
    std::vector<const_buffer> grads;
    std::vector<step_entry> work;
    std::vector<bool> seen(slots(), false);
    for (nb::handle item : entries) {
      const auto t = nb::cast<nb::tuple>(item);
      if (t.size() != 5) throw user_error("entries: (slot, param, grad, step, group) tuples expected");
      step_entry e;
      e.slot = nb::cast<std::size_t>(t[0]);
      // No implicit conversion: a copy made here would be updated instead of the tensor.
      try {
        params.push_back(nb::cast<buffer>(t[1], false));
        grads.push_back(nb::cast<const_buffer>(t[2], false));
      } catch (const nb::cast_error&) {
        throw user_error("slot " + std::to_string(e.slot) +
                         ": param and grad must be C-contiguous CPU tensors (DLPack views, never copied)");
      }
      e.step = nb::cast<std::int64_t>(t[3]);
      e.group = nb::cast<std::size_t>(t[4]);
      e.param = view_of(params.back(), "param");
      e.grad = view_of(grads.back(), "grad");
      check_entry(e, hyper.size());
      if (seen[e.slot]) throw user_error("entries: slot " + std::to_string(e.slot) + " is stepped twice");
      seen[e.slot] = true;
      work.push_back(e);
    }

    nb::gil_scoped_release unlocked;  // the whole step, every chunk of every parameter
    std::lock_guard lock(mutex_);
    require_open();
    // A parameter is skipped whole or stepped whole: its gradient is read in
    // full before the first of its chunks streams (the kernel's own check
    // covers one call, here one chunk). A skipped one is left out of the pass.
    std::vector<std::size_t> skipped;
    if (skip_nonfinite) {
      std::vector<step_entry> finite;
      for (const step_entry& e : work) {
        if (all_finite(ex, e.grad)) {
          finite.push_back(e);
        } else {
          skipped.push_back(e.slot);
        }
      }
      work = std::move(finite);
    }
    std::vector<streamed_state::pass_item> items;
    for (const step_entry& e : work) {
      const slot_record s = slot_at(e.slot);
      // amsgrad turned on for a parameter registered without it: its buffer
      // now, before any parameter is touched (ENOSPC here changes nothing).
      if (hyper[e.group].options.amsgrad == optim::amsgrad::on) state_->add_key(s.tensor, max_exp_avg_sq);
      streamed_state::pass_item item{s.tensor, {}};
      auto add = [&](std::size_t k) { item.keys.emplace_back(k, all_fresh(s.tensor, k) ? access::overwrite : access::write); };
      if (s.has_master) add(master);
      add(exp_avg);
      add(exp_avg_sq);
      if (hyper[e.group].options.amsgrad == optim::amsgrad::on) add(max_exp_avg_sq);
      items.push_back(std::move(item));
    }
    state_->stream(items, [&](const streamed_chunk& c) {
      const step_entry& e = work[c.item];
      const slot_record s = slot_at(e.slot);
      const std::size_t n = c.elements;
      const std::size_t first = c.first;
      // The chunk's keys, in the order `items` asked for them.
      std::size_t next = 0;
      std::span<float> m, v, vmax, p;
      const bool amsgrad = hyper[e.group].options.amsgrad == optim::amsgrad::on;
      if (s.has_master) p = c.buffers[next++];
      m = c.buffers[next++];
      v = c.buffers[next++];
      if (amsgrad) vmax = c.buffers[next++];
      // Fresh buffers (never written): the state torch starts a parameter with.
      if (s.has_master && state_->chunk_fresh(s.tensor, master, c.chunk))
        optim::widen_gradient(ex, element(e.param, first), e.param.type, p.data(), n);
      for (auto [k, span] : {std::pair{exp_avg, m}, std::pair{exp_avg_sq, v}, std::pair{max_exp_avg_sq, vmax}}) {
        if (!span.empty() && state_->chunk_fresh(s.tensor, k, c.chunk)) std::fill(span.begin(), span.end(), 0.0f);
      }
      optim::adam_sub_group g;
      g.param = s.has_master ? p : std::span<float>(static_cast<float*>(e.param.data) + first, n);
      g.grad = {element(e.grad, first), n, e.grad.type};
      g.exp_avg = optim::fp32_ref(m);
      g.exp_avg_sq = optim::fp32_ref(v);
      if (amsgrad) g.max_exp_avg_sq = optim::fp32_ref(vmax);
      if (s.has_master) g.param_copy = {element(e.param, first), n, e.param.type};
      kernels[e.group].step(ex, g, {.step = e.step, .objective = hyper[e.group].objective});
    });
    return skipped;
  }

  // Copies `key` of `slot` into `out` (fp32, its element count); chunks never
  // written read as the state a first step starts from: zeros, or for the
  // master `param` widened (required then).
  void read(std::size_t slot, const std::string& key_name, buffer out, std::optional<const_buffer> param) {
    const std::size_t k = key_of(key_name);
    const optim::tensor_ref to = view_of(out, "out");
    const optim::const_tensor_ref from = param ? view_of(*param, "param") : optim::const_tensor_ref{};
    nb::gil_scoped_release unlocked;
    std::lock_guard lock(mutex_);
    require_open();
    const slot_record s = slot_at(slot);
    check_size(to, s.tensor, "out", dtype::fp32);
    if (!state_->has_key(s.tensor, k)) throw user_error("slot " + std::to_string(slot) + " has no " + key_name);
    if (k == master && any_fresh(s.tensor, k) && from.empty())
      throw user_error("master_param: not written yet; give the parameter it starts from");
    if (!from.empty()) check_size(from, s.tensor, "param", std::nullopt);
    optim::executor one(1);
    const streamed_state::pass_item item{s.tensor, {{k, access::read}}};
    state_->stream({&item, 1}, [&](const streamed_chunk& c) {
      float* dst = static_cast<float*>(to.data) + c.first;
      if (!state_->chunk_fresh(s.tensor, k, c.chunk)) {
        std::memcpy(dst, c.buffers[0].data(), c.elements * sizeof(float));
      } else if (k == master) {
        optim::widen_gradient(one, element(from, c.first), from.type, dst, c.elements);
      } else {
        std::fill(dst, dst + c.elements, 0.0f);
      }
    });
  }

  // Writes `in` (fp32, the element count of `slot`) as its `key`, giving the
  // parameter that key's buffer if it had none.
  void write(std::size_t slot, const std::string& key_name, const_buffer in) {
    const std::size_t k = key_of(key_name);
    const optim::const_tensor_ref from = view_of(in, "in");
    nb::gil_scoped_release unlocked;
    std::lock_guard lock(mutex_);
    require_open();
    const slot_record s = slot_at(slot);
    check_size(from, s.tensor, "in", dtype::fp32);
    if (k == master && !s.has_master) throw user_error("master_param: a float32 parameter keeps no master");
    state_->add_key(s.tensor, k);
    const streamed_state::pass_item item{s.tensor, {{k, access::overwrite}}};
    state_->stream({&item, 1}, [&](const streamed_chunk& c) {
      std::memcpy(c.buffers[0].data(), static_cast<const float*>(from.data) + c.first, c.elements * sizeof(float));
    });
  }

  // Makes `key` of `slot` fresh: the next step starts it as torch would.
  void forget(std::size_t slot, const std::string& key_name) {
    forget_key(slot, key_of(key_name));
  }

  // Whether `key` of `slot` has state (some chunk was written).
  bool has(std::size_t slot, const std::string& key_name) {
    return key_written(slot, key_of(key_name));
  }

  // Reads and writes back every written buffer with no update: the I/O of a
  // step alone. Returns its seconds.
  double stream_without_update() {
    nb::gil_scoped_release unlocked;
    std::lock_guard lock(mutex_);
    require_open();
    std::vector<streamed_state::pass_item> items;
    for (std::size_t slot = 0; slot < slots(); ++slot) {
      const slot_record s = slot_at(slot);
      streamed_state::pass_item item{s.tensor, {}};
      for (std::size_t k = 0; k < key_count; ++k) {
        if (state_->has_key(s.tensor, k) && state_->any_written(s.tensor, k) && !any_fresh(s.tensor, k))
          item.keys.emplace_back(k, access::write);
      }
      if (!item.keys.empty()) items.push_back(std::move(item));
    }
    const auto stats = state_->stream(items, [](const streamed_chunk&) {});
    return std::chrono::duration<double>(stats.total).count();
  }

  // Per slot: (elements, has a master, the keys it has).
  std::vector<std::tuple<std::uint64_t, bool, std::vector<std::string>>> layout() {
    std::lock_guard lock(mutex_);
    require_open();
    std::vector<std::tuple<std::uint64_t, bool, std::vector<std::string>>> out;
    for (std::size_t slot = 0; slot < slots(); ++slot) {
      const slot_record s = slot_at(slot);
      std::vector<std::string> keys;
      for (std::size_t k = 0; k < key_count; ++k) {
        if (state_->has_key(s.tensor, k)) keys.push_back(key_names[k]);
      }
      out.emplace_back(state_->elements(s.tensor), s.has_master, std::move(keys));
    }
    return out;
  }

  std::vector<bool> fresh_chunks(std::size_t slot, const std::string& key_name) {
    return fresh_chunks_of(slot, key_of(key_name));
  }

  void set_fresh_chunks(std::size_t slot, const std::string& key_name, std::vector<bool> fresh) {
    set_fresh_chunks_of(slot, key_of(key_name), std::move(fresh));
  }

 private:
  struct slot_record {
    std::size_t tensor = 0;
    bool has_master = false;
  };

  static const void* element(const optim::const_tensor_ref& t, std::size_t first) {
    return static_cast<const std::byte*>(t.data) + first * size_of(t.type);
  }
  static void* element(const optim::tensor_ref& t, std::size_t first) {
    return static_cast<std::byte*>(t.data) + first * size_of(t.type);
  }

  hyper_parameters parse_group(nb::handle g) const {
    const auto t = nb::cast<nb::tuple>(g);
    if (t.size() != 8)
      throw user_error("groups: (lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize) tuples expected");
    hyper_parameters h;
    h.options = {.lr = nb::cast<double>(t[0]), .beta1 = nb::cast<double>(t[1]), .beta2 = nb::cast<double>(t[2]),
                 .eps = nb::cast<double>(t[3]), .weight_decay = nb::cast<double>(t[4]),
                 .decay = nb::cast<bool>(t[5]) ? optim::weight_decay_mode::decoupled : optim::weight_decay_mode::l2,
                 .amsgrad = nb::cast<bool>(t[6]) ? optim::amsgrad::on : optim::amsgrad::off};
    h.objective = nb::cast<bool>(t[7]) ? optim::objective::maximize : optim::objective::minimize;
    return h;
  }

  void check_entry(const step_entry& e, std::size_t groups) {
    std::lock_guard lock(mutex_);
    require_open();
    const slot_record& s = slot_at(e.slot);
    const std::string what = "slot " + std::to_string(e.slot);
    if (s.has_master == (e.param.type == dtype::fp32))
      throw user_error(what + ": param is " + std::string(name(e.param.type)) + ", registered as " +
                       (s.has_master ? "bf16/fp16 (with an fp32 master)" : "fp32"));
    check_size(e.param, s.tensor, what + " param", std::nullopt);
    check_size(e.grad, s.tensor, what + " grad", std::nullopt);
    if (e.step < 1) throw user_error(what + ": step must be >= 1, got " + std::to_string(e.step));
    if (e.group >= groups) throw user_error(what + ": no group " + std::to_string(e.group));
  }

  void check_size(const optim::const_tensor_ref& t, std::size_t tensor, const std::string& what,
                  std::optional<dtype> type) const {
    if (type && t.type != *type) throw user_error(what + ": float32 expected, got " + std::string(name(t.type)));
    if (t.size != state_->elements(tensor))
      throw user_error(what + ": " + std::to_string(t.size) + " elements, the parameter has " +
                       std::to_string(state_->elements(tensor)));
    if (t.size != 0 && reinterpret_cast<std::uintptr_t>(t.data) % size_of(t.type) != 0)
      throw user_error(what + ": misaligned for its dtype");
  }

  slot_record slot_at(std::size_t slot) const { return {tensor_at(slot), has_master_[slot]}; }

  std::vector<bool> has_master_;  // per slot: it is bf16/fp16 and keeps an fp32 master
};

}  // namespace

void bind_offloaded_adam(nb::module_& m) {
  nb::class_<offloaded_adam> c(m, "OffloadedAdam",
      "Adam/AdamW state (fp32 master, exp_avg, exp_avg_sq, max_exp_avg_sq) in files of the\n"
      "directory `nvme_dir` (made 0700 when missing; its parent must exist), streamed through\n"
      "a pinned host budget of `host_memory` bytes (rounded down to 4 KiB, at least 64 KiB) in\n"
      "sub-groups of a quarter of it; files are preallocated `file_size` bytes at a time and\n"
      "removed by close() or when the object is freed. `aio` sets the files' I/O engine (a dict\n"
      "of block_size, queue_depth, threads and submit_batch, as Store's). Raises TierflowError\n"
      "(an OSError with errno and filename) when the directory cannot be made or written, or\n"
      "the disk is full; ValueError for a bad aio value, naming aio.<key>.");
  c.def(nb::init<const std::string&, const std::variant<std::uint64_t, std::string>&, std::uint64_t,
                 const std::optional<nb::dict>&>(),
           "nvme_dir"_a, "host_memory"_a,
           "file_size"_a = 256ull << 20, "aio"_a = nb::none())
      .def("add_param", &offloaded_adam::add_param, "elements"_a, "master"_a, "amsgrad"_a,
           "Registers a parameter of `elements` (master: it is bf16/fp16 and keeps an fp32\n"
           "master) and preallocates its state's blocks; returns its slot. ENOSPC raises\n"
           "TierflowError and registers nothing.")
      .def("step", &offloaded_adam::step, "executor"_a, "entries"_a, "groups"_a, nb::kw_only(),
           "skip_nonfinite"_a = false,
           "One Adam/AdamW step over `entries`, (slot, param, grad, step, group) tuples, with\n"
           "`groups[group]` = (lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize):\n"
           "every chunk of every parameter's state read from NVMe, updated by the fused kernel\n"
           "with the parameter and gradient read and written where they are (C-contiguous CPU\n"
           "buffers, never copied; a bf16/fp16 param is written from its master), and written\n"
           "back, pipelined. A state buffer never written starts as torch's (zeros; the master\n"
           "from the parameter). Everything is checked before anything is written (ValueError);\n"
           "an I/O error mid-step leaves the chunks before it stepped. With skip_nonfinite a\n"
           "parameter whose gradient holds an inf or a nan is read in full first and left out\n"
           "of the pass (parameter and state untouched). Returns the slots skipped so, in\n"
           "entries' order (empty without skip_nonfinite). Releases the GIL.")
      .def("read", &offloaded_adam::read, "slot"_a, "key"_a, "out"_a.noconvert(),
           "param"_a.noconvert().none() = nb::none(),
           "Copies state `key` of `slot` into `out` (float32, the parameter's element count),\n"
           "through the host budget; never-written chunks read as zeros (the master: `param`).")
      .def("write", &offloaded_adam::write, "slot"_a, "key"_a, "data"_a.noconvert(),
           "Writes `data` (float32, the parameter's element count) as state `key` of `slot`.")
      .def("forget", &offloaded_adam::forget, "slot"_a, "key"_a,
           "Marks state `key` of `slot` never written: the next step starts it as torch would.")
      .def("has", &offloaded_adam::has, "slot"_a, "key"_a, "Whether state `key` of `slot` was written.")
      .def("stream_without_update", &offloaded_adam::stream_without_update,
           "Reads and writes back all the written state with no update (a step's I/O alone);\n"
           "returns the seconds it took.")
      .def("layout", &offloaded_adam::layout, "Per slot: (elements, has a master, its state keys).")
      .def("fresh_chunks", &offloaded_adam::fresh_chunks, "slot"_a, "key"_a,
           "Per chunk of state `key` of `slot`: whether it was never written.")
      .def("set_fresh_chunks", &offloaded_adam::set_fresh_chunks, "slot"_a, "key"_a, "fresh"_a,
           "Declares which chunks of state `key` of `slot` were never written (after load()).")
      .def_prop_ro("sub_group_bytes", &offloaded_adam::sub_group_bytes);
  def_offloaded_state(c);
}

}  // namespace tierflow::python
