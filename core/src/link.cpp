#include "tierflow/core/link.hpp"

#include <mutex>

#include "tierflow/core/assert.hpp"

namespace tierflow {

namespace {

std::uint32_t track_of(tier_kind from, tier_kind to, unsigned engine) {
  return static_cast<std::uint32_t>((index_of(from) * tier_count + index_of(to)) * 100 + engine);
}

}  // namespace

link::link(tier_kind from, tier_kind to, std::unique_ptr<mover> engine, unsigned engines,
           trace_recorder* trace, fair_queue_weights weights)
    : from_(from),
      to_(to),
      mover_(std::move(engine)),
      engines_(engines == 0 ? 1 : engines),
      trace_(trace),
      queue_(weights) {
  TF_ASSERT(mover_ != nullptr);
  {
    lock_guard lock(mutex_);
    counters_.name = name();
    counters_.engine = mover_->engine();
    counters_.engines = engines_;
  }
  threads_.reserve(engines_);
  for (unsigned i = 0; i < engines_; ++i) {
    if (trace_) trace_->name_track(trace_recorder::track_group::links, track_of(from_, to_, i),
                                   name() + " #" + std::to_string(i));
    threads_.emplace_back([this, i] { run_engine(i); });
  }
}

link::~link() {
  {
    lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

std::string link::name() const { return std::string(tierflow::name(from_)) + "->" + std::string(tierflow::name(to_)); }

void link::submit(transfer t, completion done) {
  {
    lock_guard lock(mutex_);
    TF_ASSERT(!stopping_, "a transfer was submitted to a link being destroyed");
    const traffic_class cls = t.cls;
    const std::uint64_t bytes = t.bytes;
    queue_.push(cls, bytes, job{std::move(t), std::move(done), std::chrono::steady_clock::now()});
  }
  // Every engine may be the one allowed to take it (demand vs background).
  work_cv_.notify_all();
}

link_telemetry link::telemetry() const {
  lock_guard lock(mutex_);
  link_telemetry out = counters_;
  if (running_ > 0)
    out.busy_ns += std::uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now() - busy_since_)
                                     .count());
  return out;
}

void link::run_engine(unsigned index) {
  const std::uint32_t track = track_of(from_, to_, index);
  unique_lock lock(mutex_);
  for (;;) {
    std::optional<job> next;
    traffic_class cls = traffic_class::demand;
    for (;;) {
      // With two engines or more, one is always left for demand: background
      // transfers may occupy at most engines_ - 1 of them.
      const bool background_allowed = engines_ < 2 || running_background_ + 1 < engines_;
      next = queue_.pop(background_allowed, cls);
      if (next || (stopping_ && queue_.empty())) break;
      lock.wait(work_cv_);
    }
    if (!next) return;

    const bool background = cls != traffic_class::demand;
    const auto start = std::chrono::steady_clock::now();
    if (running_++ == 0) busy_since_ = start;
    if (background) ++running_background_;
    auto& per_class = counters_.classes[index_of(cls)];
    per_class.queue_ns += std::uint64_t(
        std::chrono::duration_cast<std::chrono::nanoseconds>(start - next->queued_at).count());
    lock.unlock();

    std::exception_ptr failure;
    try {
      mover_->move(next->t);
    } catch (...) {
      failure = std::current_exception();
    }
    const auto end = std::chrono::steady_clock::now();
    if (trace_) {
      trace_->record(next->t.block_name, "transfer", trace_recorder::track_group::links, track,
                     start, end - start,
                     {{"bytes", std::to_string(next->t.bytes)},
                      {"class", std::string(tierflow::name(cls))},
                      {"link", name()},
                      {"status", failure ? "failed" : "ok"}});
    }
    lock.lock();
    if (--running_ == 0)
      counters_.busy_ns +=
          std::uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(end - busy_since_).count());
    if (background) --running_background_;
    if (failure) {
      ++counters_.failures;
    } else {
      ++counters_.transfers;
      counters_.bytes += next->t.bytes;
      ++per_class.transfers;
      per_class.bytes += next->t.bytes;
    }
    lock.unlock();
    // A background slot may have opened for another engine.
    if (background) work_cv_.notify_all();
    // The completion runs without the link's lock: it takes the store's. The
    // error is moved in so this thread keeps no reference to it afterwards.
    next->done(std::move(failure));
    lock.lock();
  }
}

}  // namespace tierflow
