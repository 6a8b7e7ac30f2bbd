// The tiered block store: where every block's copies are, and the moves
// between tiers that acquire, prefetch, evict and flush cause.
//
// The store owns the tiers and the links handed to it (tiers/ makes them; see
// tiers/store_factory.hpp for the usual assembly). All bookkeeping is under
// one lock, held only for bookkeeping: bytes move on the links' engine
// threads, and a transfer's completion takes the lock to update the copies'
// states and grant whatever waited on them.
//
// Coherence, in one paragraph: the home tier of a block always holds storage
// for it. At most one lease writes a block at a time, and only while no other
// lease and no transfer touches it. Releasing a write lease dirty makes that
// copy the only holder of the newest bytes: other copies are dropped and the
// home copy becomes absent (stale) until a write-back brings them home; a copy
// loaded meanwhile from a dirty copy is dirty too. Evicting a dirty copy first
// writes it back.
//
// Failures, in one paragraph: a failed load leaves its copy absent and fails
// the leases waiting for it; the next acquire tries again. A failed write-back
// is tried again at once, up to store_options::writeback_attempts times in
// all; when every attempt failed, the dirty copy stays where it is (the
// newest bytes, readable, counted in its tier's budget), the eviction that
// asked for the write-back is dropped, and the error goes to the leases
// waiting for the home copy and to the next flush() or close(); a lease that
// needs room only such copies hold gets it too, rather than waiting for
// ever. Nothing retries the write-back on its own: a later request does
// (flush, evict, an acquire of the home copy, or a lease asked for after the
// failure that needs the room), so a broken disk costs a bounded number of
// writes per request, never a loop.
//
// Who holds the leases, in one paragraph: by default any thread may release
// a lease while another waits, so a request for room that only leases hold
// waits for a release. A store made with lease_holder::waiting_thread is
// promised that every lease is held by the thread that waits on it (one
// single-threaded holder, such as a training loop): while that thread waits,
// no lease will end, so a request that nothing but a release could make room
// for fails at once with EDEADLK instead of waiting for ever (see
// lease_holder).
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tierflow/core/block.hpp"
#include "tierflow/core/lease.hpp"
#include "tierflow/core/link.hpp"
#include "tierflow/core/telemetry.hpp"
#include "tierflow/core/thread_annotations.hpp"
#include "tierflow/core/tier.hpp"

namespace tierflow {

// A link to build: one direction between two tiers and its mover.
struct link_spec {
  tier_kind from = tier_kind::host;
  tier_kind to = tier_kind::host;
  std::unique_ptr<mover> engine;
  unsigned engines = 2;  // transfers in flight at once on this link
};

// Who ends a store's leases, which decides what a waited-for request does when
// only the end of a lease could make room for it.
enum class lease_holder : unsigned char {
  // Any thread may release a lease while another thread waits on one: such a
  // request waits, and the release grants it.
  any_thread,
  // Every lease (granted or asked for) is held by the thread that waits on it:
  // while it waits, none of its leases ends. So once a lease being waited on
  // needs room in a tier that nothing else will free — no transfer in flight
  // touches the tier's copies, no copy there can be dropped or written back,
  // only leased copies, home copies and dirty copies whose write-back failed
  // occupy it — or that the copies only a release frees leave too little of
  // the budget for, wait() throws tierflow::error with EDEADLK naming the
  // block, its size, the tier, the budget, the bytes in use, the largest free
  // piece (where the tier can tell) and the blocks whose leases hold the
  // room. A request that a write-back, a load or an eviction will satisfy
  // waits as usual, and one not waited on yet is never failed: the holder may
  // release a lease between acquire() and wait(). Hints (prefetch) never fail.
  waiting_thread,
};

struct store_options {
  bool trace = true;                              // record trace events
  std::size_t trace_capacity = std::size_t{1} << 20;  // events kept before dropping
  fair_queue_weights weights{};
  // Tries of one write-back before its error is reported (at least 1). The io
  // engines already retry EINTR/EAGAIN and finish short transfers, so what
  // reaches the store is an error the device returned: a second and third
  // write ride out a one-off failure at the cost of two writes of the block,
  // while a failure that persists is reported within milliseconds.
  unsigned writeback_attempts = 3;
  lease_holder holder = lease_holder::any_thread;
};

class block_store {
 public:
  // Takes the tiers (at most one per kind, at least one) and the links between
  // them. A load from tier A to tier B needs a link A->B; a store with a tier
  // but no link to or from it can only use it as a home. Throws user_error for
  // duplicate tiers, a link naming a missing tier, or writeback_attempts 0.
  block_store(std::vector<std::unique_ptr<tier>> tiers, std::vector<link_spec> links,
              store_options options = {});
  // Waits for transfers in flight (each write-back ends within its bounded
  // attempts), then frees every copy; dirty copies not flushed are discarded
  // with the rest. An error no flush() or close() reported is printed to
  // stderr. Every lease must have ended (granted ones are asserted), and no
  // lease object may outlive the store.
  ~block_store();
  block_store(const block_store&) = delete;
  block_store& operator=(const block_store&) = delete;

