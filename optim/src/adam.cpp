#include "tierflow/optim/adam.hpp"

#include <atomic>
#include <cmath>

#include "kernels.hpp"
#include "tiles.hpp"
#include "validate.hpp"

namespace tierflow::optim {

adam_optimizer::adam_optimizer(const adam_options& options) : options_(options) {
  detail::require_finite_at_least(options.lr, 0.0f, "lr");
  detail::require_unit_interval(options.beta1, "beta1");
  detail::require_unit_interval(options.beta2, "beta2");
  detail::require_finite_at_least(options.eps, 0.0f, "eps");
  detail::require_finite_at_least(options.weight_decay, 0.0f, "weight_decay");
}

namespace {

void validate(const adam_sub_group& g, const adam_step_args& args, optim::amsgrad ams) {
  const std::size_t n = g.param.size();
  detail::require_buffer(const_tensor_ref(g.param.data(), n, dtype::fp32), n, "param");
  detail::require_dtype(g.grad.type, "grad", true, true, true);
  detail::require_buffer(g.grad, n, "grad");
  detail::require_dtype(g.exp_avg.type, "exp_avg", true, true, false);
  detail::require_buffer(g.exp_avg, n, "exp_avg");
  detail::require(g.exp_avg_sq.type == g.exp_avg.type, "exp_avg_sq",
                  "must have exp_avg's dtype (" + std::string(name(g.exp_avg.type)) + ")");
  detail::require_buffer(g.exp_avg_sq, n, "exp_avg_sq");
  if (ams == optim::amsgrad::on) {
    detail::require(g.max_exp_avg_sq.type == g.exp_avg.type, "max_exp_avg_sq",
                    "must have exp_avg's dtype (" + std::string(name(g.exp_avg.type)) + ")");
    detail::require_buffer(g.max_exp_avg_sq, n, "max_exp_avg_sq");
  } else {
    detail::require(g.max_exp_avg_sq.empty(), "max_exp_avg_sq", "is given but amsgrad is off");
  }
  if (!g.param_copy.empty()) {
    detail::require_dtype(g.param_copy.type, "param_copy", false, true, true);
    detail::require_buffer(g.param_copy, n, "param_copy");
  }
  detail::require(args.step >= 1, "step", "must be >= 1, got " + std::to_string(args.step));
  detail::require_grad_scale(args.grad_scale);
}

}  // namespace

std::size_t adam_optimizer::bytes_per_param(const adam_sub_group& g, optim::amsgrad ams) {
  const std::size_t state = size_of(g.exp_avg.type);
  std::size_t bytes = 4 + 4                    // p read + write
                      + size_of(g.grad.type)   // g read
                      + 4 * state;             // m, v read + write
  if (ams == optim::amsgrad::on) bytes += 2 * state;
  if (!g.param_copy.empty()) bytes += size_of(g.param_copy.type);
  return bytes;
}

step_outcome adam_optimizer::step(executor& ex, const adam_sub_group& group,
                                  const adam_step_args& args) const {
  validate(group, args, options_.amsgrad);
  const std::size_t n = group.param.size();
  // g · (-s) is exactly -(g · s): maximizing is minimizing the negated gradient.
  const float grad_scale = args.objective == objective::maximize ? -args.grad_scale : args.grad_scale;

  if (args.check == finite_check::skip_step) {
    // A separate read of the gradients: the update must not start before the
    // whole sub-group is known to be finite, or a skipped step would leave
    // half of it written.
    std::atomic<bool> finite{true};
    detail::for_each_tile(ex, n, [&](std::size_t begin, std::size_t end) {
      if (!finite.load(std::memory_order_relaxed)) return;  // a hint only: the result is the flag
      if (!detail::all_finite(ex.target(), group.grad.data, group.grad.type, grad_scale, begin, end))
        finite.store(false, std::memory_order_relaxed);
    });
    // for_each_tile returns after every tile ran (parallel_for joins): the
    // relaxed stores are visible here.
    if (!finite.load(std::memory_order_relaxed)) return step_outcome::skipped_nonfinite;
  }

  const adam_options& o = options_;
  detail::adam_kernel_args a;
  a.param = group.param.data();
  a.grad = group.grad.data;
  a.exp_avg = group.exp_avg.data;
  a.exp_avg_sq = group.exp_avg_sq.data;
  a.max_exp_avg_sq = group.max_exp_avg_sq.data;
  a.param_copy = group.param_copy.data;
  a.grad_type = group.grad.type;
  a.state_type = group.exp_avg.type;
  a.copy = group.param_copy.empty()                 ? detail::copy_kind::none
           : group.param_copy.type == dtype::bf16 ? detail::copy_kind::bf16
                                                  : detail::copy_kind::fp16;
  a.amsgrad = o.amsgrad == optim::amsgrad::on;
  a.grad_scale = grad_scale;
  a.k = detail::make_adam_element_constants(o, args.step);

  detail::for_each_tile(ex, n, [&](std::size_t begin, std::size_t end) {
    detail::adam_range(ex.target(), a, begin, end);
  });
  return step_outcome::applied;
}

void adam_shaped_stream(executor& ex, std::span<float> p, std::span<const float> g,
                        std::span<float> m, std::span<float> v) {
  const std::size_t n = p.size();
  detail::require_buffer(const_tensor_ref(g.data(), g.size(), dtype::fp32), n, "g");
  detail::require_buffer(const_tensor_ref(m.data(), m.size(), dtype::fp32), n, "m");
  detail::require_buffer(const_tensor_ref(v.data(), v.size(), dtype::fp32), n, "v");
  detail::for_each_tile(ex, n, [&](std::size_t begin, std::size_t end) {
    detail::stream_range(ex.target(), p.data(), g.data(), m.data(), v.data(), begin, end);
  });
}

}  // namespace tierflow::optim
