// Links: the path between two tiers, with its engine (a mover), its engines'
// threads and the fair queue of traffic classes in front of them.
//
// A mover is the control-plane object that knows how to copy bytes between
// two kinds of storage (memcpy, CUDA copy engines, io_uring, a staged path);
// tiers/ implements them. core/ owns the queueing, the threads and the
// measurements, so every link behaves alike.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tierflow/core/block.hpp"
#include "tierflow/core/fair_queue.hpp"
#include "tierflow/core/telemetry.hpp"
#include "tierflow/core/thread_annotations.hpp"
#include "tierflow/core/tier.hpp"

namespace tierflow {

// One copy of one block's bytes from one tier to another. Carries the block's
// identity so any failure can name it.
struct transfer {
  block_id block;
  std::string block_name;
  tier_kind from = tier_kind::host;
  tier_kind to = tier_kind::host;
  tier_allocation source;
  tier_allocation destination;
  std::uint64_t bytes = 0;  // a multiple of block_alignment, <= both allocations' sizes
  traffic_class cls = traffic_class::demand;
};

// Copies bytes for one link. move() runs on the link's engine threads, up to
// `engines` at once, and returns when the bytes are at the destination (for a
// CUDA copy: when its event has completed). It throws tierflow::error, whose
// context names the block, when the copy fails.
class mover {
 public:
  virtual ~mover() = default;
  mover() = default;
  mover(const mover&) = delete;
  mover& operator=(const mover&) = delete;

  virtual void move(const transfer& t) = 0;
  // What does the copying: "memcpy", "cuda copy engine (H2D stream)", ...
  virtual std::string engine() const = 0;
};

// One direction between two tiers. Thread-safe.
class link {
 public:
  // Called on an engine thread when a transfer ends: with nullptr on success,
  // with the mover's exception on failure. Must not throw.
  using completion = std::function<void(std::exception_ptr)>;

  // `engines` threads run transfers (at least 1). With 2 or more, background
  // classes may occupy at most engines - 1 of them: one is always free for
  // demand. `trace` (may be null) receives one event per transfer.
  link(tier_kind from, tier_kind to, std::unique_ptr<mover> mover, unsigned engines,
       trace_recorder* trace, fair_queue_weights weights = {});
  // Runs what is queued to completion, then joins the engine threads.
  ~link();
  link(const link&) = delete;
  link& operator=(const link&) = delete;

  // Queues `t` in its class; `done` is called once it ends.
  void submit(transfer t, completion done) TF_EXCLUDES(mutex_);

  tier_kind from() const noexcept { return from_; }
  tier_kind to() const noexcept { return to_; }
  std::string name() const;  // "host->nvme"
  link_telemetry telemetry() const TF_EXCLUDES(mutex_);

 private:
  struct job {
    transfer t;
    completion done;
    std::chrono::steady_clock::time_point queued_at;
  };

  void run_engine(unsigned index) TF_EXCLUDES(mutex_);

  const tier_kind from_;
  const tier_kind to_;
  const std::unique_ptr<mover> mover_;
  const unsigned engines_;
  trace_recorder* const trace_;

  mutable mutex mutex_;
  std::condition_variable work_cv_;  // waited on under mutex_ (unique_lock::wait)
  fair_queue<job> queue_ TF_GUARDED_BY(mutex_);
  bool stopping_ TF_GUARDED_BY(mutex_) = false;
  unsigned running_ TF_GUARDED_BY(mutex_) = 0;
  unsigned running_background_ TF_GUARDED_BY(mutex_) = 0;
  std::chrono::steady_clock::time_point busy_since_ TF_GUARDED_BY(mutex_);
  link_telemetry counters_ TF_GUARDED_BY(mutex_);
  std::vector<std::thread> threads_;
};

}  // namespace tierflow