  // Registers a block and allocates its storage in its home tier; the bytes
  // are unspecified until written (acquire it with access::write). Throws
  // user_error for a bad or duplicate description or a missing home tier,
  // budget_exceeded when the home tier cannot hold it.
  block_id create_block(block_desc desc) TF_EXCLUDES(mutex_);

  std::size_t block_count() const TF_EXCLUDES(mutex_);
  // The description of `id` (valid for the store's life).
  const block_desc& describe(block_id id) const TF_EXCLUDES(mutex_);
  std::optional<block_id> find(std::string_view name) const TF_EXCLUDES(mutex_);
  // Whether `id` has a copy in `where` that holds, or is loading, its newest
  // bytes. A snapshot: for hints (the scheduler's), not for correctness.
  bool present_in(block_id id, tier_kind where) const TF_EXCLUDES(mutex_);
  bool has_tier(tier_kind kind) const noexcept { return tiers_[index_of(kind)] != nullptr; }
  const tier& tier_of(tier_kind kind) const;

  // Asks for `id`'s copy in `where` with `mode`; returns at once with a lease
  // to wait() on. Loads the copy if absent (from the nearest tier holding the
  // data, with class `cls`), evicting unleased copies least recently used
  // first when the tier is full — a dirty one is written back first. If the
  // tier's budget is held by leases the lease waits for their release.
  // Throws budget_exceeded when the block can never fit in `where`, user_error
  // for an unknown block or tier, or when `where` is a file tier and mode is
  // write. In a lease_holder::waiting_thread store, the lease's wait() throws
  // EDEADLK when only a release of the waiting thread's leases could make room.
  lease acquire(block_id id, tier_kind where, access mode = access::read,
                traffic_class cls = traffic_class::demand) TF_EXCLUDES(mutex_);
  // Ends a lease (granted or not). dirty::yes (write leases only, asserted)
  // marks the copy as the newest contents. The lease is empty afterwards.
  void release(lease&& l, dirty d) TF_EXCLUDES(mutex_);
  // Copies the bytes of `l`'s copy into `into`, memory of the caller's —
  // a ZeRO-3 shard read from NVMe straight into its slot of a gather
  // buffer, with no copy in the host tier — over the link from l's tier to
  // the host tier, in class `cls` (counted in that link's telemetry). `l`
  // must be granted, and held until `done` has run. `into` must be CPU
  // memory of at least the block's aligned size, starting on a
  // block_alignment boundary (what O_DIRECT reads need). Returns at once;
  // `done` runs on an engine thread: with nullptr once the bytes are there,
  // or with the error naming the block. Throws user_error for a lease not
  // granted or of another store, a copy in the host tier itself (read its
  // bytes), no such link, or `into` too small or misaligned.
  void copy_out(const lease& l, std::span<std::byte> into, traffic_class cls, link::completion done)
      TF_EXCLUDES(mutex_);
  // copy_out of a part: the block's bytes from `offset` on, `into.size()` of
  // them — a chunk of a shard, so a gather can start on it before the rest
  // is read. `offset` and `into.size()` are multiples of block_alignment,
  // within the block's aligned size. Throws user_error as copy_out does, for
  // a part past the block or misaligned, and for a part of a copy in a tier
  // that checks whole blocks against their checksums (NVMe with checksums
  // on: the part could not be checked, so it is not read unchecked).
  void copy_out(const lease& l, std::uint64_t offset, std::span<std::byte> into, traffic_class cls,
                link::completion done) TF_EXCLUDES(mutex_);

