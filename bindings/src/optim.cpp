// The executor the CPU optimizers run on and Adam/AdamW's step over tensors
// handed in as DLPack views (arrays.hpp): read and written where they are,
// never copied; per parameter (adam_step) or per param group over slots that
// hold the buffers fixed between steps (adam_step_group).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optim/adam.hpp"
#include "tierflow/optim/executor.hpp"
#include "tierflow/optim/gradients.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {
namespace {

// One Adam/AdamW step on one parameter's buffers; see the docstring below.
bool adam_step(optim::executor& ex, buffer param, const_buffer grad, buffer exp_avg,
               buffer exp_avg_sq, std::optional<buffer> max_exp_avg_sq,
               std::optional<buffer> param_copy, std::int64_t step, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool decoupled, float grad_scale,
               bool skip_nonfinite, bool maximize) {
  if (element_type(param, "param") != dtype::fp32)
    throw user_error("param: the updated parameter (the master copy) must be float32");
  optim::adam_options options{.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps,
                              .weight_decay = weight_decay,
                              .decay = decoupled ? optim::weight_decay_mode::decoupled
                                                 : optim::weight_decay_mode::l2,
                              .amsgrad = max_exp_avg_sq ? optim::amsgrad::on : optim::amsgrad::off};
  const optim::adam_optimizer adam(options);  // validates the hyper-parameters

  optim::adam_sub_group group{
      .param = {static_cast<float*>(param.data()), param.size()},
      .grad = view_of(grad, "grad"),
      .exp_avg = view_of(exp_avg, "exp_avg"),
      .exp_avg_sq = view_of(exp_avg_sq, "exp_avg_sq"),
      .max_exp_avg_sq = max_exp_avg_sq ? view_of(*max_exp_avg_sq, "max_exp_avg_sq") : optim::tensor_ref{},
      .param_copy = param_copy ? view_of(*param_copy, "param_copy") : optim::tensor_ref{}};
  const optim::adam_step_args args{
      .step = step, .grad_scale = grad_scale,
      .check = skip_nonfinite ? optim::finite_check::skip_step : optim::finite_check::off,
      .objective = maximize ? optim::objective::maximize : optim::objective::minimize};
  // A zero-size parameter has nothing to update (and DLPack may give it no address).
  if (group.param.empty()) return true;

  optim::step_outcome outcome;
  {
    nb::gil_scoped_release unlocked;  // the step streams every buffer once: long for big tensors
    outcome = adam.step(ex, group, args);
  }
  return outcome == optim::step_outcome::applied;
}

std::string element_count(std::size_t n) { return std::to_string(n) + " elements"; }

// One parameter's buffers that stay put between steps, validated once and
// held as DLPack views (which keep their tensors alive): the fp32 (master)
// parameter, the moments, the amsgrad maximum, the bf16/fp16 copy and the step
// count, a one-element float32 or float64 tensor (torch's state["step"]) that
// adam_step_group increments in place. Only the gradient crosses per step.
class adam_slot {
 public:
  adam_slot(buffer param, buffer exp_avg, buffer exp_avg_sq, std::optional<buffer> max_exp_avg_sq,
            std::optional<buffer> param_copy, buffer step)
      : param_(std::move(param)), exp_avg_(std::move(exp_avg)), exp_avg_sq_(std::move(exp_avg_sq)),
        max_exp_avg_sq_(std::move(max_exp_avg_sq)), param_copy_(std::move(param_copy)),
        step_(std::move(step)) {
    if (element_type(param_, "param") != dtype::fp32)
      throw user_error("param: the updated parameter (the master copy) must be float32");
    const std::size_t n = param_.size();
    const auto check_size = [n](const buffer& b, std::string_view what) {
      if (b.size() != n)
        throw user_error(std::string(what) + ": " + element_count(b.size()) + " for a param of " +
                         element_count(n));
    };
    group_.param = {static_cast<float*>(param_.data()), n};
    group_.exp_avg = view_of(exp_avg_, "exp_avg");
    check_size(exp_avg_, "exp_avg");
    group_.exp_avg_sq = view_of(exp_avg_sq_, "exp_avg_sq");
    check_size(exp_avg_sq_, "exp_avg_sq");
    if (max_exp_avg_sq_) {
      group_.max_exp_avg_sq = view_of(*max_exp_avg_sq_, "max_exp_avg_sq");
      check_size(*max_exp_avg_sq_, "max_exp_avg_sq");
    }
    if (param_copy_) {
      group_.param_copy = view_of(*param_copy_, "param_copy");
      check_size(*param_copy_, "param_copy");
    }
    if (step_.size() != 1)
      throw user_error("step: one element expected, got " + element_count(step_.size()));
    if (step_.dtype() == nb::dtype<float>()) {
      step_f32_ = static_cast<float*>(step_.data());
    } else if (step_.dtype() == nb::dtype<double>()) {
      step_f64_ = static_cast<double*>(step_.data());
    } else {
      throw user_error("step: a float32 or float64 tensor expected");
    }
  }

