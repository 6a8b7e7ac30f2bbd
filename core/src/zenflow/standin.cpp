#include "tierflow/core/zenflow/standin.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::zenflow {

memory_host_state::memory_host_state(const std::vector<weight_shape>& weights, std::size_t state_count) {
  for (const auto& w : weights) {
    param_.emplace_back(w.elements(), 0.0f);
    state0_.emplace_back(w.elements(), 0.0f);
    state1_.emplace_back(state_count > 1 ? w.elements() : 0, 0.0f);
  }
  master_.assign(param_.begin(), param_.end());
}

memory_host_state::memory_host_state(const std::vector<weight_shape>& weights, std::size_t state_count,
                                     std::vector<std::span<float>> master)
    : master_(std::move(master)) {
  if (master_.size() != weights.size())
    throw user_error("zenflow host state: " + std::to_string(master_.size()) + " master buffers for " +
                     std::to_string(weights.size()) + " weights");
  for (std::size_t w = 0; w < weights.size(); ++w) {
    if (master_[w].size() != weights[w].elements())
      throw user_error("zenflow host state: the master buffer of weight \"" + weights[w].name + "\" has " +
                       std::to_string(master_[w].size()) + " elements, not " + std::to_string(weights[w].elements()));
    state0_.emplace_back(weights[w].elements(), 0.0f);
    state1_.emplace_back(state_count > 1 ? weights[w].elements() : 0, 0.0f);
  }
}

host_buffers memory_host_state::buffers(std::size_t w) { return {master_[w], state0_[w], state1_[w]}; }

void memory_host_state::for_each(std::span<const std::size_t> weights,
                                 const std::function<void(std::size_t, const host_buffers&)>& fn) {
  for (const std::size_t w : weights) fn(w, buffers(w));
}

standin_device::standin_device(const std::vector<weight_shape>& weights, update_rule& rule)
    : weights_(weights), rule_(rule) {
  for (const auto& w : weights) {
    compute_.emplace_back(w.elements(), 0.0f);
    grad_.emplace_back(w.elements(), 0.0f);
    staging_.emplace_back(w.matrix() ? w.elements() : 0, 0.0f);
    owned_.emplace_back();
    if (!w.matrix()) {
      // A 1-D weight is always the device's, master and state included.
      owned_.back().columns = {0};
      owned_.back().master.assign(w.elements(), 0.0f);
      owned_.back().state0.assign(w.elements(), 0.0f);
      owned_.back().state1.assign(rule.state_count() > 1 ? w.elements() : 0, 0.0f);
    }
  }
}

void standin_device::column_importance(std::size_t w, importance_norm norm, std::span<float> out) {
  TF_ASSERT(out.size() == weights_[w].cols);
  column_norms(grad_[w], weights_[w].rows, norm, out);
}

void standin_device::update_owned(std::size_t w, std::int64_t step) {
  const weight_shape& shape = weights_[w];
  const std::uint64_t rows = shape.rows;
  owned& o = owned_[w];
  // Consecutive owned columns are contiguous in both layouts: one call per run.
  for_each_packed_run(o.columns, [&](column_run run, std::size_t i) {
    const std::uint64_t first = run.begin, n = std::uint64_t{run.end - run.begin} * rows;
    update_args args;
    args.weight = &shape;
    args.weight_index = w;
    args.first_column = run.begin;
    args.columns = run.end - run.begin;
    args.param = std::span(o.master).subspan(i * rows, n);
    args.grad = std::span<const float>(grad_[w]).subspan(first * rows, n);
    args.state0 = std::span(o.state0).subspan(i * rows, n);
    if (rule_.state_count() > 1) args.state1 = std::span(o.state1).subspan(i * rows, n);
    args.step = step;
    args.where = side::device;
    rule_.apply(args);
    std::copy_n(o.master.begin() + static_cast<std::ptrdiff_t>(i * rows), n,
                compute_[w].begin() + static_cast<std::ptrdiff_t>(first * rows));
  });
}

void standin_device::initialize(std::size_t w, std::span<const float> values) {
  TF_ASSERT(values.size() == weights_[w].elements());
  std::copy(values.begin(), values.end(), compute_[w].begin());
  if (!weights_[w].matrix()) std::copy(values.begin(), values.end(), owned_[w].master.begin());
}

std::span<const float> standin_device::download_gradient(std::size_t w) { return grad_[w]; }

void standin_device::stage_upload(std::size_t w, std::span<const column_run> runs, std::span<const float> master) {
  const std::uint64_t rows = weights_[w].rows;
  for (const column_run r : runs)
    std::copy(master.begin() + r.begin * rows, master.begin() + r.end * rows, staging_[w].begin() + r.begin * rows);
}

