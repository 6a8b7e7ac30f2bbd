#include "tierflow/core/telemetry.hpp"

#include <atomic>
#include <nlohmann/json.hpp>

namespace tierflow {

using nlohmann::json;

std::string to_json(const store_telemetry& t) {
  json tiers = json::array();
  for (const tier_telemetry& x : t.tiers) {
    tiers.push_back({{"kind", name(x.kind)},
                     {"name", x.name},
                     {"budget_bytes", x.budget},
                     {"used_bytes", x.used},
                     {"high_water_bytes", x.high_water},
                     {"loads", x.loads},
                     {"evictions", x.evictions},
                     {"details", x.details}});
  }
  json links = json::array();
  for (const link_telemetry& l : t.links) {
    json classes = json::object();
    for (std::size_t c = 0; c < traffic_class_count; ++c) {
      classes[std::string(name(static_cast<traffic_class>(c)))] = {
          {"transfers", l.classes[c].transfers},
          {"bytes", l.classes[c].bytes},
          {"queue_seconds", double(l.classes[c].queue_ns) * 1e-9}};
    }
    links.push_back({{"name", l.name},
                     {"engine", l.engine},
                     {"engines", l.engines},
                     {"transfers", l.transfers},
                     {"bytes", l.bytes},
                     {"failures", l.failures},
                     {"busy_seconds", double(l.busy_ns) * 1e-9},
                     {"classes", classes}});
  }
  json out = {{"elapsed_seconds", t.elapsed_seconds},
              {"blocks", t.blocks},
              {"acquires", t.acquires},
              {"ready_at_wait", t.ready_at_wait},
              {"stalls", t.stalls},
              {"stall_seconds", double(t.stall_ns) * 1e-9},
              {"prefetches", t.prefetches},
              {"prefetches_dropped", t.prefetches_dropped},
              {"writebacks", t.writebacks},
              {"dirty_releases", t.dirty_releases},
              {"failed_transfers", t.failed_transfers},
              {"trace_events_dropped", t.trace_events_dropped},
              {"tiers", tiers},
              {"links", links}};
  return out.dump(2);
}

trace_recorder::trace_recorder(std::size_t capacity) : capacity_(capacity), origin_(clock::now()) {}

void trace_recorder::record(std::string name, std::string category, track_group group,
                            std::uint32_t track, clock::time_point start, clock::duration duration,
                            std::map<std::string, std::string> args) {
  const auto start_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(start - origin_).count();
  const auto duration_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(duration).count();
  lock_guard lock(mutex_);
  if (events_.size() >= capacity_) {
    ++dropped_;
    return;
  }
  events_.push_back(event{std::move(name), std::move(category), group, track, start_ns,
                          duration_ns, std::move(args)});
}

void trace_recorder::name_track(track_group group, std::uint32_t track, std::string name) {
  lock_guard lock(mutex_);
  track_names_[{static_cast<std::uint32_t>(group), track}] = std::move(name);
}

void trace_recorder::write_json(std::ostream& out) const {
  json events = json::array();
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", 1}, {"tid", 0},
                    {"args", {{"name", "links"}}}});
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", 2}, {"tid", 0},
                    {"args", {{"name", "waits (stalls)"}}}});
  lock_guard lock(mutex_);
  for (const auto& [key, label] : track_names_) {
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", key.first}, {"tid", key.second},
                      {"args", {{"name", label}}}});
  }
  for (const event& e : events_) {
    // trace_event timestamps are microseconds (fractions allowed).
    events.push_back({{"ph", "X"},
                      {"name", e.name},
                      {"cat", e.category},
                      {"pid", static_cast<std::uint32_t>(e.group)},
                      {"tid", e.track},
                      {"ts", double(e.start_ns) / 1000.0},
                      {"dur", double(e.duration_ns) / 1000.0},
                      {"args", e.args}});
  }
  json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  out << doc.dump() << '\n';
}

std::uint64_t trace_recorder::dropped() const {
  lock_guard lock(mutex_);
  return dropped_;
}

std::size_t trace_recorder::size() const {
  lock_guard lock(mutex_);
  return events_.size();
}

std::uint32_t trace_recorder::thread_track() {
  static std::atomic<std::uint32_t> next{1};
  // relaxed: only uniqueness matters, not ordering with other memory.
  thread_local const std::uint32_t mine = next.fetch_add(1, std::memory_order_relaxed);
  return mine;
}

}  // namespace tierflow
