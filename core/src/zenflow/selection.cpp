#include "tierflow/core/zenflow/selection.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tierflow/core/assert.hpp"

namespace tierflow::zenflow {

void column_norms(std::span<const float> grad, std::uint64_t rows, importance_norm norm, std::span<float> out) {
  TF_ASSERT(grad.size() == rows * out.size(), "column_norms: the gradient is not rows x columns");
  const float* g = grad.data();
  for (std::size_t c = 0; c < out.size(); ++c) {
    double sum = 0;
    for (std::uint64_t r = 0; r < rows; ++r) {
      const double x = g[c * rows + r];
      sum += norm == importance_norm::l1 ? std::fabs(x) : x * x;
    }
    out[c] = static_cast<float>(sum);
  }
}

std::size_t columns_to_keep(std::size_t columns, double topk_ratio) {
  if (columns == 0) return 0;
  const auto k = static_cast<std::size_t>(std::ceil(topk_ratio * static_cast<double>(columns) - 1e-9));
  return std::clamp<std::size_t>(k, 1, columns);
}

std::vector<std::uint32_t> top_columns(std::span<const float> importance, std::size_t k) {
  TF_ASSERT(k <= importance.size());
  std::vector<std::uint32_t> order(importance.size());
  std::iota(order.begin(), order.end(), 0u);
  // Non-finite first, then by score descending, then by index ascending.
  auto rank = [&](std::uint32_t a, std::uint32_t b) {
    const float x = importance[a], y = importance[b];
    const bool fx = std::isfinite(x), fy = std::isfinite(y);
    if (fx != fy) return !fx;
    if (fx && x != y) return x > y;
    return a < b;
  };
  std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(), rank);
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

column_split::column_split(std::size_t columns) : device_(columns, 0) {}

selection_change column_split::refresh(std::span<const std::uint32_t> selected) {
  selection_change change;
  std::vector<std::uint8_t> next(device_.size(), 0);
  for (std::size_t i = 0; i < selected.size(); ++i) {
    const std::uint32_t c = selected[i];
    TF_ASSERT(c < device_.size(), "selected column out of range");
    TF_ASSERT(i == 0 || selected[i - 1] < c, "selection must be ascending and unique");
    next[c] = 1;
    if (!device_[c]) change.entering.push_back(c);
  }
  for (const std::uint32_t c : selected_) {
    if (!next[c]) change.leaving.push_back(c);
  }
  device_ = std::move(next);
  selected_.assign(selected.begin(), selected.end());
  return change;
}

update_trigger::update_trigger(std::size_t weights, double auto_ratio, double average_decay)
    : important_(weights, 0.0),
      unimportant_(weights, 0.0),
      seen_(weights, 0),
      auto_ratio_(auto_ratio),
      decay_(average_decay) {
  TF_ASSERT(auto_ratio > 0 && auto_ratio <= 1);
  TF_ASSERT(average_decay >= 0 && average_decay < 1);
}

void update_trigger::observe(std::size_t weight, double important_mass, double unimportant_mass) {
  TF_ASSERT(weight < important_.size());
  if (!seen_[weight]) {
    important_[weight] = important_mass;
    seen_[weight] = 1;
  } else {
    important_[weight] = decay_ * important_[weight] + (1 - decay_) * important_mass;
  }
  unimportant_[weight] += unimportant_mass;
}

bool update_trigger::due() const {
  if (important_.empty()) return true;
  std::size_t caught_up = 0;
  for (std::size_t w = 0; w < important_.size(); ++w) {
    if (seen_[w] && unimportant_[w] >= important_[w]) ++caught_up;
  }
  return static_cast<double>(caught_up) >= auto_ratio_ * static_cast<double>(important_.size()) - 1e-9;
}

void update_trigger::load(const state& s) {
  TF_ASSERT(s.important.size() == important_.size() && s.unimportant.size() == important_.size() &&
                s.seen.size() == important_.size(),
            "update_trigger::load: a state of another number of weights");
  important_ = s.important;
  unimportant_ = s.unimportant;
  seen_ = s.seen;
}

void update_trigger::reset() { std::fill(unimportant_.begin(), unimportant_.end(), 0.0); }

}  // namespace tierflow::zenflow
