// The choice of path per call (copy_engine.hpp) and the crossover's sweep:
// plain C++, built and tested everywhere.

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>

#include "tierflow/collectives/copy_engine.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::collectives {

std::string_view name(collective c) noexcept {
  switch (c) {
    case collective::all_gather: return "all_gather";
    case collective::reduce_scatter: return "reduce_scatter";
    case collective::all_reduce: return "all_reduce";
    case collective::broadcast: return "broadcast";
  }
  return "unknown";
}

std::string_view name(ce_path p) noexcept {
  switch (p) {
    case ce_path::nccl_sm: return "nccl_sm";
    case ce_path::nccl_copy_engine: return "nccl_copy_engine";
    case ce_path::peer_copy: return "peer_copy";
  }
  return "unknown";
}

std::string_view name(link_kind k) noexcept {
  switch (k) {
    case link_kind::self: return "self";
    case link_kind::nvlink: return "nvlink";
    case link_kind::pcie: return "pcie";
  }
  return "unknown";
}

ce_telemetry::counts ce_telemetry::snapshot() const noexcept {
  // Relaxed loads: each counter is a count on its own; a snapshot taken
  // while others count may mix an earlier and a later decision's counters.
  const auto get = [](const std::atomic<std::uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  return counts{get(nccl_sm),      get(nccl_copy_engine),     get(peer_copy),
                get(reduction),    get(below_crossover),      get(not_one_node),
                get(not_nvlink),   get(nccl_too_old),         get(no_zero_cta),
                get(no_window),    get(zero_cta_unsupported), get(window_registration_failed),
                get(batch_copy_unsupported)};
}

namespace {

void count(std::atomic<std::uint64_t>& counter) noexcept { counter.fetch_add(1, std::memory_order_relaxed); }

}  // namespace

ce_policy::ce_policy(ce_topology topology, ce_crossover crossover, ce_capabilities capabilities,
                     std::shared_ptr<ce_telemetry> telemetry)
    : topology_(topology), crossover_(crossover), capabilities_(capabilities), telemetry_(std::move(telemetry)) {
  if (!telemetry_) telemetry_ = std::make_shared<ce_telemetry>();
  if (topology_.ranks < 1) throw user_error("ce_policy: " + std::to_string(topology_.ranks) + " ranks");
}

ce_path ce_policy::choose(collective op, std::size_t shard_bytes, compute_overlap overlap) const noexcept {
  ce_telemetry& t = *telemetry_;
  const auto sm = [&t](std::atomic<std::uint64_t>& why) {
    count(why);
    count(t.nccl_sm);
    return ce_path::nccl_sm;
  };
  // The copy engines move bytes; they do not add.
  if (op == collective::reduce_scatter || op == collective::all_reduce) return sm(t.reduction);
  const std::size_t from = overlap == compute_overlap::yes
                               ? std::min(crossover_.overlapped_bytes, crossover_.bytes)
                               : crossover_.bytes;
  if (from == ce_crossover::never || shard_bytes < from) return sm(t.below_crossover);
  // A copy engine is wanted from here on; what follows are fallbacks.
  if (!topology_.one_node) return sm(t.not_one_node);
  if (topology_.links == link_kind::pcie) return sm(t.not_nvlink);
  if (topology_.one_process) {
    count(t.peer_copy);
    return ce_path::peer_copy;
  }
  if (capabilities_.nccl_version < nccl_copy_engine_version) return sm(t.nccl_too_old);
  if (!capabilities_.nccl_zero_cta) return sm(t.no_zero_cta);
  if (!capabilities_.window_registered) return sm(t.no_window);
  count(t.nccl_copy_engine);
  return ce_path::nccl_copy_engine;
}

ce_crossover find_crossover(std::span<const ce_timing> timings) {
  ce_crossover found;
  found.measured = true;
  found.overlapped_bytes = 0;
  // From the largest size down, while the copy engines stay faster.
  for (auto it = timings.rbegin(); it != timings.rend(); ++it) {
    if (!(it->ce_seconds < it->sm_seconds)) break;
    found.bytes = it->shard_bytes;
  }
  return found;
}

std::vector<ce_timing> time_paths(const std::function<void(std::size_t)>& sm,
                                  const std::function<void(std::size_t)>& ce, const crossover_sweep& sweep) {
  if (sweep.min_bytes == 0 || sweep.max_bytes < sweep.min_bytes)
    throw user_error("crossover sweep: sizes " + std::to_string(sweep.min_bytes) + " to " +
                     std::to_string(sweep.max_bytes) + " bytes are not a range");
  if (sweep.factor < 2) throw user_error("crossover sweep: factor " + std::to_string(sweep.factor) + " is below 2");
  if (sweep.repeats < 1 || sweep.warmups < 0)
    throw user_error("crossover sweep: " + std::to_string(sweep.repeats) + " repeats, " +
                     std::to_string(sweep.warmups) + " warm-ups");
  using clock = std::chrono::steady_clock;
  const auto seconds = [](const std::function<void(std::size_t)>& path, std::size_t bytes) {
    const auto start = clock::now();
    path(bytes);
    return std::chrono::duration<double>(clock::now() - start).count();
  };
  std::vector<ce_timing> timings;
  for (std::size_t bytes = sweep.min_bytes;;) {
    for (int i = 0; i < sweep.warmups; ++i) {
      sm(bytes);
      ce(bytes);
    }
    ce_timing timing{bytes, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
    // Alternated, so that a clock or load change between them hits both.
    for (int i = 0; i < sweep.repeats; ++i) {
      timing.sm_seconds = std::min(timing.sm_seconds, seconds(sm, bytes));
      timing.ce_seconds = std::min(timing.ce_seconds, seconds(ce, bytes));
    }
    timings.push_back(timing);
    if (bytes > sweep.max_bytes / sweep.factor) break;  // (the next would pass max_bytes, or overflow)
    bytes *= sweep.factor;
  }
  return timings;
}

}  // namespace tierflow::collectives
