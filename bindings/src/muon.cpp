// Muon's step over one matrix handed in as DLPack views (arrays.hpp), the same
// step with the momentum buffers on NVMe (OffloadedMuon), and the C++ rule for
// which parameters Muon takes (optim/grouping.hpp), so that the Python helper
// and the C++ engine split a model the same way.
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
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
#include "tierflow/core/units.hpp"
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

// torch.optim.Muon's hyper-parameters as the kernel's options (checked by
// the kernel when it is given them).
optim::muon_options options_of(float lr, float weight_decay, float momentum, bool nesterov,
                               std::tuple<float, float, float> ns_coefficients, float eps, int ns_steps,
                               const std::optional<std::string>& adjust_lr_fn, std::string_view ns_dtype) {
  const auto [a, b, c] = ns_coefficients;
  return {.lr = lr, .weight_decay = weight_decay, .momentum = momentum,
          .nesterov = nesterov ? optim::nesterov::on : optim::nesterov::off,
          .momentum_form = optim::muon_momentum::ema,  // torch.optim.Muon's buf.lerp_(grad, 1 - momentum)
          .ns_steps = ns_steps, .ns_a = a, .ns_b = b, .ns_c = c, .eps = eps,
          .adjust_lr = lr_rule(adjust_lr_fn),
          .gemm_dtype = parse_dtype(ns_dtype, "ns_dtype")};
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
  const optim::muon_options options =
      options_of(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, ns_dtype);
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

// Muon whose momentum buffers live on NVMe (tierflow._core.OffloadedMuon):
// the store of offloaded_state.hpp (as OffloadedAdam's), one fp32 key per
// parameter streamed chunk by chunk (core/streamed_state.hpp). The momentum
// rule is elementwise, so each chunk of the buffer is read, updated and
// written back while the next streams in, and the Nesterov update of its
// elements lands in an fp32 matrix in RAM; Newton–Schulz needs that whole
// matrix, so it runs once the pass is done, then the parameter's update.
// The arithmetic is the kernel's (optim/muon.cpp), expression for
// expression, so both give the same bits.
const std::vector<std::string> muon_key_names = {"momentum_buffer"};
constexpr std::size_t momentum_key = 0;
constexpr std::size_t elementwise_grain = 1 << 16;  // elements per task: far above a task's cost

class offloaded_muon : public offloaded_state {
 public:
  offloaded_muon(const std::string& nvme_dir, const std::variant<std::uint64_t, std::string>& host_memory_given,
                 std::uint64_t file_size)
      : offloaded_state(nvme_dir, host_memory_given, file_size, muon_key_names, "") {}

  // Registers a parameter of `elements` and makes its buffer's blocks on NVMe.
  std::size_t add_param(std::uint64_t elements) {
    std::lock_guard lock(mutex_);
    const std::size_t keys[] = {momentum_key};
    return add_slot(elements, keys);
  }

  // One step of one matrix; see the docstring in bind_muon.
  void step(optim::executor& ex, std::size_t slot, buffer param, const_buffer grad, std::size_t rows,
            std::size_t cols, float lr, float weight_decay, float momentum, bool nesterov,
            std::tuple<float, float, float> ns_coefficients, float eps, int ns_steps,
            const std::optional<std::string>& adjust_lr_fn, std::string_view ns_dtype) {
    const optim::muon_options options =
        options_of(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, ns_dtype);
    const optim::tensor_ref p = view_of(param, "param");
    const optim::const_tensor_ref g = view_of(grad, "grad");
    if (p.type != dtype::fp32) throw user_error("param: the updated parameter (the master copy) must be float32");
    const std::size_t n = rows * cols;

    nb::gil_scoped_release unlocked;  // the pass and the GEMMs
    std::lock_guard lock(mutex_);
    require_open();
    const std::size_t tensor = tensor_at(slot);
    const std::string what = "slot " + std::to_string(slot);
    if (state_->elements(tensor) != n)
      throw user_error(what + ": a " + std::to_string(rows) + " x " + std::to_string(cols) + " matrix, registered with " +
                       std::to_string(state_->elements(tensor)) + " elements");
    check_size(p, n, what + " param");
    check_size(g, n, what + " grad");
    if (n == 0) return;  // nothing to update (and DLPack may give it no address)
    kernel_.set_options(options);  // validates them: nothing is written before
    if (update_.size() < n) update_.resize(n);
    float* u = update_.data();
    const float mu = options.momentum;
    const bool nest = options.nesterov == optim::nesterov::on;

    const streamed_state::pass_item item{tensor, {{momentum_key, all_fresh(tensor, momentum_key) ? access::overwrite : access::write}}};
    state_->stream({&item, 1}, [&](const streamed_chunk& c) {
      float* buf = c.buffers[0].data();
      float* uc = u + c.first;
      // A chunk never written holds torch's first buffer: zeros.
      if (state_->chunk_fresh(tensor, momentum_key, c.chunk)) std::fill(buf, buf + c.elements, 0.0f);
      optim::widen_gradient(ex, static_cast<const std::byte*>(g.data) + c.first * size_of(g.type), g.type, uc,
                            c.elements);
      for_each_range(ex, c.elements, [&](std::size_t b, std::size_t e) {
        for (std::size_t i = b; i < e; ++i) {
          const float gi = uc[i];
          buf[i] = buf[i] + (1.0f - mu) * (gi - buf[i]);  // buf.lerp_(g, 1 - mu)
          uc[i] = nest ? gi + mu * (buf[i] - gi) : buf[i];  // g.lerp(buf, mu)
        }
      });
    });

    kernel_.orthogonalize(ex, {u, n}, rows, cols, {u, n});
    const float decay = 1.0f - options.lr * options.weight_decay;
    const float adjusted = optim::muon_optimizer::adjusted_lr(options, rows, cols);
    float* target = static_cast<float*>(p.data);
    for_each_range(ex, n, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) target[i] = target[i] * decay - adjusted * u[i];
    });
  }

  // Copies the buffer of `slot` into `out` (fp32, its element count); chunks
  // never written read as zeros.
  void read(std::size_t slot, buffer out) {
    const optim::tensor_ref to = view_of(out, "out");
    nb::gil_scoped_release unlocked;
    std::lock_guard lock(mutex_);
    require_open();
    const std::size_t tensor = tensor_at(slot);
    check_fp32(to, tensor, "out");
    const streamed_state::pass_item item{tensor, {{momentum_key, access::read}}};
    state_->stream({&item, 1}, [&](const streamed_chunk& c) {
      float* dst = static_cast<float*>(to.data) + c.first;
      if (state_->chunk_fresh(tensor, momentum_key, c.chunk)) {
        std::fill(dst, dst + c.elements, 0.0f);
      } else {
        std::memcpy(dst, c.buffers[0].data(), c.elements * sizeof(float));
      }
    });
  }

  // Writes `in` (fp32, the element count of `slot`) as its buffer.
  void write(std::size_t slot, const_buffer in) {
    const optim::const_tensor_ref from = view_of(in, "in");
    nb::gil_scoped_release unlocked;
    std::lock_guard lock(mutex_);
    require_open();
    const std::size_t tensor = tensor_at(slot);
    check_fp32(from, tensor, "in");
    const streamed_state::pass_item item{tensor, {{momentum_key, access::overwrite}}};
    state_->stream({&item, 1}, [&](const streamed_chunk& c) {
      std::memcpy(c.buffers[0].data(), static_cast<const float*>(from.data) + c.first, c.elements * sizeof(float));
    });
  }

  void forget(std::size_t slot) { forget_key(slot, momentum_key); }

  bool has(std::size_t slot) { return key_written(slot, momentum_key); }

  // Per slot, its element count.
  std::vector<std::uint64_t> layout() {
    std::lock_guard lock(mutex_);
    require_open();
    std::vector<std::uint64_t> out;
    for (std::size_t slot = 0; slot < slots(); ++slot) out.push_back(state_->elements(tensor_at(slot)));
    return out;
  }

  std::vector<bool> fresh_chunks(std::size_t slot) { return fresh_chunks_of(slot, momentum_key); }

  void set_fresh_chunks(std::size_t slot, std::vector<bool> fresh) {
    set_fresh_chunks_of(slot, momentum_key, std::move(fresh));
  }

 private:
  // The matrix, freed when the store is closed.
  void release() override { std::vector<float>().swap(update_); }

  // body(begin, end) over [0, n) in ranges, on `ex`'s threads.
  template <class Body>
  static void for_each_range(optim::executor& ex, std::size_t n, const Body& body) {
    ex.run([&] {
      tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, elementwise_grain),
                        [&](const tbb::blocked_range<std::size_t>& r) { body(r.begin(), r.end()); });
    });
  }

  void check_size(const optim::const_tensor_ref& t, std::size_t n, const std::string& what) const {
    if (t.size != n)
      throw user_error(what + ": " + std::to_string(t.size) + " elements, the matrix has " + std::to_string(n));
    if (t.size != 0 && reinterpret_cast<std::uintptr_t>(t.data) % size_of(t.type) != 0)
      throw user_error(what + ": misaligned for its dtype");
  }

  void check_fp32(const optim::const_tensor_ref& t, std::size_t tensor, const std::string& what) const {
    if (t.type != dtype::fp32) throw user_error(what + ": float32 expected, got " + std::string(name(t.type)));
    check_size(t, state_->elements(tensor), what);
  }

  // The Newton–Schulz buffers and plans, and the matrix of Nesterov updates
  // the pass fills: RAM besides the host budget, sized by the largest matrix.
  optim::muon_optimizer kernel_{optim::muon_options{}};
  std::vector<float> update_;
};

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

  nb::class_<offloaded_muon> offloaded(m, "OffloadedMuon",
      "Muon's momentum buffers (fp32) in files of the directory `nvme_dir` (made 0700 when\n"
      "missing; its parent must exist), streamed through a pinned host budget of\n"
      "`host_memory` bytes (rounded down to 4 KiB, at least 64 KiB) in chunks of a quarter of\n"
      "it; files are preallocated `file_size` bytes at a time and removed by close() or when\n"
      "the object is freed. Besides the budget, RAM for the Newton-Schulz workspace and one\n"
      "fp32 matrix of updates, sized by the largest matrix stepped. Raises\n"
      "TierflowError (an OSError with errno and filename) when the directory cannot be made\n"
      "or written, or the disk is full.");
  offloaded.def(nb::init<const std::string&, const std::variant<std::uint64_t, std::string>&, std::uint64_t>(),
           "nvme_dir"_a, "host_memory"_a, "file_size"_a = 256ull << 20)
      .def("add_param", &offloaded_muon::add_param, "elements"_a,
           "Registers a matrix of `elements` and preallocates its momentum buffer's blocks;\n"
           "returns its slot. ENOSPC raises TierflowError and registers nothing.")
      .def("step", &offloaded_muon::step, "executor"_a, "slot"_a, "param"_a.noconvert(), "grad"_a.noconvert(),
           nb::kw_only(), "rows"_a, "cols"_a, "lr"_a, "weight_decay"_a, "momentum"_a, "nesterov"_a,
           "ns_coefficients"_a, "eps"_a, "ns_steps"_a, "adjust_lr_fn"_a.none(), "ns_dtype"_a = "bfloat16",
           "muon_step() for the matrix of `slot`, its momentum buffer on NVMe: one pass reads each\n"
           "chunk of the buffer, updates it (buf = buf.lerp(grad, 1 - momentum)), writes it back\n"
           "and puts the chunk's update (grad.lerp(buf, momentum) with nesterov, else buf) into\n"
           "an fp32 matrix in RAM, pipelined; then Newton-Schulz on that matrix and the update\n"
           "of `param` (float32: the parameter or its master), as muon_step() computes them, to\n"
           "the bit. A buffer never written starts as zeros. `param` and `grad` (float32,\n"
           "bfloat16 or float16) are C-contiguous CPU buffers of rows * cols elements, read and\n"
           "written in place. Everything is checked before anything is written (ValueError);\n"
           "an I/O error mid-pass leaves the parameter as it was and the chunks of the buffer\n"
           "before it updated. Releases the GIL.")
      .def("read", &offloaded_muon::read, "slot"_a, "out"_a.noconvert(),
           "Copies the momentum buffer of `slot` into `out` (float32, its element count), through\n"
           "the host budget; never-written chunks read as zeros.")
      .def("write", &offloaded_muon::write, "slot"_a, "data"_a.noconvert(),
           "Writes `data` (float32, the element count of `slot`) as its momentum buffer.")
      .def("forget", &offloaded_muon::forget, "slot"_a,
           "Marks the buffer of `slot` never written: the next step starts it as zeros.")
      .def("has", &offloaded_muon::has, "slot"_a, "Whether the buffer of `slot` was written.")
      .def("layout", &offloaded_muon::layout, "Per slot: its element count.")
      .def("fresh_chunks", &offloaded_muon::fresh_chunks, "slot"_a,
           "Per chunk of the buffer of `slot`: whether it was never written.")
      .def("set_fresh_chunks", &offloaded_muon::set_fresh_chunks, "slot"_a, "fresh"_a,
           "Declares which chunks of the buffer of `slot` were never written (after load()).");
  def_offloaded_state(offloaded);

  m.def("group_parameters", &group_parameters, "named_shapes"_a,
        "Which optimizer each parameter gets when a model trains with Muon, from its name and\n"
        "shape: a list of (name, shape) in, (muon, adamw) lists of their indices out. Muon\n"
        "takes a shape of two dimensions, both > 1, whose dotted name has no part marking an\n"
        "embedding or an output head (embed, embeddings, embed_tokens, tok_embeddings, wte,\n"
        "wpe, lm_head, head, output, classifier; any case); AdamW takes the rest.");
}

}  // namespace tierflow::python
