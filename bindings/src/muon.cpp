// Muon's step over one matrix handed in as DLPack views (arrays.hpp), and the
// C++ rule for which parameters Muon takes (optim/grouping.hpp), so that the
// Python helper and the C++ engine split a model the same way.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optim/executor.hpp"
#include "tierflow/optim/gradients.hpp"
#include "tierflow/optim/grouping.hpp"
#include "tierflow/optim/muon.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {
namespace {

// The Newton–Schulz buffers and GEMM plans a stream of Muon steps reuses
// (muon_optimizer's workspace, kept between calls), and the fp32 image of a
// bf16 momentum buffer. One step at a time: a second thread stepping with the
// same workspace waits for the first.
struct muon_workspace {
  std::mutex in_use;
  optim::muon_optimizer kernel{optim::muon_options{}};
  std::vector<float> momentum_fp32;
};

// dst[i] = src[i] rounded to the nearest bf16, ties to even, and every nan
// the one quiet nan 0x7FC0: torch's conversion (c10::BFloat16), so that a
// bf16 buffer holds what torch's `.bfloat16()` of the fp32 step would.
void round_to_bf16(optim::executor& ex, const float* src, std::uint16_t* dst, std::size_t n) {
  constexpr std::size_t grain = 1 << 16;  // elements per task: far above a task's cost
  ex.run([&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, grain), [&](const tbb::blocked_range<std::size_t>& r) {
      for (std::size_t i = r.begin(); i != r.end(); ++i) {
        const auto bits = std::bit_cast<std::uint32_t>(src[i]);
        dst[i] = (bits & 0x7FFF'FFFFu) > 0x7F80'0000u
                     ? std::uint16_t{0x7FC0}
                     : static_cast<std::uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
      }
    });
  });
}

optim::lr_adjustment lr_rule(const std::optional<std::string>& adjust_lr_fn) {
  if (!adjust_lr_fn || *adjust_lr_fn == "original") return optim::lr_adjustment::original;
  if (*adjust_lr_fn == "match_rms_adamw") return optim::lr_adjustment::match_rms_adamw;
  if (*adjust_lr_fn == "spectral_unclamped") return optim::lr_adjustment::spectral_unclamped;
  throw user_error("adjust_lr_fn: '" + *adjust_lr_fn +
                   "' is not None, 'original', 'match_rms_adamw' or 'spectral_unclamped'");
}

// One Muon step on one matrix's buffers; see the docstring below.
void muon_step(optim::executor& ex, buffer param, const_buffer grad, buffer momentum_buffer,
               std::optional<buffer> param_copy, std::size_t rows, std::size_t cols, float lr,
               float weight_decay, float momentum, bool nesterov,
               std::tuple<float, float, float> ns_coefficients, float eps, int ns_steps,
               const std::optional<std::string>& adjust_lr_fn, float grad_scale,
               std::string_view ns_dtype, muon_workspace* workspace) {
  if (element_type(param, "param") != dtype::fp32)
    throw user_error("param: the updated parameter (the master copy) must be float32");
  const dtype momentum_type = element_type(momentum_buffer, "momentum_buffer");
  if (momentum_type == dtype::fp16) throw user_error("momentum_buffer: float32 or bfloat16 expected, got float16");
  const auto [a, b, c] = ns_coefficients;
  const optim::muon_options options{
      .lr = lr, .weight_decay = weight_decay, .momentum = momentum,
      .nesterov = nesterov ? optim::nesterov::on : optim::nesterov::off,
      .momentum_form = optim::muon_momentum::ema,  // torch.optim.Muon's buf.lerp_(grad, 1 - momentum)
      .ns_steps = ns_steps, .ns_a = a, .ns_b = b, .ns_c = c, .eps = eps,
      .adjust_lr = lr_rule(adjust_lr_fn),
      .gemm_dtype = parse_dtype(ns_dtype, "ns_dtype")};
  optim::muon_matrix matrix{
      .param = {static_cast<float*>(param.data()), param.size()},
      .grad = view_of(grad, "grad"),
      .momentum_buffer = {static_cast<float*>(momentum_buffer.data()), momentum_buffer.size()},
      .rows = rows,
      .cols = cols,
      .param_copy = param_copy ? view_of(*param_copy, "param_copy") : optim::tensor_ref{}};

  nb::gil_scoped_release unlocked;  // three GEMMs per Newton–Schulz iteration: long for big matrices
  // The kernel keeps its momentum in fp32. A bf16 buffer is widened into an
  // fp32 image (exactly), stepped there, and rounded back once the step
  // returned: the kernel's arithmetic, the buffer stored at half the bytes.
  // The two passes over rows x cols elements are small beside the GEMMs'
  // rows x cols x min(rows, cols) per iteration.
  const auto step = [&](optim::muon_optimizer& kernel, std::vector<float>& image) {
    // A zero-size matrix has nothing to update (and DLPack may give it no address).
    if (param.size() == 0 && rows * cols == 0) return;
    if (momentum_type == dtype::fp32) {
      kernel.step(ex, matrix, grad_scale);
      return;
    }
    const std::size_t n = momentum_buffer.size();
    if (n != rows * cols)  // (the kernel's own check would see the image, not the buffer)
      throw user_error("momentum_buffer: " + std::to_string(n) + " elements for a " + std::to_string(rows) +
                       " x " + std::to_string(cols) + " matrix");
    image.resize(n);
    optim::widen_gradient(ex, momentum_buffer.data(), dtype::bf16, image.data(), n);
    matrix.momentum_buffer = image;
    kernel.step(ex, matrix, grad_scale);
    round_to_bf16(ex, image.data(), static_cast<std::uint16_t*>(momentum_buffer.data()), n);
  };
  if (workspace == nullptr) {
    optim::muon_optimizer kernel(options);  // validates the hyper-parameters
    std::vector<float> image;
    step(kernel, image);
    return;
  }
  // Taken with the GIL released: a thread holding it while it waited here
  // would keep the stepping thread from returning.
  const std::lock_guard<std::mutex> hold(workspace->in_use);
  workspace->kernel.set_options(options);
  step(workspace->kernel, workspace->momentum_fp32);
}