  std::size_t size() const noexcept { return group_.param.size(); }
  bool amsgrad() const noexcept { return max_exp_avg_sq_.has_value(); }

  // The count the next step runs with: one more, added as torch's
  // `state["step"] += 1` adds it, in the count's own dtype.
  std::int64_t next_step() const noexcept {
    if (step_f32_ != nullptr) return static_cast<std::int64_t>(*step_f32_ + 1.0f);
    return static_cast<std::int64_t>(*step_f64_ + 1.0);
  }
  // Stores that count: the step it ran with was applied.
  void advance() noexcept {
    if (step_f32_ != nullptr) {
      *step_f32_ += 1.0f;
    } else {
      *step_f64_ += 1.0;
    }
  }

  // The buffers with `grad` for one step.
  optim::adam_sub_group with(optim::const_tensor_ref grad) const noexcept {
    optim::adam_sub_group g = group_;
    g.grad = grad;
    return g;
  }

 private:
  buffer param_, exp_avg_, exp_avg_sq_;
  std::optional<buffer> max_exp_avg_sq_, param_copy_;
  buffer step_;
  optim::adam_sub_group group_;
  float* step_f32_ = nullptr;
  double* step_f64_ = nullptr;
};

// One step over a param group: slots[i] with grads[i]. Every gradient is
// checked before anything is written; then, with the GIL released once, the
// kernel runs on each slot in order with its count plus one, and the count is
// stored once the step applied: the calls adam_step would make, one per
// parameter. With skip_nonfinite a slot whose gradient holds an inf or a nan
// is left as it was (buffers and count) and its index returned, in order.
std::vector<std::size_t> adam_step_group(optim::executor& ex, const std::vector<adam_slot*>& slots,
                                         const std::vector<const_buffer>& grads, double lr, double beta1,
                                         double beta2, double eps, double weight_decay, bool decoupled,
                                         bool maximize, bool skip_nonfinite) {
  if (slots.size() != grads.size())
    throw user_error("grads: " + std::to_string(grads.size()) + " gradients for " +
                     std::to_string(slots.size()) + " slots");
  optim::adam_options options{.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps,
                              .weight_decay = weight_decay,
                              .decay = decoupled ? optim::weight_decay_mode::decoupled
                                                 : optim::weight_decay_mode::l2};
  const optim::adam_optimizer plain(options);  // validates the hyper-parameters
  options.amsgrad = optim::amsgrad::on;
  const optim::adam_optimizer amsgrad(options);
  std::vector<optim::const_tensor_ref> views;
  views.reserve(grads.size());
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (slots[i] == nullptr) throw user_error("slots[" + std::to_string(i) + "]: None");
    const std::string what = "grads[" + std::to_string(i) + "]";
    views.push_back(view_of(grads[i], what));
    if (grads[i].size() != slots[i]->size())
      throw user_error(what + ": " + element_count(grads[i].size()) + " for a param of " +
                       element_count(slots[i]->size()));
  }
  const optim::adam_step_args args{
      .step = 1, .grad_scale = 1.0f,
      .check = skip_nonfinite ? optim::finite_check::skip_step : optim::finite_check::off,
      .objective = maximize ? optim::objective::maximize : optim::objective::minimize};
  std::vector<std::size_t> skipped;
  nb::gil_scoped_release unlocked;  // the steps stream every buffer once: long for big groups
  for (std::size_t i = 0; i < slots.size(); ++i) {
    adam_slot& slot = *slots[i];
    optim::adam_step_args step_args = args;
    step_args.step = slot.next_step();
    // A zero-size parameter has nothing to update (and DLPack may give it no
    // address); its count moves, as torch's does.
    if (slot.size() != 0 &&
        (slot.amsgrad() ? amsgrad : plain).step(ex, slot.with(views[i]), step_args) ==
            optim::step_outcome::skipped_nonfinite) {
      skipped.push_back(i);
      continue;
    }
    slot.advance();
  }
  return skipped;
}

