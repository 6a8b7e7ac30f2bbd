// The queue in front of one link: which waiting transfer goes next.
//
// Modelled on Seastar's fair_queue: each class accumulates the cost it was
// served (bytes divided by its weight) and the class with the smallest total
// goes next, so over time each backlogged class gets a share of the link
// proportional to its weight. Two departures, both for the training loop:
//
//   * demand is served strictly first — compute is waiting for it — and the
//     link keeps one engine for demand alone (see `background_limit`), so a
//     demand fetch never waits behind a background transfer already running;
//   * a class that was idle does not bank credit: on becoming backlogged its
//     total is raised to the smallest total among the backlogged classes.
//
// Worked example, weights prefetch 8, writeback 4, optimizer_stream 2, all
// three backlogged with 1 MiB transfers: prefetch's total grows by 1/8 MiB
// per transfer, writeback's by 1/4, optimizer_stream's by 1/2, so out of
// every 7 transfers 4 are prefetches, 2 write-backs and 1 optimizer stream —
// and none of them is ever picked while a demand transfer waits.
//
// Not thread-safe: the link guards it with its lock. A hot path (every
// transfer), hence a template over the job type rather than virtual calls.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <utility>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/block.hpp"

namespace tierflow {

struct fair_queue_weights {
  // Shares of the background classes; demand has no weight (strict priority).
  std::array<double, traffic_class_count> weight{0.0, 8.0, 4.0, 2.0};
};

template <typename Job>
class fair_queue {
 public:
  explicit fair_queue(fair_queue_weights weights = {}) : weights_(weights) {
    for (std::size_t c = 1; c < traffic_class_count; ++c) TF_ASSERT(weights_.weight[c] > 0.0);
  }

  // Queues `job` of class `cls` whose cost is `bytes`.
  void push(traffic_class cls, std::uint64_t bytes, Job job) {
    const std::size_t c = index_of(cls);
    if (c != 0 && queues_[c].empty()) {
      // Idle classes bank no credit: start at the smallest backlogged total.
      double floor = std::numeric_limits<double>::infinity();
      for (std::size_t o = 1; o < traffic_class_count; ++o)
        if (!queues_[o].empty()) floor = std::min(floor, total_[o]);
      if (floor != std::numeric_limits<double>::infinity()) total_[c] = std::max(total_[c], floor);
    }
    queues_[c].push_back(entry{bytes, std::move(job)});
    ++size_;
  }

  // The next job: demand first; else, when `background_allowed`, the
  // backlogged background class with the smallest served total. nullopt when
  // nothing may go. Returns the job's class through `cls`.
  std::optional<Job> pop(bool background_allowed, traffic_class& cls) {
    if (!queues_[0].empty()) return take(0, cls);
    if (!background_allowed) return std::nullopt;
    std::size_t best = traffic_class_count;
    for (std::size_t c = 1; c < traffic_class_count; ++c) {
      if (queues_[c].empty()) continue;
      if (best == traffic_class_count || total_[c] < total_[best]) best = c;
    }
    if (best == traffic_class_count) return std::nullopt;
    return take(best, cls);
  }

  bool empty() const noexcept { return size_ == 0; }
  std::size_t size() const noexcept { return size_; }
  bool has_demand() const noexcept { return !queues_[0].empty(); }
  std::size_t queued(traffic_class cls) const noexcept { return queues_[index_of(cls)].size(); }

 private:
  struct entry {
    std::uint64_t bytes;
    Job job;
  };

  std::optional<Job> take(std::size_t c, traffic_class& cls) {
    entry e = std::move(queues_[c].front());
    queues_[c].pop_front();
    --size_;
    if (c != 0) total_[c] += static_cast<double>(e.bytes) / weights_.weight[c];
    cls = static_cast<traffic_class>(c);
    return std::optional<Job>(std::move(e.job));
  }

  fair_queue_weights weights_;
  std::array<std::deque<entry>, traffic_class_count> queues_;
  std::array<double, traffic_class_count> total_{};
  std::size_t size_ = 0;
};

}  // namespace tierflow
