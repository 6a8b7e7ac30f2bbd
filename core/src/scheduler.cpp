#include "tierflow/core/scheduler.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <unordered_map>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/store.hpp"

namespace tierflow {
namespace {

using clock = std::chrono::steady_clock;

std::uint64_t key_of(const block_access& a) {
  return (std::uint64_t{a.block.value} << 8) | static_cast<std::uint64_t>(index_of(a.where));
}

}  // namespace

prefetch_scheduler::prefetch_scheduler(block_store& store, scheduler_options options)
    : store_(store), options_(options) {
  if (options_.max_lookahead == 0 || options_.min_lookahead > options_.max_lookahead)
    throw user_error("scheduler: lookahead bounds must satisfy 1 <= min_lookahead <= max_lookahead");
  if (!(options_.budget_share >= 0 && options_.budget_share <= 1))
    throw user_error("scheduler: budget_share must be in [0, 1]");
  if (!(options_.staging_share >= 0 && options_.staging_share <= 1))
    throw user_error("scheduler: staging_share must be in [0, 1]");
}

void prefetch_scheduler::set_schedule(std::vector<block_access> accesses) {
  const std::size_t blocks = store_.block_count();
  for (const auto& a : accesses) {
    if (a.block.value >= blocks)
      throw user_error("scheduler: access to unknown block " + std::to_string(a.block.value));
    if (!store_.has_tier(a.where))
      throw user_error("scheduler: access to block \"" + store_.describe(a.block).name +
                       "\" in tier " + std::string(name(a.where)) + ", which this store does not have");
  }
  schedule_ = std::move(accesses);
  compute_next_uses();
  prefetched_until_ = 0;
}

void prefetch_scheduler::compute_next_uses() {
  const std::size_t n = schedule_.size();
  // The distance from each access to the next one with the same key: an
  // access used once per iteration comes back after n. Two backward passes
  // make the distances cyclic.
  const auto distances = [&](std::vector<std::size_t>& out, auto key) {
    out.assign(n, n);
    std::unordered_map<std::uint64_t, std::size_t> later;  // key → next position seen (scanning back)
    for (std::size_t pass = 0; pass < 2; ++pass) {
      for (std::size_t i = n; i-- > 0;) {
        const std::uint64_t k = key(schedule_[i]);
        if (auto it = later.find(k); it != later.end()) {
          const std::size_t next = it->second;
          out[i] = next > i ? next - i : next + n - i;
        }
        later[k] = i;
      }
    }
  };
  distances(next_use_, key_of);
  distances(next_block_use_, [](const block_access& a) { return std::uint64_t{a.block.value}; });
}

std::size_t prefetch_scheduler::compute_lookahead() const {
  if (schedule_.empty()) return 0;
  const store_telemetry t = store_.telemetry();

  // Bytes an access loads, on average, and the tiers they go to.
  std::uint64_t bytes = 0;
  std::array<bool, tier_count> destination{};
  for (const auto& a : schedule_) {
    bytes += aligned_size(store_.describe(a.block).size_bytes);
    destination[index_of(a.where)] = true;
  }
  const double bytes_per_access = static_cast<double>(bytes) / static_cast<double>(schedule_.size());

  // The slowest measured link into a destination tier sets the load time.
  double load_seconds = 0;
  for (const auto& link : t.links) {
    const auto arrow = link.name.find("->");
    if (arrow == std::string::npos || link.busy_ns == 0 || link.bytes == 0) continue;
    const std::string to = link.name.substr(arrow + 2);
    bool into_destination = false;
    for (std::size_t k = 0; k < tier_count; ++k)
      into_destination |= destination[k] && to == name(static_cast<tier_kind>(k));
    if (!into_destination) continue;
    // busy time covers `engines` transfers at once, so bytes/busy is the link's rate.
    const double rate = static_cast<double>(link.bytes) / (static_cast<double>(link.busy_ns) * 1e-9);
    load_seconds = std::max(load_seconds, bytes_per_access / rate);
  }

  std::size_t lookahead = options_.max_lookahead;  // nothing measured yet: as far as budgets allow
  const double compute_seconds = std::chrono::duration<double>(compute_between_accesses_).count();
  if (load_seconds > 0 && compute_seconds > 0) {
    lookahead = static_cast<std::size_t>(std::ceil(load_seconds / compute_seconds)) + 1;
  }
  return std::clamp(lookahead, options_.min_lookahead, options_.max_lookahead);
}

void prefetch_scheduler::begin_iteration() {
  TF_ASSERT(!in_iteration_, "begin_iteration() twice without end_iteration()");
  in_iteration_ = true;
  departed_ = false;
  position_ = 0;
  observed_.clear();
  observed_stall_.clear();
  acquired_at_.clear();
  iteration_stall_ = {};
  // Hints made past the end of the last iteration cover this one's first accesses.
  const std::size_t n = schedule_.size();
  prefetched_until_ = prefetched_until_ > n ? prefetched_until_ - n : 0;
  staged_until_ = staged_until_ > n ? staged_until_ - n : 0;
  stats_.lookahead = compute_lookahead();
  staging_room_ = options_.staging_share > 0 ? host_room() : 0;
  last_access_end_ = {};
  if (!schedule_.empty()) prefetch_from(0);
}

std::uint64_t prefetch_scheduler::host_room() const {
  if (!store_.has_tier(tier_kind::host)) return 0;
  // The host tier's budget less what is homed there (those bytes never leave).
  std::uint64_t homed = 0;
  for (std::uint32_t i = 0; i < store_.block_count(); ++i) {
    const block_desc& d = store_.describe(block_id{i});
    if (d.home == tier_kind::host) homed += aligned_size(d.size_bytes);
  }
  const std::uint64_t budget = store_.tier_of(tier_kind::host).budget();
  return budget > homed ? static_cast<std::uint64_t>(options_.staging_share * static_cast<double>(budget - homed))
                        : 0;
}

bool prefetch_scheduler::staged_kind(const block_access& a) const {
  // Homed below the host tier, used above it, and read (an overwrite loads nothing).
  return a.mode != access::overwrite && index_of(a.where) < index_of(tier_kind::host) &&
         index_of(store_.describe(a.block).home) > index_of(tier_kind::host);
}

void prefetch_scheduler::stage_from(std::size_t position) {
  const std::size_t n = schedule_.size();
  std::uint64_t room = staging_room_;
  // Blocks seen in the window: true once staged (or found on its way), false
  // when overwritten before any read — what follows reads the new bytes, not
  // the stored ones, so they are not staged now, and a later pass, past the
  // overwrite, stages them (staged_until_ stops at the first skipped). An
  // overwrite in the host tier of a block homed below it takes its share of
  // the room too: its copy stays there until it is written back, and staging
  // past it would only have the caller's writes evict what was staged.
  std::unordered_map<std::uint64_t, bool> counted;
  std::size_t skipped = position + n;
  std::size_t j = position;
  for (; j < position + n && j <= position + options_.max_lookahead; ++j) {
    const block_access& a = schedule_[j % n];
    if (a.mode == access::overwrite) {
      if (!counted.emplace(a.block.value, false).second || a.where != tier_kind::host) continue;
      const block_desc& d = store_.describe(a.block);
      if (index_of(d.home) <= index_of(tier_kind::host)) continue;
      const std::uint64_t bytes = aligned_size(d.size_bytes);
      if (bytes > room) break;
      room -= bytes;
      continue;
    }
    if (!staged_kind(a)) continue;
    if (const auto [seen, first] = counted.emplace(a.block.value, true); !first) {
      if (!seen->second) skipped = std::min(skipped, j);
      continue;
    }
    const std::uint64_t bytes = aligned_size(store_.describe(a.block).size_bytes);
    if (bytes > room) break;  // the host tier's room bounds the window
    room -= bytes;
    // Past the device's prefetch window (those load straight to the device),
    // and not where it is already: a copy on the device is not staged back.
    if (j > position && j >= staged_until_ && j >= prefetched_until_ && !store_.present_in(a.block, a.where))
      store_.prefetch(a.block, tier_kind::host, traffic_class::prefetch);
  }
  staged_until_ = std::max(staged_until_, std::min(j, skipped));
  staging_window_ = j - position;
}

void prefetch_scheduler::prefetch_from(std::size_t position) {
  const std::size_t n = schedule_.size();
  if (n == 0 || departed_) return;
  const std::size_t end = position + stats_.lookahead + 1;  // the access itself and `lookahead` more
  // Room per tier: a share of the budget, counted over the window's distinct blocks.
  std::array<std::uint64_t, tier_count> room{};
  for (std::size_t k = 0; k < tier_count; ++k) {
    const auto kind = static_cast<tier_kind>(k);
    if (store_.has_tier(kind))
      room[k] = static_cast<std::uint64_t>(options_.budget_share *
                                           static_cast<double>(store_.tier_of(kind).budget()));
  }
  std::unordered_map<std::uint64_t, bool> counted;
  std::size_t j = position;
  for (; j < end && j < position + n; ++j) {
    const block_access& a = schedule_[j % n];
    const std::uint64_t k = key_of(a);
    if (!counted.emplace(k, true).second) continue;
    const std::uint64_t bytes = aligned_size(store_.describe(a.block).size_bytes);
    auto& left = room[index_of(a.where)];
    if (bytes > left) break;  // the budget bounds the lookahead
    left -= bytes;
    if (j >= prefetched_until_ && j > position) {
      // An overwrite replaces every byte: nothing needs loading ahead of it
      // (a prefetch would read bytes about to be discarded).
      if (a.mode != access::overwrite) store_.prefetch(a.block, a.where, traffic_class::prefetch);
      prefetched_until_ = j + 1;
    }
  }
  prefetch_window_ = j - position;
  if (staging_room_ > 0) stage_from(position);
}

lease prefetch_scheduler::acquire(block_id block, tier_kind where, access mode) {
  TF_ASSERT(in_iteration_, "acquire() outside begin_iteration()/end_iteration()");
  const auto called = clock::now();
  if (last_access_end_ != clock::time_point{}) {
    // Time the caller spent between the previous lease and this request: its compute.
    const auto compute = called - last_access_end_;
    compute_between_accesses_ = compute_between_accesses_.count() == 0
                                    ? std::chrono::duration_cast<std::chrono::nanoseconds>(compute)
                                    : (compute_between_accesses_ * 7 + compute) / 8;
  }

  const block_access wanted{block, where, mode};
  observed_.push_back(wanted);
  const bool on_schedule = !departed_ && position_ < schedule_.size() && schedule_[position_] == wanted;
  if (!on_schedule && !schedule_.empty()) departed_ = true;  // served on demand from here on
  if (on_schedule) prefetch_from(position_);

  lease l = store_.acquire(block, where, mode, traffic_class::demand);
  const bool ready = l.ready();
  const auto wait_start = clock::now();
  l.wait();
  const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - wait_start);
  const std::chrono::nanoseconds stall = ready ? std::chrono::nanoseconds{0} : waited;
  observed_stall_.push_back(stall);
  iteration_stall_ += stall;
  stats_.stall += stall;
  stats_.accesses += 1;
  stats_.stalled_accesses += ready ? 0 : 1;
  if (on_schedule) acquired_at_[key_of(wanted)] = position_++;
  last_access_end_ = clock::now();
  return l;
}