// dst ← src × scale, converted to dst's dtype; see the docstring below.
std::optional<double> convert(optim::executor& ex, const_buffer src, buffer dst, float scale, bool sum_squares) {
  const dtype from = element_type(src, "src"), to = element_type(dst, "dst");
  if (src.size() != dst.size())
    throw user_error("dst: " + std::to_string(dst.size()) + " elements where src has " + std::to_string(src.size()));
  const auto* s = static_cast<const std::byte*>(src.data());
  auto* d = static_cast<std::byte*>(dst.data());
  const bool overlap = src.size() > 0 && s < d + dst.size() * size_of(to) && d < s + src.size() * size_of(from);
  if (overlap && !(s == d && from == to))
    throw user_error("dst: overlaps src (only a buffer converted onto itself, of one dtype, may)");
  double sum = 0;
  if (src.size() > 0) {
    nb::gil_scoped_release release;
    optim::convert(ex, s, from, d, to, scale, src.size(), sum_squares ? &sum : nullptr);
  }
  return sum_squares ? std::optional<double>(sum) : std::nullopt;
}

double sum_of_squares(optim::executor& ex, const_buffer data) {
  const dtype type = element_type(data, "data");
  if (data.size() == 0) return 0.0;
  nb::gil_scoped_release release;
  return optim::sum_of_squares(ex, data.data(), type, data.size());
}

}  // namespace