void standin_device::apply_staged(std::size_t w, std::span<const column_run> runs) {
  const std::uint64_t rows = weights_[w].rows;
  for (const column_run r : runs)
    std::copy(staging_[w].begin() + r.begin * rows, staging_[w].begin() + r.end * rows,
              compute_[w].begin() + r.begin * rows);
}

void standin_device::hand_over(std::size_t w, std::span<const std::uint32_t> selected, const packed_columns& entering,
                               const packed_columns& leaving) {
  const std::uint64_t rows = weights_[w].rows;
  owned& o = owned_[w];
  const bool two = rule_.state_count() > 1;
  // Leaving columns: their master and state go to the host.
  for (std::size_t i = 0; i < leaving.columns.size(); ++i) {
    const std::uint32_t c = leaving.columns[i];
    const auto it = std::lower_bound(o.columns.begin(), o.columns.end(), c);
    TF_ASSERT(it != o.columns.end() && *it == c, "a leaving column was not the device's");
    const auto at = (it - o.columns.begin()) * static_cast<std::ptrdiff_t>(rows);
    std::copy_n(o.master.begin() + at, rows, leaving.param.begin() + i * rows);
    std::copy_n(o.state0.begin() + at, rows, leaving.state0.begin() + i * rows);
    if (two) std::copy_n(o.state1.begin() + at, rows, leaving.state1.begin() + i * rows);
  }
  // The new packed layout, in selection order: kept columns move within the
  // device, entering ones come from the host.
  owned next;
  next.columns.assign(selected.begin(), selected.end());
  next.master.resize(selected.size() * rows);
  next.state0.resize(selected.size() * rows);
  if (two) next.state1.resize(selected.size() * rows);
  std::size_t entered = 0;
  for (std::size_t k = 0; k < selected.size(); ++k) {
    const std::uint32_t c = selected[k];
    const auto it = std::lower_bound(o.columns.begin(), o.columns.end(), c);
    const bool kept = it != o.columns.end() && *it == c;
    if (!kept) TF_ASSERT(entered < entering.columns.size() && entering.columns[entered] == c,
                         "a column entering the device is not among the entering ones");
    const std::span<const float> master =
        kept ? std::span<const float>(o.master).subspan((it - o.columns.begin()) * rows, rows)
             : entering.param.subspan(entered * rows, rows);
    const std::span<const float> state0 =
        kept ? std::span<const float>(o.state0).subspan((it - o.columns.begin()) * rows, rows)
             : entering.state0.subspan(entered * rows, rows);
    std::copy(master.begin(), master.end(), next.master.begin() + k * rows);
    std::copy(state0.begin(), state0.end(), next.state0.begin() + k * rows);
    if (two) {
      const std::span<const float> state1 =
          kept ? std::span<const float>(o.state1).subspan((it - o.columns.begin()) * rows, rows)
               : entering.state1.subspan(entered * rows, rows);
      std::copy(state1.begin(), state1.end(), next.state1.begin() + k * rows);
    }
    if (!kept) {
      // The compute copy of an entering column starts from the host's master.
      std::copy(master.begin(), master.end(), compute_[w].begin() + c * rows);
      ++entered;
    }
  }
  TF_ASSERT(entered == entering.columns.size() &&
                entering.columns.size() + (o.columns.size() - leaving.columns.size()) == selected.size(),
            "hand-over does not add up");
  o = std::move(next);
}

bool standin_device::read_owned(std::size_t w, const packed_columns& out) {
  const owned& o = owned_[w];
  TF_ASSERT(std::ranges::equal(out.columns, o.columns), "read_owned: not the columns the device owns");
  std::copy(o.master.begin(), o.master.end(), out.param.begin());
  std::copy(o.state0.begin(), o.state0.end(), out.state0.begin());
  if (!out.state1.empty()) std::copy(o.state1.begin(), o.state1.end(), out.state1.begin());
  return true;
}

bool standin_device::write_owned(std::size_t w, const packed_columns& in) {
  owned& o = owned_[w];
  const std::uint64_t rows = weights_[w].rows;
  TF_ASSERT(std::ranges::equal(in.columns, o.columns), "write_owned: not the columns the device owns");
  std::copy(in.param.begin(), in.param.end(), o.master.begin());
  std::copy(in.state0.begin(), in.state0.end(), o.state0.begin());
  if (!in.state1.empty()) std::copy(in.state1.begin(), in.state1.end(), o.state1.begin());
  for (std::size_t i = 0; i < o.columns.size(); ++i)
    std::copy_n(o.master.begin() + static_cast<std::ptrdiff_t>(i * rows), rows,
                compute_[w].begin() + static_cast<std::ptrdiff_t>(o.columns[i] * rows));
  return true;
}

}  // namespace tierflow::zenflow