void prefetch_scheduler::release(lease&& l, dirty d) {
  const block_access done{l.block(), l.tier(), l.mode()};
  store_.release(std::move(l), d);
  if (departed_ || schedule_.empty()) return;
  const auto it = acquired_at_.find(key_of(done));
  if (it == acquired_at_.end()) return;
  const std::size_t p = it->second;
  acquired_at_.erase(it);
  const std::size_t horizon = options_.evict_distance ? options_.evict_distance : stats_.lookahead;
  // A host copy of a block homed below the host tier that the caller wrote
  // stays while the block's next use, in any tier, is within the staging
  // window: that use reads it here (staged by the write itself).
  const bool written = done.mode != access::read && d == dirty::yes;
  const bool kept = staging_room_ > 0 && written && done.where == tier_kind::host &&
                    index_of(store_.describe(done.block).home) > index_of(tier_kind::host) &&
                    next_block_use_[p] <= staging_window_;
  // A copy read in the host tier of a block homed below it (a ZeRO-3 shard on
  // its way to its gather) makes room for the next prefetches unless its next
  // use falls within the window the budget lets them cover: kept for a use
  // further away, it would only be evicted for them, or evict them, first.
  const bool read_through = !written && done.where == tier_kind::host &&
                            index_of(store_.describe(done.block).home) > index_of(tier_kind::host);
  if (!kept && (next_use_[p] > horizon || (read_through && next_use_[p] > prefetch_window_)))
    store_.evict(done.block, done.where);
  // A staged copy makes room for the next ones unless it is used again soon.
  if (staging_room_ > 0 && next_use_[p] > staging_window_ && staged_kind(done))
    store_.evict(done.block, tier_kind::host);
}

void prefetch_scheduler::end_iteration() {
  TF_ASSERT(in_iteration_, "end_iteration() without begin_iteration()");
  in_iteration_ = false;
  stats_.iterations += 1;
  stats_.last_iteration_stall = iteration_stall_;
  stats_.per_access_stall = observed_stall_;
  const bool changed = schedule_.empty() || departed_ || observed_.size() != schedule_.size();
  if (changed) {
    // An iteration with no accesses departs too: its empty order becomes the
    // schedule, so the next one prefetches nothing it will not ask for (the
    // ZeRO-3 engine's gathers read NVMe straight into their buffers, past the
    // scheduler: a stale schedule would load host copies no one reads).
    if (!schedule_.empty()) stats_.rerecords += 1;
    schedule_ = observed_;
    compute_next_uses();
    prefetched_until_ = 0;
    return;
  }
  // Start loading the next iteration's first accesses now, while the caller
  // finishes its step.
  if (!schedule_.empty()) prefetch_from(position_ == schedule_.size() ? position_ - 1 : position_);
}

}  // namespace tierflow