std::pair<std::vector<std::size_t>, std::vector<std::size_t>> group_parameters(
    const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& named_shapes) {
  std::vector<optim::parameter_desc> params;
  params.reserve(named_shapes.size());
  for (const auto& [name, shape] : named_shapes) params.push_back({name, shape});
  optim::parameter_groups groups = optim::group_parameters(params);
  return {std::move(groups.muon), std::move(groups.adamw)};
}

}  // namespace

void bind_muon(nb::module_& m) {
  nb::class_<muon_workspace>(m, "MuonWorkspace",
      "The Newton-Schulz buffers and GEMM plans that muon_step() keeps between calls, and the\n"
      "fp32 image of a bfloat16 momentum buffer (sized by the largest matrix stepped so far,\n"
      "freed with this object). Steps that share one run one at a time.")
      .def(nb::init<>());

  m.def("muon_step", &muon_step, "executor"_a, "param"_a.noconvert(), "grad"_a.noconvert(),
        "momentum_buffer"_a.noconvert(), "param_copy"_a.noconvert().none() = nb::none(),
        nb::kw_only(), "rows"_a, "cols"_a, "lr"_a, "weight_decay"_a, "momentum"_a, "nesterov"_a,
        "ns_coefficients"_a, "eps"_a, "ns_steps"_a, "adjust_lr_fn"_a.none(), "grad_scale"_a = 1.0f,
        "ns_dtype"_a = "bfloat16", "workspace"_a.none() = nb::none(),
        "One torch.optim.Muon step over one rows x cols (row-major) matrix, in place:\n"
        "  g = grad * grad_scale;  buf = buf.lerp(g, 1 - momentum)\n"
        "  u = g.lerp(buf, momentum) if nesterov else buf\n"
        "  u = Newton-Schulz(u; ns_coefficients, ns_steps, eps), GEMMs in ns_dtype\n"
        "  param *= 1 - lr * weight_decay;  param -= adjusted_lr * u\n"
        "adjust_lr_fn (None or 'original': lr * sqrt(max(1, rows/cols)); 'match_rms_adamw':\n"
        "lr * 0.2 * sqrt(max(rows, cols)); 'spectral_unclamped': lr * sqrt(rows/cols)) gives\n"
        "adjusted_lr. ns_dtype 'bfloat16' rounds the GEMMs' operands as torch does; 'float32'\n"
        "keeps them in fp32. `param` is float32 (the master copy); `momentum_buffer` float32,\n"
        "or bfloat16 (widened for the step, which computes in fp32, and rounded back to\n"
        "nearest-even); `grad` float32, bfloat16 or float16; `param_copy` (bfloat16 or float16)\n"
        "receives the updated parameter in the same pass. Every buffer: C-contiguous, on the\n"
        "CPU, of rows * cols elements. `workspace` (a MuonWorkspace) keeps the buffers for the\n"
        "next call; None makes them for this call only. Releases the GIL while the step runs.\n"
        "Raises ValueError naming a bad argument (nothing written).");

  m.def("group_parameters", &group_parameters, "named_shapes"_a,
        "Which optimizer each parameter gets when a model trains with Muon, from its name and\n"
        "shape: a list of (name, shape) in, (muon, adamw) lists of their indices out. Muon\n"
        "takes a shape of two dimensions, both > 1, whose dotted name has no part marking an\n"
        "embedding or an output head (embed, embeddings, embed_tokens, tok_embeddings, wte,\n"
        "wpe, lm_head, head, output, classifier; any case); AdamW takes the rest.");
}

}  // namespace tierflow::python