void bind_optim(nb::module_& m) {
  nb::class_<optim::executor>(m, "Executor",
      "Where optimizer steps run: a pool of `threads` CPU threads (the calling thread is one\n"
      "of them) and a SIMD target ('auto' picks the best of simd_targets()).")
      .def(nb::init<int, std::string_view>(), "threads"_a = 1, "simd"_a = "auto")
      .def_prop_ro("threads", &optim::executor::threads)
      .def_prop_ro("simd", &optim::executor::simd);

  m.def("simd_targets", &optim::simd_targets,
        "The SIMD targets this build has and this CPU runs, best first ('scalar' always).");

  m.def("adam_step", &adam_step, "executor"_a, "param"_a.noconvert(), "grad"_a.noconvert(),
        "exp_avg"_a.noconvert(), "exp_avg_sq"_a.noconvert(),
        "max_exp_avg_sq"_a.noconvert().none() = nb::none(),
        "param_copy"_a.noconvert().none() = nb::none(), nb::kw_only(), "step"_a, "lr"_a,
        "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "decoupled"_a, "grad_scale"_a = 1.0f,
        "skip_nonfinite"_a = false, "maximize"_a = false,
        "One Adam (decoupled=False: L2 decay) or AdamW (decoupled=True) step over one\n"
        "parameter's buffers, in place and in one pass, with torch.optim's fused numerics.\n"
        "`param` is the float32 (master) parameter; `grad` float32, bfloat16 or float16;\n"
        "the moments float32 or bfloat16, all of one dtype; `max_exp_avg_sq` turns amsgrad on;\n"
        "`param_copy` (bfloat16 or float16) receives the updated parameter in the same pass.\n"
        "`step` is the 1-based step count. Every buffer: C-contiguous, on the CPU, of param's\n"
        "size. With skip_nonfinite an inf/nan gradient writes nothing and returns False;\n"
        "with maximize the step ascends the gradient (torch's maximize, with no temporary).\n"
        "Releases the GIL while the step runs. Raises ValueError naming a bad argument.");

  nb::class_<adam_slot>(m, "AdamSlot",
      "One parameter's Adam/AdamW buffers that stay put between steps, for adam_step_group():\n"
      "`param` the float32 (master) parameter, the moments (float32 or bfloat16, of one dtype),\n"
      "`max_exp_avg_sq` (amsgrad on) and `param_copy` (bfloat16 or float16, written from the\n"
      "updated parameter in the same pass) as adam_step() takes them, and `step`, the count: a\n"
      "one-element float32 or float64 tensor, advanced in place by each step. Each is held as\n"
      "a view of its tensor (no copy; the slot keeps it alive) and checked here: C-contiguous,\n"
      "on the CPU, of param's size. Make a new slot when a tensor is replaced or reallocated.\n"
      "Raises ValueError naming a bad buffer.")
      .def(nb::init<buffer, buffer, buffer, std::optional<buffer>, std::optional<buffer>, buffer>(),
           "param"_a.noconvert(), "exp_avg"_a.noconvert(), "exp_avg_sq"_a.noconvert(),
           "max_exp_avg_sq"_a.noconvert().none(), "param_copy"_a.noconvert().none(),
           "step"_a.noconvert())
      .def_prop_ro("size", &adam_slot::size)
      .def_prop_ro("amsgrad", &adam_slot::amsgrad);

  m.def("adam_step_group", &adam_step_group, "executor"_a, "slots"_a, "grads"_a.noconvert(),
        nb::kw_only(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "decoupled"_a,
        "maximize"_a = false, "skip_nonfinite"_a = false,
        "One Adam (decoupled=False) or AdamW (decoupled=True) step over a param group:\n"
        "slots[i] (AdamSlot) with grads[i] (float32, bfloat16 or float16, C-contiguous, on the\n"
        "CPU, of the slot's size; crossing without a copy). Every gradient is checked before\n"
        "anything is written; then, with the GIL released once, the fused kernel runs on each\n"
        "slot's buffers in order with its step count plus one, and the count is advanced by\n"
        "one: the results of adam_step() called on each in turn with the advanced count.\n"
        "With skip_nonfinite a slot whose gradient holds an inf or a nan is not touched (its\n"
        "buffers and its count stay as they were). Returns the indices of the slots skipped so,\n"
        "ascending (empty without skip_nonfinite). Raises ValueError naming a bad argument.");

  m.def("convert", &convert, "executor"_a, "src"_a.noconvert(), "dst"_a.noconvert(), "scale"_a = 1.0f,
        nb::kw_only(), "sum_squares"_a = false,
        "dst[i] = src[i] * scale for every element, converted to dst's dtype (float32, bfloat16\n"
        "or float16 on either side; rounded to nearest even when narrowing, as torch rounds),\n"
        "spread over the executor's threads with the GIL released. Both C-contiguous on the CPU\n"
        "and of one size; dst may be src itself (one dtype), else must not overlap it. With\n"
        "sum_squares, returns sum_of_squares() of what was written, made in the same pass;\n"
        "else None. Raises ValueError naming a bad argument.");

  m.def("sum_of_squares", &sum_of_squares, "executor"_a, "data"_a.noconvert(),
        "The sum of the squares of `data`'s elements (float32, bfloat16 or float16, C-contiguous,\n"
        "on the CPU), each squared and summed in float64 in one fixed order: the same bits\n"
        "whatever the executor's threads or SIMD target. An inf or nan element makes it inf or\n"
        "nan. A gradient's squared L2 norm, for clipping. Raises ValueError for another dtype.");

  m.def("address_of", [](const_buffer a) { return reinterpret_cast<std::uintptr_t>(a.data()); },
        "array"_a.noconvert(),
        "The address of `array`'s first element as this extension sees it: equal to\n"
        "tensor.data_ptr() when a tensor crosses without a copy.");
}

}  // namespace tierflow::python
