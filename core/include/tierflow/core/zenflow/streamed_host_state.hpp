// ZenFlow's host state on NVMe: each matrix's fp32 master values and
// optimizer state are one block in a store whose home is NVMe, streamed
// through the host tier a weight at a time as the engine walks them (the CPU
// step, a hand-over, a checkpoint): the next weight loads while this one is
// worked on and the last one is written back (core/streamed_state.hpp, a
// weight one sub-group). Host memory then holds a few weights' state, not
// the model's: the stage tier needs room for the largest weight's block to
// work at all, and for `depth` of them to overlap.
//
// One block per weight, not one per buffer: a pass holds a single lease, so
// the copies it waits on are all evictable, and a stage tier of the largest
// block's size always makes room for it. With a lease per buffer the
// buffers already granted could split the free room into pieces too small
// for the last one, and the pass would wait for ever.
//
// Only matrices have blocks: a 1-D weight is the device's from the start and
// never crosses (engine.hpp), so the engine never asks for it.
//
//   streamed_host_state host(store, weights, 2, initial_masters);
//   zenflow::engine eng(cfg, weights, device, host, rule);
//
// A load or write-back that fails throws from for_each() (tierflow::error
// naming the block and the file): in the CPU step, the engine rethrows it at
// the next step(). What reached NVMe before stays valid.
//
// Threads: for_each() may be called from any thread, one pass at a time (a
// mutex orders them; the engine never overlaps two).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <vector>

#include "tierflow/core/block.hpp"
#include "tierflow/core/optimizer_stream.hpp"
#include "tierflow/core/streamed_state.hpp"
#include "tierflow/core/thread_annotations.hpp"
#include "tierflow/core/zenflow/engine.hpp"

namespace tierflow {
class block_store;
}

namespace tierflow::zenflow {

struct streamed_host_options {
  tier_kind home = tier_kind::nvme;   // where the state lives
  tier_kind stage = tier_kind::host;  // where passes lease it
  std::size_t depth = 2;              // weights resident at once: the one worked on and the next loading
};

class streamed_host_state final : public host_state {
 public:
  // The stage-tier bytes of one weight's block: its master and `state_count`
  // states, rounded up to a page.
  static std::uint64_t weight_bytes(const weight_shape& w, std::size_t state_count);
  // The stage-tier bytes a pass needs to make progress: the largest matrix's
  // buffers (0 without a matrix).
  static std::uint64_t minimum_stage_bytes(std::span<const weight_shape> weights, std::size_t state_count);

  // Creates every matrix's blocks at home in `store` (which must outlive this
  // object) and writes its initial master values `initial[w]` (elements()
  // fp32 values; ignored for a 1-D weight, which may be empty), its state
  // zero, in one pass. Throws user_error when the store lacks a tier, when
  // `state_count` is not 1 or 2, for an initial value of the wrong size, or
  // when the stage tier's budget cannot hold the largest matrix's buffers
  // (naming it and the bytes it needs); what create_block or the pass throws
  // (ENOSPC naming the file).
  streamed_host_state(block_store& store, const std::vector<weight_shape>& weights, std::size_t state_count,
                      std::span<const std::span<const float>> initial, streamed_host_options options = {});
  streamed_host_state(const streamed_host_state&) = delete;
  streamed_host_state& operator=(const streamed_host_state&) = delete;

  // Streams the buffers of `weights` (matrices, in that order) through the
  // stage tier, calling fn for each on the calling thread, and returns once
  // everything is home.
  void for_each(std::span<const std::size_t> weights,
                const std::function<void(std::size_t, const host_buffers&)>& fn) override;
  // The same, the stream spread over time by `pace`.
  void for_each_paced(std::span<const std::size_t> weights,
                      const std::function<void(std::size_t, const host_buffers&)>& fn, stream_pace& pace) override;

  // The bytes of every matrix's blocks at home, and of the largest one's
  // buffers (a pass's minimum in the stage tier).
  std::uint64_t home_bytes() const TF_EXCLUDES(mutex_);
  std::uint64_t largest_weight_bytes() const noexcept { return largest_; }
  // Summed over every pass so far: time in the engine's work, waiting for
  // loads and for the last write-backs, held back by a pace, and bytes
  // streamed.
  optimizer_stream_stats totals() const TF_EXCLUDES(mutex_);

 private:
  void pass(std::span<const std::size_t> weights, bool fill,
            const std::function<void(std::size_t, const host_buffers&)>& fn, stream_pace* pace = nullptr)
      TF_REQUIRES(mutex_);

  std::size_t state_count_;
  std::vector<std::size_t> tensor_;  // per weight, its tensor in state_ (npos: a 1-D weight)
  std::uint64_t largest_ = 0;
  mutable mutex mutex_;
  streamed_state state_ TF_GUARDED_BY(mutex_);
  optimizer_stream_stats totals_ TF_GUARDED_BY(mutex_);
};

}  // namespace tierflow::zenflow
