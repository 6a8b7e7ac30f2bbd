// The pipelined optimizer step over state that lives on the host or on NVMe:
// sub-groups streamed read(i+1) ‖ update(i) ‖ write(i-1).
//
// Each sub-group is a few blocks (master parameters, moments, gradient,
// parameter copy...). For sub-group i the stream hints the store to load the
// next `depth - 1` sub-groups into the host tier (traffic class
// optimizer_stream), takes write leases on i's blocks, runs the caller's
// update on them (the CPU optimizer; core knows none), releases them dirty and
// asks the store to evict them, which writes them back home while the next
// sub-group computes. The host tier's budget bounds the pinned memory used:
// at most `depth` sub-groups plus the write-backs in flight.
//
// This is ZeRO-Infinity's pipelined optimizer swapper, on the store: the
// read, the update and the write of neighbouring sub-groups overlap, and the
// store's fair queue keeps the stream behind any demand fetch.
//
// A stream that runs in the background of training (ZenFlow's CPU step,
// which has a whole update window to finish in) may be paced: spread over a
// span of time rather than run in one burst, so that the storage it shares
// with the training step's own reads is never taken from them all at once.
// The store's fair queue cannot do that when the two streams belong to
// different stores.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "tierflow/core/block.hpp"
#include "tierflow/core/thread_annotations.hpp"

namespace tierflow {

class block_store;

// The pace of one stream: sub-group i starts no earlier than `spread_over` ×
// (the bytes of the sub-groups before it) ÷ (the bytes of all of them) after
// the stream started, so the stream ends a little after `spread_over` (its
// last sub-group's work) when nothing else holds it back. hurry() — from any
// thread, at any time — ends the pacing: the stream goes on at full speed,
// and a stream started later with this pace is not paced until reset().
// Zero (the default) paces nothing. Thread-safe.
class stream_pace {
 public:
  using clock = std::chrono::steady_clock;

  explicit stream_pace(std::chrono::nanoseconds spread_over = {}) : spread_over_(spread_over) {}
  stream_pace(const stream_pace&) = delete;
  stream_pace& operator=(const stream_pace&) = delete;

  // A new span for the next stream, unhurried.
  void reset(std::chrono::nanoseconds spread_over) TF_EXCLUDES(mutex_);
  std::chrono::nanoseconds spread_over() const TF_EXCLUDES(mutex_);
  // Someone waits for the stream: it stops pacing (wakes it if it waits).
  void hurry() TF_EXCLUDES(mutex_);
  bool hurried() const TF_EXCLUDES(mutex_);
  // Blocks until `deadline`, or until hurry() is called; returns at once if
  // it was. What the stream calls between sub-groups.
  void wait_until(clock::time_point deadline) TF_EXCLUDES(mutex_);

 private:
  mutable mutex mutex_;
  std::condition_variable cv_;  // waited on under mutex_ (unique_lock::wait_until)
  std::chrono::nanoseconds spread_over_ TF_GUARDED_BY(mutex_);
  bool hurried_ TF_GUARDED_BY(mutex_) = false;
};

// One sub-group: its blocks, and how the update uses each of them:
// access::read (read only, released clean), access::write (read and written,
// released dirty) or access::overwrite (every byte written without being read:
// the block is neither prefetched nor loaded, and is released dirty).
struct sub_group {
  std::vector<block_id> blocks;
  std::vector<access> modes;  // one per block; empty: all access::write
};

// The update of sub-group `index`: `buffers[k]` is the host copy of
// `blocks[k]`, leased for the call. Runs on the calling thread.
using sub_group_update = std::function<void(std::size_t index, std::span<const std::span<std::byte>> buffers)>;

struct optimizer_stream_options {
  std::size_t depth = 3;  // sub-groups resident at once: the one updating and depth-1 loading
  tier_kind stage = tier_kind::host;  // where the update runs
  // Evict written blocks after the update (the state goes home: NVMe). Off
  // when the state lives in the stage tier already.
  bool evict_after_update = true;
  // false: no overlap at all — each sub-group is read, updated and written
  // back before the next is touched (the non-pipelined swapper, for
  // comparison). depth is then 1.
  bool overlap_io = true;
  // Spreads the stream over time (stream_pace); null or a zero span: as
  // fast as it goes. Must outlive the stream.
  stream_pace* pace = nullptr;
};

struct optimizer_stream_stats {
  std::chrono::nanoseconds total{0};
  std::chrono::nanoseconds update{0};  // time in the caller's update
  std::chrono::nanoseconds wait{0};    // time waiting for sub-groups to arrive
  std::chrono::nanoseconds flush{0};   // time waiting for the last write-backs
  std::chrono::nanoseconds paced{0};   // time held back by the pace (options.pace)
  std::uint64_t bytes = 0;             // bytes of the sub-groups' blocks
};

// Runs one optimizer step over `groups` in order. Throws what a load, a
// write-back or the update threw (naming the block for I/O); state already
// written back stays valid, and the failing sub-group's blocks keep their
// previous contents unless the update itself had run.
optimizer_stream_stats run_optimizer_stream(block_store& store, std::span<const sub_group> groups,
                                            const sub_group_update& update,
                                            const optimizer_stream_options& options = {});

}  // namespace tierflow
