#include "tierflow/optim/zenflow_rule.hpp"

#include <utility>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::optim {

zenflow_rule::zenflow_rule(std::vector<optimizer_kind> kinds, executor& device_threads, executor& host_threads)
    : kinds_(std::move(kinds)),
      device_threads_(device_threads),
      host_threads_(host_threads),
      current_(kinds_.size()),
      host_(kinds_.size()) {}

void zenflow_rule::set_adam(std::size_t w, const adam_options& options) {
  TF_ASSERT(w < current_.size());
  if (options.amsgrad == amsgrad::on)
    throw user_error("zenflow: amsgrad is not supported (the engine keeps two state buffers per element)");
  (void)adam_optimizer(options);  // validates (user_error)
  current_[w].adam = options;
}

void zenflow_rule::set_muon(std::size_t w, const muon_options& options) {
  TF_ASSERT(w < current_.size());
  (void)muon_optimizer(options);  // validates (user_error)
  current_[w].muon = options;
}

zenflow::granularity zenflow_rule::unit(std::size_t w) const noexcept {
  return kinds_[w] == optimizer_kind::muon ? zenflow::granularity::matrix : zenflow::granularity::columns;
}

void zenflow_rule::begin_host_step(std::int64_t) { host_ = current_; }

void zenflow_rule::apply(const zenflow::update_args& a) {
  const bool host = a.where == zenflow::side::host;
  const weight_options& options = host ? host_[a.weight_index] : current_[a.weight_index];
  executor& threads = host ? host_threads_ : device_threads_;
  if (kinds_[a.weight_index] == optimizer_kind::muon) {
    muon_optimizer& muon = host ? host_muon_ : device_muon_;
    muon.set_options(options.muon);  // keeps the workspace
    muon_matrix m;
    m.param = a.param;
    m.grad = fp32_ref(a.grad);
    m.momentum_buffer = a.state0;
    m.rows = a.weight->cols;
    m.cols = a.weight->rows;
    muon.step(threads, m);
    return;
  }
  adam_sub_group g;
  g.param = a.param;
  g.grad = fp32_ref(a.grad);
  g.exp_avg = fp32_ref(a.state0);
  g.exp_avg_sq = fp32_ref(a.state1);
  adam_optimizer(options.adam).step(threads, g, {.step = a.step});
}

void zenflow_rule::rebase_state(const zenflow::crossing_args& a) {
  if (kinds_[a.weight_index] == optimizer_kind::muon) return;
  const adam_options& o = current_[a.weight_index].adam;
  zenflow::rebase_adam_moments(a, o.beta1, o.beta2);
}

}  // namespace tierflow::optim
