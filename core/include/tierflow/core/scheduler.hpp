// Schedule-driven prefetch: the stall-free scheduler over a block_store.
//
// An iteration is an ordered list of block accesses (forward layer 0..L-1,
// backward L-1..0, then the optimizer's sub-groups). The list is either given
// (set_schedule) or recorded from the first iteration (trace mode) and
// re-recorded whenever an iteration's order departs from it. At each access
// the scheduler
//   1. hints the store to prefetch the next accesses within the lookahead,
//   2. waits for this access's lease (the wait is the stall, measured),
//   3. on release, evicts the copy when its next use lies beyond the horizon
//      (and a host copy, read there, of a block homed on NVMe when its next
//      use lies beyond what the budget lets the prefetches cover: a longer
//      reuse distance cannot be held, and holding it would evict them).
//
// Staging (staging_share > 0) is a second, longer window for blocks homed
// below the host tier (on NVMe) and used above it (on the device): their
// bytes are loaded into the host tier ahead of use, within a share of the
// room the host tier has beside the blocks homed there, so that an access
// waits only for the hop from host memory — even with budget_share 0, when
// nothing is prefetched into the device. A staged copy is evicted after its
// use unless it is used again within the staging window. A block overwritten
// before its next use is not staged (its stored bytes would be discarded);
// and a host copy written by the caller (an optimizer's new values) stays in
// the host tier when the block's next use, in any tier, lies within the
// staging window, so that use starts from host memory rather than waiting
// for the write-back and a read of the same bytes from NVMe.
//
// The lookahead is computed, not configured: far enough that the link can
// load the upcoming blocks in the time compute spends on the accesses before
// them (measured bandwidth of each link vs measured time between accesses),
// and never more than the destination tier's budget can hold beside the
// blocks in use. Worked example: 64 MiB blocks, a host←nvme link measured at
// 2 GiB/s (32 ms per block) and 10 ms of compute per access need a lookahead
// of ceil(32/10) = 4 accesses (+1 margin); with a 256 MiB host budget only
// 256/64 - 1 = 3 fit beside the block in use, so the lookahead is 3 and the
// remaining stall is what the hardware cannot hide.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "tierflow/core/block.hpp"
#include "tierflow/core/lease.hpp"

namespace tierflow {

class block_store;

// One access of an iteration: a block's copy in a tier, read or written.
struct block_access {
  block_id block;
  tier_kind where = tier_kind::host;
  access mode = access::read;
  friend bool operator==(const block_access&, const block_access&) = default;
};

struct scheduler_options {
  std::size_t max_lookahead = 64;  // accesses ahead, at most
  std::size_t min_lookahead = 1;   // at least this many, budget permitting
  // Share of a tier's budget prefetches may fill (the rest is for the blocks
  // in use and for write-backs in flight); 0 turns prefetch off, every
  // access then served on demand (DeepSpeed's stage3_prefetch_bucket_size 0).
  double budget_share = 0.75;
  // Evict a block after its use when its next use is further than this many
  // accesses away (0: the current lookahead).
  std::size_t evict_distance = 0;
  // Share of the host tier's room beside the blocks homed there that stages
  // blocks homed below it and used above it (see above); 0 turns staging off.
  double staging_share = 0;
};

struct scheduler_stats {
  std::uint64_t iterations = 0;
  std::uint64_t rerecords = 0;        // iterations whose order departed from the schedule
  std::uint64_t accesses = 0;
  std::uint64_t stalled_accesses = 0;  // accesses whose lease was not ready
  std::chrono::nanoseconds stall{0};   // total time waiting for leases
  std::chrono::nanoseconds last_iteration_stall{0};
  std::size_t lookahead = 0;           // the current lookahead, in accesses
  std::vector<std::chrono::nanoseconds> per_access_stall;  // the last finished iteration's
};

// Driven by one thread (the trainer's step loop); not thread-safe itself.
class prefetch_scheduler {
 public:
  // `store` must outlive the scheduler. Without a schedule the first
  // iteration is recorded (no prefetch during it).
  explicit prefetch_scheduler(block_store& store, scheduler_options options = {});

  // Gives the iteration's accesses explicitly. Throws user_error for an
  // unknown block or tier.
  void set_schedule(std::vector<block_access> accesses);
  const std::vector<block_access>& schedule() const noexcept { return schedule_; }

  // Starts an iteration: recomputes the lookahead from the store's telemetry
  // and prefetches the first accesses.
  void begin_iteration();
  // The next access: prefetches ahead, then waits for and returns the lease
  // (granted). Throws what the load threw, naming the block, and, in a
  // lease_holder::waiting_thread store, EDEADLK when only the release of a
  // lease the caller holds could make room for it. Prefetch hints never
  // throw: one that finds no room is not issued. An access that
  // departs from the schedule is served on demand and marks the iteration
  // for re-recording.
  lease acquire(block_id block, tier_kind where, access mode = access::read);
  // Ends a lease taken by acquire(); evicts the copy when its next use is
  // beyond the horizon.
  void release(lease&& l, dirty d);
  // Ends the iteration; adopts this iteration's order when it departed from
  // the schedule (or was the recording one) — an empty order too, when the
  // iteration made no access: nothing is then prefetched for the next.
  void end_iteration();

  const scheduler_stats& stats() const noexcept { return stats_; }

 private:
  void compute_next_uses();
  void prefetch_from(std::size_t position);
  void stage_from(std::size_t position);
  bool staged_kind(const block_access& a) const;
  std::uint64_t host_room() const;
  std::size_t compute_lookahead() const;

  block_store& store_;
  scheduler_options options_;
  std::vector<block_access> schedule_;
  std::vector<std::size_t> next_use_;  // distance to the same access's next use (cyclic)
  std::vector<std::size_t> next_block_use_;  // distance to the block's next access, in any tier (cyclic)
  std::vector<block_access> observed_;  // this iteration's accesses
  std::vector<std::chrono::nanoseconds> observed_stall_;
  std::unordered_map<std::uint64_t, std::size_t> acquired_at_;  // leased access → its position
  std::size_t position_ = 0;            // index of the next access in the schedule
  std::size_t prefetched_until_ = 0;    // accesses [position_, prefetched_until_) were hinted
  std::size_t staged_until_ = 0;        // accesses [position_, staged_until_) were staged
  std::size_t staging_window_ = 0;      // accesses the last staging pass covered
  std::size_t prefetch_window_ = 0;     // accesses the last prefetch pass covered (within its budgets)
  std::uint64_t staging_room_ = 0;      // the host tier's room for staging, this iteration
  bool departed_ = false;
  bool in_iteration_ = false;
  std::chrono::steady_clock::time_point last_access_end_{};
  std::chrono::nanoseconds compute_between_accesses_{0};  // running average
  std::chrono::nanoseconds iteration_stall_{0};
  scheduler_stats stats_;
};

}  // namespace tierflow
