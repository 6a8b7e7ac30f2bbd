#include "tierflow/core/zenflow/cpu_device.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::zenflow {

cpu_device::cpu_device(const std::vector<weight_shape>& weights, update_rule& rule,
                       std::vector<std::span<float>> parameters)
    : weights_(weights), rule_(rule), parameters_(std::move(parameters)) {
  if (parameters_.size() != weights_.size())
    throw user_error("zenflow cpu device: " + std::to_string(parameters_.size()) + " parameters for " +
                     std::to_string(weights_.size()) + " weights");
  const bool two = rule_.state_count() > 1;
  for (std::size_t w = 0; w < weights_.size(); ++w) {
    const weight_shape& s = weights_[w];
    if (parameters_[w].size() != s.elements())
      throw user_error("zenflow cpu device: the parameter of weight \"" + s.name + "\" has " +
                       std::to_string(parameters_[w].size()) + " elements, not " + std::to_string(s.elements()));
    owned_.emplace_back();
    if (!s.matrix()) {
      // A 1-D weight is always the device's; its master is the parameter.
      owned_.back().columns = {0};
      owned_.back().state0.assign(s.elements(), 0.0f);
      owned_.back().state1.assign(two ? s.elements() : 0, 0.0f);
    }
  }
  gradients_.resize(weights_.size());
  staging_.resize(weights_.size());
}

void cpu_device::set_gradient(std::size_t w, std::span<const float> gradient) {
  TF_ASSERT(w < weights_.size());
  if (gradient.size() != weights_[w].elements())
    throw user_error("zenflow cpu device: the gradient of weight \"" + weights_[w].name + "\" has " +
                     std::to_string(gradient.size()) + " elements, not " + std::to_string(weights_[w].elements()));
  gradients_[w] = gradient;
}

void cpu_device::clear_gradients() { std::fill(gradients_.begin(), gradients_.end(), std::span<const float>()); }

std::span<const float> cpu_device::gradient(std::size_t w) const {
  TF_ASSERT(gradients_[w].size() == weights_[w].elements(), "zenflow cpu device: a step without its gradient");
  return gradients_[w];
}

void cpu_device::column_importance(std::size_t w, importance_norm norm, std::span<float> out) {
  TF_ASSERT(out.size() == weights_[w].cols);
  column_norms(gradient(w), weights_[w].rows, norm, out);
}

void cpu_device::update_owned(std::size_t w, std::int64_t step) {
  const weight_shape& shape = weights_[w];
  const std::uint64_t rows = shape.rows;
  owned& o = owned_[w];
  const std::span<const float> grad = gradient(w);
  const bool two = rule_.state_count() > 1;
  // Consecutive owned columns are contiguous in the parameter and in the
  // packed state: one call per run, on the parameter in place.
  for_each_packed_run(o.columns, [&](column_run run, std::size_t i) {
    const std::uint64_t first = run.begin, n = std::uint64_t{run.end - run.begin} * rows;
    update_args args;
    args.weight = &shape;
    args.weight_index = w;
    args.first_column = run.begin;
    args.columns = run.end - run.begin;
    args.param = parameters_[w].subspan(first * rows, n);
    args.grad = grad.subspan(first * rows, n);
    args.state0 = std::span(o.state0).subspan(i * rows, n);
    if (two) args.state1 = std::span(o.state1).subspan(i * rows, n);
    args.step = step;
    args.where = side::device;
    rule_.apply(args);
  });
}

std::span<const float> cpu_device::download_gradient(std::size_t w) { return gradient(w); }

void cpu_device::stage_upload(std::size_t w, std::span<const column_run> runs, std::span<const float> master) {
  // A host master that is the parameter itself was updated where the
  // forward reads it: nothing to send.
  if (master.data() == parameters_[w].data()) return;
  const std::uint64_t rows = weights_[w].rows;
  std::vector<float>& staging = staging_[w];
  if (staging.empty()) staging.resize(weights_[w].elements());
  for (const column_run r : runs)
    std::copy(master.begin() + r.begin * rows, master.begin() + r.end * rows, staging.begin() + r.begin * rows);
}

void cpu_device::apply_staged(std::size_t w, std::span<const column_run> runs) {
  const std::vector<float>& staging = staging_[w];
  if (staging.empty()) return;  // nothing was staged: the host's master is the parameter
  const std::uint64_t rows = weights_[w].rows;
  for (const column_run r : runs)
    std::copy(staging.begin() + r.begin * rows, staging.begin() + r.end * rows,
              parameters_[w].begin() + r.begin * rows);
}

