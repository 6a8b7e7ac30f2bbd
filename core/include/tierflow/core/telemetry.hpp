// What the store measures, and the trace of every transfer and every wait.
//
// The snapshot is plain data (to_json() renders it); the trace is Chrome's
// trace_event JSON, which ui.perfetto.dev and chrome://tracing load as is.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "tierflow/core/block.hpp"
#include "tierflow/core/thread_annotations.hpp"

namespace tierflow {

struct class_counters {
  std::uint64_t transfers = 0;
  std::uint64_t bytes = 0;
  std::uint64_t queue_ns = 0;  // time transfers of this class waited in the queue
};

struct link_telemetry {
  std::string name;    // "host->nvme"
  std::string engine;  // the mover: "memcpy", "cuda copy engine (H2D stream)", "io_uring", ...
  unsigned engines = 0;  // transfers it runs at once
  std::uint64_t transfers = 0;
  std::uint64_t bytes = 0;
  std::uint64_t failures = 0;
  std::uint64_t busy_ns = 0;  // time with at least one transfer running
  std::array<class_counters, traffic_class_count> classes{};
};

struct tier_telemetry {
  tier_kind kind = tier_kind::host;
  std::string name;
  std::uint64_t budget = 0;
  std::uint64_t used = 0;
  std::uint64_t high_water = 0;  // never above budget (asserted)
  std::uint64_t loads = 0;       // copies made in this tier
  std::uint64_t evictions = 0;   // copies dropped from this tier to make room or on a hint
  std::map<std::string, std::string> details;
};

struct store_telemetry {
  double elapsed_seconds = 0;  // since the store was made
  std::uint64_t blocks = 0;
  std::uint64_t acquires = 0;
  std::uint64_t ready_at_wait = 0;  // leases already granted when wait() was called
  std::uint64_t stalls = 0;         // waits that blocked
  std::uint64_t stall_ns = 0;       // total time blocked in wait()
  std::uint64_t prefetches = 0;
  std::uint64_t prefetches_dropped = 0;  // no room without evicting dirty or leased copies
  std::uint64_t writebacks = 0;
  std::uint64_t dirty_releases = 0;
  std::uint64_t failed_transfers = 0;
  std::uint64_t trace_events_dropped = 0;
  std::vector<tier_telemetry> tiers;
  std::vector<link_telemetry> links;
};

// The snapshot as one JSON object (stable keys; bytes as integers).
std::string to_json(const store_telemetry& t);

// Collects trace events from any thread; bounded, dropping (and counting)
// events past its capacity so a long run cannot exhaust memory.
class trace_recorder {
 public:
  using clock = std::chrono::steady_clock;

  explicit trace_recorder(std::size_t capacity = std::size_t{1} << 20);

  // Track groups in the trace: one "process" per kind of activity.
  enum class track_group : std::uint32_t { links = 1, waits = 2 };

  // One complete event ("ph":"X") on track (`group`, `track`), from `start`
  // lasting `duration`, with `args` rendered into the event's args object.
  void record(std::string name, std::string category, track_group group, std::uint32_t track,
              clock::time_point start, clock::duration duration,
              std::map<std::string, std::string> args) TF_EXCLUDES(mutex_);
  // Names a track, shown by the trace viewer instead of its number.
  void name_track(track_group group, std::uint32_t track, std::string name) TF_EXCLUDES(mutex_);

  // The Chrome trace_event JSON of everything recorded so far.
  void write_json(std::ostream& out) const TF_EXCLUDES(mutex_);
  std::uint64_t dropped() const TF_EXCLUDES(mutex_);
  std::size_t size() const TF_EXCLUDES(mutex_);

  // A small number naming the calling thread, for wait tracks.
  static std::uint32_t thread_track();

 private:
  struct event {
    std::string name;
    std::string category;
    track_group group;
    std::uint32_t track;
    std::int64_t start_ns;
    std::int64_t duration_ns;
    std::map<std::string, std::string> args;
  };

  const std::size_t capacity_;
  const clock::time_point origin_;
  mutable mutex mutex_;
  std::vector<event> events_ TF_GUARDED_BY(mutex_);
  std::map<std::pair<std::uint32_t, std::uint32_t>, std::string> track_names_ TF_GUARDED_BY(mutex_);
  std::uint64_t dropped_ TF_GUARDED_BY(mutex_) = 0;
};

}  // namespace tierflow
