#include "tierflow/core/optimizer_stream.hpp"

#include <algorithm>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/lease.hpp"
#include "tierflow/core/store.hpp"

namespace tierflow {
namespace {

using clock = std::chrono::steady_clock;

access mode_of(const sub_group& g, std::size_t k) { return g.modes.empty() ? access::write : g.modes[k]; }

}  // namespace

void stream_pace::reset(std::chrono::nanoseconds spread_over) {
  lock_guard lock(mutex_);
  spread_over_ = spread_over;
  hurried_ = false;
}

std::chrono::nanoseconds stream_pace::spread_over() const {
  lock_guard lock(mutex_);
  return hurried_ ? std::chrono::nanoseconds{0} : spread_over_;
}

void stream_pace::hurry() {
  {
    lock_guard lock(mutex_);
    hurried_ = true;
  }
  cv_.notify_all();
}

bool stream_pace::hurried() const {
  lock_guard lock(mutex_);
  return hurried_;
}

void stream_pace::wait_until(clock::time_point deadline) {
  unique_lock lock(mutex_);
  while (!hurried_ && clock::now() < deadline) lock.wait_until(cv_, deadline);
}

optimizer_stream_stats run_optimizer_stream(block_store& store, std::span<const sub_group> groups,
                                            const sub_group_update& update,
                                            const optimizer_stream_options& options) {
  if (options.depth == 0) throw user_error("optimizer stream: depth must be at least 1");
  for (const auto& g : groups) {
    if (!g.modes.empty() && g.modes.size() != g.blocks.size())
      throw user_error("optimizer stream: a sub-group gives " + std::to_string(g.modes.size()) +
                       " access modes for " + std::to_string(g.blocks.size()) + " blocks");
  }
  optimizer_stream_stats stats;
  const auto start = clock::now();
  // The bytes before each sub-group, for the pace.
  std::vector<std::uint64_t> before;
  const bool paced = options.pace != nullptr && options.pace->spread_over() > std::chrono::nanoseconds{0};
  if (paced) {
    before.reserve(groups.size() + 1);
    before.push_back(0);
    for (const auto& g : groups) {
      std::uint64_t bytes = 0;
      for (const block_id b : g.blocks) bytes += aligned_size(store.describe(b).size_bytes);
      before.push_back(before.back() + bytes);
    }
  }
  std::size_t hinted = 0;  // sub-groups [0, hinted) have had their prefetch hints
  auto hint_until = [&](std::size_t end) {
    for (; hinted < std::min(end, groups.size()); ++hinted) {
      const sub_group& g = groups[hinted];
      for (std::size_t k = 0; k < g.blocks.size(); ++k) {
        // An overwritten block's old bytes are never read: loading them would be wasted I/O.
        if (mode_of(g, k) != access::overwrite)
          store.prefetch(g.blocks[k], options.stage, traffic_class::optimizer_stream);
      }
    }
  };

  std::vector<lease> leases;
  std::vector<std::span<std::byte>> buffers;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const sub_group& g = groups[i];
    if (paced && i > 0 && before.back() > 0) {
      // Its share of the span: neither its loads nor its update start before then.
      const double share = static_cast<double>(before[i]) / static_cast<double>(before.back());
      const auto due = start + std::chrono::duration_cast<clock::duration>(
                                   std::chrono::duration<double>(options.pace->spread_over()) * share);
      const auto held = clock::now();
      if (held < due) {
        options.pace->wait_until(due);
        stats.paced += clock::now() - held;
      }
    }
    // read(i+1 .. i+depth-1) while i is updated.
    hint_until(i + (options.overlap_io ? options.depth : 1));
    leases.clear();
    buffers.clear();
    for (std::size_t k = 0; k < g.blocks.size(); ++k) {
      stats.bytes += aligned_size(store.describe(g.blocks[k]).size_bytes);
      leases.push_back(store.acquire(g.blocks[k], options.stage, mode_of(g, k), traffic_class::optimizer_stream));
    }
    const auto wait_start = clock::now();
    for (auto& l : leases) buffers.push_back(l.wait());
    const auto update_start = clock::now();
    stats.wait += update_start - wait_start;

    update(i, buffers);
    stats.update += clock::now() - update_start;

    // write(i): released dirty and sent home while i+1 updates.
    for (std::size_t k = 0; k < g.blocks.size(); ++k) {
      const bool wrote = mode_of(g, k) != access::read;  // an overwrite released clean would be discarded
      store.release(std::move(leases[k]), wrote ? dirty::yes : dirty::no);
      if (options.evict_after_update) store.evict(g.blocks[k], options.stage);
    }
    if (!options.overlap_io && options.evict_after_update) store.flush();
  }
  const auto flush_start = clock::now();
  if (options.evict_after_update) store.flush();
  stats.flush = clock::now() - flush_start;
  stats.total = clock::now() - start;
  return stats;
}

}  // namespace tierflow