  // Hint: start loading `id` into `where` if it is absent and there is room
  // without evicting dirty or leased copies; otherwise the hint is dropped
  // (counted in telemetry). Never blocks, never throws for lack of room.
  void prefetch(block_id id, tier_kind where, traffic_class cls = traffic_class::prefetch)
      TF_EXCLUDES(mutex_);
  // Hint: drop `id`'s copy in `where` (not its home) once it is unleased,
  // writing it back first when dirty. Never blocks.
  void evict(block_id id, tier_kind where) TF_EXCLUDES(mutex_);
  // Writes every dirty copy back to its home tier (trying again those whose
  // write-back failed before) and waits for all transfers. Returns once every
  // write-back succeeded or used up its attempts; throws the first error seen
  // since the last flush (a write-back's names the block, the file, the
  // offset and the errno). A copy whose write-back failed stays dirty and
  // readable, so flush() can be called again.
  void flush() TF_EXCLUDES(mutex_);
  // Ends the store's use: flush(), then refuses new blocks and leases
  // (user_error; hints are dropped). Throws user_error naming a block when a
  // lease is still held or waited for — nothing is written or closed then —
  // and flush()'s error when a write-back failed, leaving the store open with
  // every dirty copy in place, so close() can be called again.
  void close() TF_EXCLUDES(mutex_);

  // The state of `id`'s copy in `where` (a snapshot).
  copy_state state(block_id id, tier_kind where) const TF_EXCLUDES(mutex_);
  // Checks every invariant (aborts on a broken one): budgets, at most one
  // writer, no writer beside readers or transfers, dirty implies a stale home,
  // storage present exactly for non-absent copies and homes.
  void check_invariants() const TF_EXCLUDES(mutex_);

  store_telemetry telemetry() const TF_EXCLUDES(mutex_);
  std::string telemetry_json() const { return to_json(telemetry()); }
  // The trace of every transfer and every blocking wait (Chrome trace_event).
  void write_trace(std::ostream& out) const;

 private:
  friend class lease;

  struct copy_record {
    copy_state state = copy_state::absent;
    tier_allocation storage;
    std::uint32_t readers = 0;
    bool writer = false;
    std::uint32_t sources = 0;     // transfers reading from this copy
    bool evict_requested = false;  // drop once unleased (after a write-back if dirty)
    std::uint64_t last_use = 0;    // LRU clock
  };
  struct block_record {
    block_desc desc;
    std::uint64_t bytes = 0;  // aligned size
    std::array<copy_record, tier_count> copies{};
    std::deque<std::shared_ptr<detail::lease_state>> waiters;  // FIFO of ungranted leases
    std::uint32_t transfers = 0;  // in flight, from or to any of its copies
    std::uint32_t leases = 0;     // granted, on any tier
    std::uint32_t writeback_failures = 0;  // failed tries of the write-back in flight
    // The last write-back that used up its attempts, and when: make_room()
    // does not try it again for a request made before then (see make_room).
    std::exception_ptr writeback_error;
    std::chrono::steady_clock::time_point writeback_failed_at;
  };