void cpu_device::hand_over(std::size_t w, std::span<const std::uint32_t> selected, const packed_columns& entering,
                           const packed_columns& leaving) {
  const std::uint64_t rows = weights_[w].rows;
  owned& o = owned_[w];
  const bool two = rule_.state_count() > 1;
  const std::span<float> param = parameters_[w];
  // Leaving columns: their master (the parameter) and state go to the host.
  for (std::size_t i = 0; i < leaving.columns.size(); ++i) {
    const std::uint32_t c = leaving.columns[i];
    const auto it = std::lower_bound(o.columns.begin(), o.columns.end(), c);
    TF_ASSERT(it != o.columns.end() && *it == c, "a leaving column was not the device's");
    const auto at = (it - o.columns.begin()) * static_cast<std::ptrdiff_t>(rows);
    std::copy_n(param.begin() + c * rows, rows, leaving.param.begin() + i * rows);
    std::copy_n(o.state0.begin() + at, rows, leaving.state0.begin() + i * rows);
    if (two) std::copy_n(o.state1.begin() + at, rows, leaving.state1.begin() + i * rows);
  }
  // The new packed state, in selection order: kept columns move within the
  // device, entering ones come from the host and set their parameter.
  owned next;
  next.columns.assign(selected.begin(), selected.end());
  next.state0.resize(selected.size() * rows);
  if (two) next.state1.resize(selected.size() * rows);
  std::size_t entered = 0;
  for (std::size_t k = 0; k < selected.size(); ++k) {
    const std::uint32_t c = selected[k];
    const auto it = std::lower_bound(o.columns.begin(), o.columns.end(), c);
    const bool kept = it != o.columns.end() && *it == c;
    if (kept) {
      const auto at = (it - o.columns.begin()) * static_cast<std::ptrdiff_t>(rows);
      std::copy_n(o.state0.begin() + at, rows, next.state0.begin() + k * rows);
      if (two) std::copy_n(o.state1.begin() + at, rows, next.state1.begin() + k * rows);
      continue;
    }
    TF_ASSERT(entered < entering.columns.size() && entering.columns[entered] == c,
              "a column entering the device is not among the entering ones");
    std::copy_n(entering.param.begin() + entered * rows, rows, param.begin() + c * rows);
    std::copy_n(entering.state0.begin() + entered * rows, rows, next.state0.begin() + k * rows);
    if (two) std::copy_n(entering.state1.begin() + entered * rows, rows, next.state1.begin() + k * rows);
    ++entered;
  }
  TF_ASSERT(entered == entering.columns.size() &&
                entering.columns.size() + (o.columns.size() - leaving.columns.size()) == selected.size(),
            "hand-over does not add up");
  o = std::move(next);
}

bool cpu_device::read_owned(std::size_t w, const packed_columns& out) {
  const owned& o = owned_[w];
  const std::uint64_t rows = weights_[w].rows;
  TF_ASSERT(std::ranges::equal(out.columns, o.columns), "read_owned: not the columns the device owns");
  for (std::size_t i = 0; i < o.columns.size(); ++i)
    std::copy_n(parameters_[w].begin() + o.columns[i] * rows, rows, out.param.begin() + i * rows);
  std::copy(o.state0.begin(), o.state0.end(), out.state0.begin());
  if (!out.state1.empty()) std::copy(o.state1.begin(), o.state1.end(), out.state1.begin());
  return true;
}

bool cpu_device::write_owned(std::size_t w, const packed_columns& in) {
  owned& o = owned_[w];
  const std::uint64_t rows = weights_[w].rows;
  TF_ASSERT(std::ranges::equal(in.columns, o.columns), "write_owned: not the columns the device owns");
  for (std::size_t i = 0; i < o.columns.size(); ++i)
    std::copy_n(in.param.begin() + i * rows, rows, parameters_[w].begin() + o.columns[i] * rows);
  std::copy(in.state0.begin(), in.state0.end(), o.state0.begin());
  if (!in.state1.empty()) std::copy(in.state1.begin(), in.state1.end(), o.state1.begin());
  return true;
}

}  // namespace tierflow::zenflow
