#include "tierflow/core/zenflow/streamed_host_state.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/core/tier.hpp"
#include "tierflow/core/units.hpp"

namespace tierflow::zenflow {
namespace {

constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();
constexpr std::size_t the_key[] = {0};

}  // namespace

std::uint64_t streamed_host_state::weight_bytes(const weight_shape& w, std::size_t state_count) {
  return aligned_size((1 + state_count) * w.elements() * sizeof(float));
}

std::uint64_t streamed_host_state::minimum_stage_bytes(std::span<const weight_shape> weights,
                                                       std::size_t state_count) {
  std::uint64_t most = 0;
  for (const weight_shape& w : weights) {
    if (w.matrix()) most = std::max(most, weight_bytes(w, state_count));
  }
  return most;
}

streamed_host_state::streamed_host_state(block_store& store, const std::vector<weight_shape>& weights,
                                         std::size_t state_count, std::span<const std::span<const float>> initial,
                                         streamed_host_options options)
    : state_count_(state_count),
      largest_(minimum_stage_bytes(weights, state_count)),
      // A weight's master and states are one block, its one chunk and sub-group.
      state_(store, {"state"},
             {.home = options.home,
              .stage = options.stage,
              .sub_group_bytes = std::max<std::uint64_t>(largest_, block_alignment),
              .depth = options.depth}) {
  if (state_count != 1 && state_count != 2)
    throw user_error("zenflow host state: the update rule keeps " + std::to_string(state_count) +
                     " state buffers; 1 or 2 are streamed");
  if (initial.size() != weights.size())
    throw user_error("zenflow host state: " + std::to_string(initial.size()) + " initial values for " +
                     std::to_string(weights.size()) + " weights");
  const std::uint64_t budget = store.tier_of(options.stage).budget();
  std::vector<std::size_t> matrices;
  for (std::size_t w = 0; w < weights.size(); ++w) {
    const weight_shape& shape = weights[w];
    if (!shape.matrix()) {
      tensor_.push_back(npos);
      continue;
    }
    if (initial[w].size() != shape.elements())
      throw user_error("zenflow host state: the initial values of \"" + shape.name + "\" have " +
                       std::to_string(initial[w].size()) + " elements, the weight " +
                       std::to_string(shape.elements()));
    if (weight_bytes(shape, state_count) > budget)
      throw user_error("zenflow host state: \"" + shape.name + "\" needs " +
                       format_bytes(double(weight_bytes(shape, state_count))) + " of " +
                       std::string(tierflow::name(options.stage)) + " memory for its master and state, above the " +
                       format_bytes(double(budget)) + " budget (give at least " +
                       format_bytes(double(largest_)) + ")");
    matrices.push_back(w);
    tensor_.push_back(npos);  // set once its blocks exist
  }
  lock_guard lock(mutex_);
  for (const std::size_t w : matrices) {
    tensor_[w] = state_.add_tensor("zenflow." + std::to_string(w) + "." + weights[w].name,
                                   (1 + state_count_) * weights[w].elements(), the_key);
  }
  pass(matrices, true, [&](std::size_t w, const host_buffers& b) {
    std::copy(initial[w].begin(), initial[w].end(), b.param.begin());
    std::fill(b.state0.begin(), b.state0.end(), 0.0f);
    std::fill(b.state1.begin(), b.state1.end(), 0.0f);
  });
}

void streamed_host_state::for_each(std::span<const std::size_t> weights,
                                   const std::function<void(std::size_t, const host_buffers&)>& fn) {
  lock_guard lock(mutex_);
  pass(weights, false, fn);
}

void streamed_host_state::for_each_paced(std::span<const std::size_t> weights,
                                         const std::function<void(std::size_t, const host_buffers&)>& fn,
                                         stream_pace& pace) {
  lock_guard lock(mutex_);
  pass(weights, false, fn, &pace);
}

void streamed_host_state::pass(std::span<const std::size_t> weights, bool fill,
                               const std::function<void(std::size_t, const host_buffers&)>& fn, stream_pace* pace) {
  if (weights.empty()) return;
  const access mode = fill ? access::overwrite : access::write;
  std::vector<streamed_state::pass_item> items;
  items.reserve(weights.size());
  for (const std::size_t w : weights) {
    TF_ASSERT(w < tensor_.size() && tensor_[w] != npos, "zenflow host state: a pass over a 1-D weight");
    items.push_back({tensor_[w], {{0, mode}}});
  }
  const optimizer_stream_stats s = state_.stream(items, [&](const streamed_chunk& c) {
    TF_ASSERT(c.chunk == 0, "zenflow host state: a weight streamed in more than one chunk");
    const std::span<float> all = c.buffers[0];
    const std::size_t n = all.size() / (1 + state_count_);
    const host_buffers b{.param = all.first(n),
                         .state0 = all.subspan(n, n),
                         .state1 = state_count_ == 2 ? all.subspan(2 * n, n) : std::span<float>()};
    fn(weights[c.item], b);
  }, pace);
  totals_.total += s.total;
  totals_.update += s.update;
  totals_.wait += s.wait;
  totals_.flush += s.flush;
  totals_.paced += s.paced;
  totals_.bytes += s.bytes;
}

std::uint64_t streamed_host_state::home_bytes() const {
  lock_guard lock(mutex_);
  return state_.home_bytes();
}

optimizer_stream_stats streamed_host_state::totals() const {
  lock_guard lock(mutex_);
  return totals_;
}

}  // namespace tierflow::zenflow
