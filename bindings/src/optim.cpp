// The executor the CPU optimizers run on and Adam/AdamW's step over tensors
// handed in as DLPack views (arrays.hpp): read and written where they are,
// never copied.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

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

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {
namespace {

// One Adam/AdamW step on one parameter's buffers; see the docstring below.
bool adam_step(optim::executor& ex, buffer param, const_buffer grad, buffer exp_avg,
               buffer exp_avg_sq, std::optional<buffer> max_exp_avg_sq,
               std::optional<buffer> param_copy, std::int64_t step, float lr, float beta1,
               float beta2, float eps, float weight_decay, bool decoupled, float grad_scale,
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

  m.def("address_of", [](const_buffer a) { return reinterpret_cast<std::uintptr_t>(a.data()); },
        "array"_a.noconvert(),
        "The address of `array`'s first element as this extension sees it: equal to\n"
        "tensor.data_ptr() when a tensor crosses without a copy.");
}

}  // namespace tierflow::python