  block_record& record(block_id id) TF_REQUIRES(mutex_);
  const block_record& record(block_id id) const TF_REQUIRES(mutex_);
  void set_state(block_record& b, tier_kind t, copy_state to) TF_REQUIRES(mutex_);
  void pump(block_id id) TF_REQUIRES(mutex_);
  void apply_write(block_id id, tier_kind t) TF_REQUIRES(mutex_);
  // Fails the leases pending on `t` that were asked for no later than `requested_by`.
  void fail_waiters(block_record& b, tier_kind t, std::exception_ptr error,
                    std::chrono::steady_clock::time_point requested_by =
                        std::chrono::steady_clock::time_point::max()) TF_REQUIRES(mutex_);
  void wait_idle() TF_EXCLUDES(mutex_);
  static bool writer_active(const block_record& b);
  static bool has_waiter(const block_record& b, tier_kind t);
  bool try_grant(block_id id, detail::lease_state& w, bool writer_ahead) TF_REQUIRES(mutex_);
  void start_load(block_id id, tier_kind to, traffic_class cls, bool hint,
                  std::chrono::steady_clock::time_point since) TF_REQUIRES(mutex_);
  void start_writeback(block_id id, tier_kind from, traffic_class cls) TF_REQUIRES(mutex_);
  bool make_room(tier_kind t, std::uint64_t bytes, traffic_class cls, bool hint,
                 std::chrono::steady_clock::time_point since) TF_REQUIRES(mutex_);
  std::exception_ptr room_blocked(tier_kind t, std::uint64_t bytes, const std::string& block,
                                  std::chrono::steady_clock::time_point since) const
      TF_REQUIRES(mutex_);
  void writeback_failed(block_id id, tier_kind from, traffic_class cls, std::exception_ptr error)
      TF_REQUIRES(mutex_);
  bool droppable(const block_record& b, tier_kind t) const TF_REQUIRES(mutex_);
  void drop(block_id id, tier_kind t) TF_REQUIRES(mutex_);
  void settle_evictions(block_id id) TF_REQUIRES(mutex_);
  void submit(block_id id, tier_kind from, tier_kind to, traffic_class cls) TF_REQUIRES(mutex_);
  void on_transfer_done(block_id id, tier_kind from, tier_kind to, traffic_class cls,
                        std::exception_ptr error) TF_EXCLUDES(mutex_);
  void copy_out_range(const lease& l, std::uint64_t offset, std::span<std::byte> into, bool part,
                      traffic_class cls, link::completion done) TF_EXCLUDES(mutex_);
  void on_copy_out_done(block_id id, tier_kind from, std::exception_ptr error) TF_EXCLUDES(mutex_);
  void refuse_if_closed(std::string_view what) const TF_REQUIRES(mutex_);
  void refuse_if_leased() const TF_REQUIRES(mutex_);
  void schedule(block_id id) TF_REQUIRES(mutex_);
  void wake_space_waiters(tier_kind t) TF_REQUIRES(mutex_);
  void drain() TF_REQUIRES(mutex_);
  void end_lease(detail::lease_state& s, dirty d) TF_EXCLUDES(mutex_);
  // A thread is about to wait on `s` (pending): in a waiting_thread store,
  // marks it waited for and looks at it again, failing it if only a release
  // could grant it (see lease_holder). Does nothing in an any_thread store.
  void begin_wait(detail::lease_state& s) TF_EXCLUDES(mutex_);
  static bool waited_on(const block_record& b, tier_kind t);
  void fail_waited(block_record& b, tier_kind t, std::exception_ptr error) TF_REQUIRES(mutex_);
  std::exception_ptr room_held_by_leases(tier_kind t, std::uint64_t bytes, const std::string& block,
                                         std::chrono::steady_clock::time_point since) const
      TF_REQUIRES(mutex_);
  void fail_if_held_by_leases(block_id id, tier_kind t, std::chrono::steady_clock::time_point since)
      TF_REQUIRES(mutex_);
  void record_wait(const detail::lease_state& s, std::chrono::steady_clock::time_point start,
                   std::chrono::steady_clock::time_point end, bool blocked);
  void check_invariants_locked() const TF_REQUIRES(mutex_);

  const std::chrono::steady_clock::time_point created_at_;
  const unsigned writeback_attempts_;
  const lease_holder holder_;
  std::array<std::unique_ptr<tier>, tier_count> tiers_;
  std::unique_ptr<trace_recorder> trace_;

  mutable mutex mutex_;
  std::condition_variable idle_cv_;  // transfers_in_flight_ reached 0; waited on under mutex_
  std::deque<block_record> blocks_ TF_GUARDED_BY(mutex_);  // deque: records never move
  std::unordered_map<std::string, block_id> by_name_ TF_GUARDED_BY(mutex_);
  std::array<std::set<std::uint32_t>, tier_count> space_waiters_ TF_GUARDED_BY(mutex_);
  std::deque<std::uint32_t> worklist_ TF_GUARDED_BY(mutex_);
  bool draining_ TF_GUARDED_BY(mutex_) = false;
  bool closed_ TF_GUARDED_BY(mutex_) = false;
  std::uint64_t clock_ TF_GUARDED_BY(mutex_) = 0;
  std::uint64_t transfers_in_flight_ TF_GUARDED_BY(mutex_) = 0;
  std::exception_ptr first_error_ TF_GUARDED_BY(mutex_);
  store_telemetry counters_ TF_GUARDED_BY(mutex_);  // the store-wide counters
  std::array<std::uint64_t, tier_count> loads_ TF_GUARDED_BY(mutex_){};
  std::array<std::uint64_t, tier_count> evictions_ TF_GUARDED_BY(mutex_){};

  // Links last: destroyed first, so their engines finish (and call back into
  // the store) while everything above is still alive.
  std::array<std::array<std::unique_ptr<link>, tier_count>, tier_count> links_;
};

}  // namespace tierflow
