#include "tierflow/core/store.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <mutex>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/units.hpp"

namespace tierflow {

namespace {

std::uint64_t nanoseconds(std::chrono::steady_clock::duration d) {
  return std::uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
}

constexpr std::array<tier_kind, tier_count> all_tiers{tier_kind::device, tier_kind::host,
                                                     tier_kind::nvme};

}  // namespace

// ---- lease ------------------------------------------------------------------

lease::lease(lease&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)), state_(std::move(other.state_)) {}

lease& lease::operator=(lease&& other) noexcept {
  if (this != &other) {
    if (state_ && store_) store_->end_lease(*state_, dirty::no);
    store_ = std::exchange(other.store_, nullptr);
    state_ = std::move(other.state_);
  }
  return *this;
}

lease::~lease() {
  if (state_ && store_) store_->end_lease(*state_, dirty::no);
}

bool lease::ready() const noexcept {
  // acquire: pairs with the store's release of the status (see lease_state).
  return state_ && state_->status.load(std::memory_order_acquire) != detail::lease_status::pending;
}

std::span<std::byte> lease::wait() {
  TF_ASSERT(state_ != nullptr, "wait() on an empty lease");
  const auto start = std::chrono::steady_clock::now();
  // acquire: once the status leaves pending, data and error are visible.
  auto status = state_->status.load(std::memory_order_acquire);
  if (status == detail::lease_status::pending) {
    // In a waiting_thread store this thread's leases cannot end while it
    // waits: the store fails a request only their release could grant now.
    store_->begin_wait(*state_);
    status = state_->status.load(std::memory_order_acquire);
  }
  bool blocked = false;
  while (status == detail::lease_status::pending) {
    blocked = true;
    state_->status.wait(detail::lease_status::pending, std::memory_order_acquire);
    status = state_->status.load(std::memory_order_acquire);
  }
  store_->record_wait(*state_, start, std::chrono::steady_clock::now(), blocked);
  if (status == detail::lease_status::failed) std::rethrow_exception(state_->error);
  TF_ASSERT(status == detail::lease_status::granted, "wait() on a lease that has ended");
  return state_->data;
}

std::span<std::byte> lease::data() const noexcept {
  if (!ready()) return {};
  return state_->data;
}

block_id lease::block() const noexcept { return state_ ? state_->block : block_id{}; }
tier_kind lease::tier() const noexcept { return state_ ? state_->tier : tier_kind::host; }
access lease::mode() const noexcept { return state_ ? state_->mode : access::read; }

// ---- construction -------------------------------------------------------------

block_store::block_store(std::vector<std::unique_ptr<tier>> tiers, std::vector<link_spec> links,
                         store_options options)
    : created_at_(std::chrono::steady_clock::now()),
      writeback_attempts_(options.writeback_attempts),
      holder_(options.holder) {
  if (writeback_attempts_ == 0)
    throw user_error("block store: writeback_attempts is 0 (at least one try is needed)");
  for (auto& t : tiers) {
    if (!t) throw user_error("block store: a tier is null");
    auto& slot = tiers_[index_of(t->kind())];
    if (slot) throw user_error("block store: two " + std::string(name(t->kind())) + " tiers");
    slot = std::move(t);
  }
  if (std::none_of(tiers_.begin(), tiers_.end(), [](const auto& t) { return t != nullptr; }))
    throw user_error("block store: no tier");
  if (options.trace) trace_ = std::make_unique<trace_recorder>(options.trace_capacity);
  for (link_spec& spec : links) {
    const std::string label = std::string(name(spec.from)) + "->" + std::string(name(spec.to));
    if (!has_tier(spec.from) || !has_tier(spec.to) || spec.from == spec.to)
      throw user_error("block store: link " + label + " joins a missing tier");
    if (!spec.engine) throw user_error("block store: link " + label + " has no mover");
    auto& slot = links_[index_of(spec.from)][index_of(spec.to)];
    if (slot) throw user_error("block store: link " + label + " given twice");
    slot = std::make_unique<link>(spec.from, spec.to, std::move(spec.engine), spec.engines,
                                  trace_.get(), options.weights);
  }
}

block_store::~block_store() {
  wait_idle();
  // Join the engines before freeing what they copy.
  for (auto& row : links_)
    for (auto& l : row) l.reset();
  lock_guard lock(mutex_);
  if (first_error_) {
    // A destructor cannot throw: say what nobody was told.
    try {
      std::rethrow_exception(std::exchange(first_error_, nullptr));
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "tierflow: warning: block store destroyed with an unreported error: %s\n",
                   e.what());
    }
  }
  for (block_record& b : blocks_) {
    TF_ASSERT(b.leases == 0, "a block store was destroyed while a lease was held");
    for (tier_kind t : all_tiers) {
      copy_record& c = b.copies[index_of(t)];
      if (c.storage) tiers_[index_of(t)]->deallocate(c.storage);
      c.storage = {};
    }
  }
}

void block_store::wait_idle() {
  unique_lock lock(mutex_);
  while (transfers_in_flight_ != 0) lock.wait(idle_cv_);
}

// ---- blocks -------------------------------------------------------------------

block_id block_store::create_block(block_desc desc) {
  desc = validated(std::move(desc));
  unique_lock lock(mutex_);
  refuse_if_closed("create_block");
  if (!has_tier(desc.home))
    throw user_error("block \"" + desc.name + "\": its home tier " +
                     std::string(name(desc.home)) + " is not in this store");
  if (by_name_.contains(desc.name))
    throw user_error("block \"" + desc.name + "\": a block of that name exists already");
  tier& home = *tiers_[index_of(desc.home)];
  const std::uint64_t bytes = aligned_size(desc.size_bytes);
  // Home storage is permanent. Make room by evicting cached copies of other
  // blocks, writing dirty ones back and waiting for that (creation is control
  // plane); what cannot be made room for is budget_exceeded from allocate(),
  // or the write-back's error when dirty copies that cannot go home hold it.
  // Every cached copy leaves, not just enough of them: the tier is one region
  // and allocation is first fit, so home copies made so pack together from
  // its start. Made between cached copies instead, they would stay between
  // the holes those leave, each too small for a larger copy later, and a
  // budget that holds the homes and twice the largest copy beside them could
  // still not lease it.
  if (bytes <= home.budget()) {
    const auto since = std::chrono::steady_clock::now();
    const bool cached = std::any_of(blocks_.begin(), blocks_.end(), [&](const block_record& v) {
      const copy_state s = v.copies[index_of(desc.home)].state;
      return v.desc.home != desc.home && (s == copy_state::valid || s == copy_state::dirty);
    });
    const std::uint64_t room = cached ? home.budget() : bytes;
    while (!make_room(desc.home, room, traffic_class::demand, /*hint=*/false, since) &&
           transfers_in_flight_ > 0) {
      drain();
      while (transfers_in_flight_ != 0) lock.wait(idle_cv_);
    }
    drain();
    if (!home.can_allocate(bytes))
      if (auto blocked = room_blocked(desc.home, bytes, desc.name, since))
        std::rethrow_exception(blocked);
  }
  tier_allocation storage = home.allocate(bytes, desc.name);  // throws budget_exceeded

  const block_id id{static_cast<std::uint32_t>(blocks_.size())};
  block_record& b = blocks_.emplace_back();
  b.desc = std::move(desc);
  b.bytes = bytes;
  copy_record& c = b.copies[index_of(b.desc.home)];
  c.storage = storage;
  c.state = copy_state::valid;  // the home copy is the newest bytes, whatever they are
  by_name_.emplace(b.desc.name, id);
  return id;
}

std::size_t block_store::block_count() const {
  lock_guard lock(mutex_);
  return blocks_.size();
}

const block_desc& block_store::describe(block_id id) const {
  lock_guard lock(mutex_);
  return record(id).desc;
}

bool block_store::present_in(block_id id, tier_kind where) const {
  lock_guard lock(mutex_);
  const copy_state s = record(id).copies[index_of(where)].state;
  return holds_data(s) || s == copy_state::loading;
}

std::optional<block_id> block_store::find(std::string_view name) const {
  lock_guard lock(mutex_);
  const auto it = by_name_.find(std::string(name));
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

const tier& block_store::tier_of(tier_kind kind) const {
  if (!has_tier(kind))
    throw user_error("block store: no " + std::string(name(kind)) + " tier");
  return *tiers_[index_of(kind)];
}

block_store::block_record& block_store::record(block_id id) {
  if (id.value >= blocks_.size())
    throw user_error("block store: no block with id " + std::to_string(id.value));
  return blocks_[id.value];
}

const block_store::block_record& block_store::record(block_id id) const {
  if (id.value >= blocks_.size())
    throw user_error("block store: no block with id " + std::to_string(id.value));
  return blocks_[id.value];
}

// ---- the state machine ----------------------------------------------------------

void block_store::set_state(block_record& b, tier_kind t, copy_state to) {
  copy_record& c = b.copies[index_of(t)];
  TF_ASSERT(is_legal_transition(c.state, to), "illegal copy-state transition");
  c.state = to;
}

bool block_store::writer_active(const block_record& b) {
  return std::any_of(b.copies.begin(), b.copies.end(), [](const copy_record& c) { return c.writer; });
}

bool block_store::has_waiter(const block_record& b, tier_kind t) {
  return std::any_of(b.waiters.begin(), b.waiters.end(), [t](const auto& w) {
    return w->tier == t && w->status.load(std::memory_order_relaxed) == detail::lease_status::pending;
  });
}

lease block_store::acquire(block_id id, tier_kind where, access mode, traffic_class cls) {
  lock_guard lock(mutex_);
  refuse_if_closed("acquire");
  block_record& b = record(id);
  if (!has_tier(where))
    throw user_error("block \"" + b.desc.name + "\": no " + std::string(name(where)) +
                     " tier in this store");
  tier& target = *tiers_[index_of(where)];
  if (target.memory() == memory_kind::file && mode != access::read)
    throw user_error("block \"" + b.desc.name + "\": a file tier cannot be leased for writing");
  if (b.bytes > target.budget())
    throw budget_exceeded(target.name(), b.desc.name, b.bytes, target.budget(), target.used());
  ++counters_.acquires;
  auto state = std::make_shared<detail::lease_state>();
  state->block = id;
  state->tier = where;
  state->mode = mode;
  state->cls = cls;
  state->requested_at = std::chrono::steady_clock::now();
  b.waiters.push_back(state);
  schedule(id);
  drain();
  return lease(this, std::move(state));
}

void block_store::release(lease&& l, dirty d) {
  TF_ASSERT(l.state_ != nullptr && l.store_ == this, "release() of a lease from elsewhere");
  auto state = std::move(l.state_);
  l.store_ = nullptr;
  end_lease(*state, d);
}

void block_store::copy_out(const lease& l, std::span<std::byte> into, traffic_class cls, link::completion done) {
  copy_out_range(l, 0, into, false, cls, std::move(done));
}

void block_store::copy_out(const lease& l, std::uint64_t offset, std::span<std::byte> into, traffic_class cls,
                           link::completion done) {
  copy_out_range(l, offset, into, true, cls, std::move(done));
}

void block_store::copy_out_range(const lease& l, std::uint64_t offset, std::span<std::byte> into, bool part,
                                 traffic_class cls, link::completion done) {
  lock_guard lock(mutex_);
  if (l.state_ == nullptr || l.store_ != this) throw user_error("copy_out: a lease of another store, or none");
  const detail::lease_state& s = *l.state_;
  block_record& b = record(s.block);
  const std::string what = "copy_out of block \"" + b.desc.name + "\"";
  if (s.status.load(std::memory_order_acquire) != detail::lease_status::granted)
    throw user_error(what + ": its lease in tier " + std::string(name(s.tier)) + " is not granted (wait() first)");
  if (s.tier == tier_kind::host)
    throw user_error(what + ": the copy is in the host tier already (read the lease's bytes)");
  link* through = links_[index_of(s.tier)][index_of(tier_kind::host)].get();
  if (through == nullptr)
    throw user_error(what + ": no " + std::string(name(s.tier)) + "->host link in this store");
  // The whole block (into at least its aligned size), or a part of it.
  if (!part && into.size() < b.bytes)
    throw user_error(what + ": " + std::to_string(into.size()) + " bytes given for its " +
                     std::to_string(b.bytes) + " (its size in whole pages)");
  const std::uint64_t bytes = part ? into.size() : b.bytes;
  if (part && !(offset == 0 && bytes == b.bytes)) {
    if (offset % block_alignment != 0 || bytes % block_alignment != 0 || bytes == 0)
      throw user_error(what + ": a part of " + std::to_string(bytes) + " bytes at " + std::to_string(offset) +
                       " is not in whole " + std::to_string(block_alignment) + "-byte pages");
    if (offset + bytes > b.bytes)
      throw user_error(what + ": a part of " + std::to_string(bytes) + " bytes at " + std::to_string(offset) +
                       " runs past its " + std::to_string(b.bytes) + " (its size in whole pages)");
    if (tier_of(s.tier).verifies_whole_blocks())
      throw user_error(what + ": tier " + std::string(name(s.tier)) +
                       " checks whole blocks against their checksums, and a part could not be checked; "
                       "copy the whole block");
  }
  if (reinterpret_cast<std::uintptr_t>(into.data()) % block_alignment != 0)
    throw user_error(what + ": the memory given does not start on a " + std::to_string(block_alignment) +
                     "-byte boundary");
  // Counted as a transfer from the copy (close() and the destructor wait for it).
  copy_record& c = b.copies[index_of(s.tier)];
  ++c.sources;
  ++b.transfers;
  ++transfers_in_flight_;
  transfer t;
  t.block = s.block;
  t.block_name = b.desc.name;
  t.from = s.tier;
  t.to = tier_kind::host;
  t.source = c.storage;
  if (offset != 0) {  // the part's storage: as far into a file or a region
    if (t.source.data != nullptr) t.source.data += offset;
    t.source.offset += offset;
    t.source.size -= offset;
  }
  t.destination = tier_allocation{.data = into.data(), .offset = 0, .size = into.size(), .file = 0};
  t.bytes = bytes;
  t.cls = cls;
  through->submit(std::move(t), [this, id = s.block, from = s.tier, done = std::move(done)](std::exception_ptr e) {
    on_copy_out_done(id, from, e);
    done(std::move(e));
  });
}

void block_store::on_copy_out_done(block_id id, tier_kind from, std::exception_ptr error) {
  lock_guard lock(mutex_);
  block_record& b = record(id);
  copy_record& c = b.copies[index_of(from)];
  TF_ASSERT(c.sources > 0 && b.transfers > 0 && transfers_in_flight_ > 0);
  --c.sources;
  --b.transfers;
  --transfers_in_flight_;
  if (error) ++counters_.failed_transfers;
  // The copy may have become a victim, the block writable.
  schedule(id);
  wake_space_waiters(from);
  drain();
  if (transfers_in_flight_ == 0) idle_cv_.notify_all();
}

void block_store::end_lease(detail::lease_state& s, dirty d) {
  lock_guard lock(mutex_);
  const auto status = s.status.load(std::memory_order_relaxed);  // written under mutex_ only
  if (status != detail::lease_status::granted) {
    // Not granted yet: withdraw it (pump() drops it from the queue); a load
    // started for it carries on and its copy stays cached.
    TF_ASSERT(d == dirty::no || status != detail::lease_status::pending,
              "a lease that was never granted was released dirty");
    s.status.store(detail::lease_status::ended, std::memory_order_release);
    s.status.notify_all();
    schedule(s.block);
    drain();
    return;
  }
  block_record& b = record(s.block);
  copy_record& c = b.copies[index_of(s.tier)];
  if (s.mode == access::read) {
    TF_ASSERT(d == dirty::no, "a read lease was released dirty");
    TF_ASSERT(c.readers > 0);
    --c.readers;
  } else {
    TF_ASSERT(c.writer);
    c.writer = false;
    if (d == dirty::yes) {
      apply_write(s.block, s.tier);
      ++counters_.dirty_releases;
    } else if (c.state == copy_state::loading) {
      // An overwrite released clean: the copy never got its bytes.
      set_state(b, s.tier, copy_state::absent);
      if (s.tier != b.desc.home) {
        tiers_[index_of(s.tier)]->deallocate(c.storage);
        c.storage = {};
      }
    }
  }
  --b.leases;
  c.last_use = ++clock_;
  s.status.store(detail::lease_status::ended, std::memory_order_release);
  schedule(s.block);
  wake_space_waiters(s.tier);  // the copy may be a victim now
  drain();
}

void block_store::begin_wait(detail::lease_state& s) {
  if (holder_ != lease_holder::waiting_thread) return;
  lock_guard lock(mutex_);
  if (s.status.load(std::memory_order_relaxed) != detail::lease_status::pending) return;
  s.waited = true;
  // Looked at again now that it is waited on: a request that was parked for
  // room before may have become one only a release could grant.
  schedule(s.block);
  drain();
}

void block_store::apply_write(block_id id, tier_kind t) {
  block_record& b = record(id);
  const tier_kind home = b.desc.home;
  b.writeback_error = nullptr;  // new bytes: their write-back has not been tried
  if (t == home) {
    // valid, or loading after an overwrite of a stale home.
    if (b.copies[index_of(home)].state == copy_state::loading) set_state(b, home, copy_state::valid);
    TF_ASSERT(b.copies[index_of(home)].state == copy_state::valid);
  } else {
    const copy_state s = b.copies[index_of(t)].state;
    if (s == copy_state::valid || s == copy_state::loading) set_state(b, t, copy_state::dirty);
    if (b.copies[index_of(home)].state == copy_state::valid) set_state(b, home, copy_state::absent);
  }
  // Every other cached copy now holds old bytes. None is leased or being
  // copied: the write lease excluded both.
  for (tier_kind o : all_tiers) {
    if (o == t || o == home) continue;
    if (b.copies[index_of(o)].state != copy_state::absent) drop(id, o);
  }
}

void block_store::schedule(block_id id) { worklist_.push_back(id.value); }

void block_store::wake_space_waiters(tier_kind t) {
  auto& waiting = space_waiters_[index_of(t)];
  for (std::uint32_t id : waiting) worklist_.push_back(id);
  waiting.clear();
}

void block_store::drain() {
  // pump() can make room, which wakes other blocks: they join the worklist
  // rather than recursing, so each block is examined with no frame above it
  // holding references into the waiter queues.
  if (draining_) return;
  draining_ = true;
  while (!worklist_.empty()) {
    const block_id id{worklist_.front()};
    worklist_.pop_front();
    pump(id);
  }
  draining_ = false;
}

void block_store::pump(block_id id) {
  block_record& b = record(id);
  bool writer_ahead = false;  // FIFO fairness: no reader overtakes a waiting writer
  for (auto it = b.waiters.begin(); it != b.waiters.end();) {
    detail::lease_state& w = **it;
    if (w.status.load(std::memory_order_relaxed) != detail::lease_status::pending) {
      it = b.waiters.erase(it);
      continue;
    }
    if (try_grant(id, w, writer_ahead)) {
      it = b.waiters.erase(it);
      continue;
    }
    if (w.mode == access::write) writer_ahead = true;
    ++it;
  }
  settle_evictions(id);
}

bool block_store::try_grant(block_id id, detail::lease_state& w, bool writer_ahead) {
  block_record& b = record(id);
  copy_record& c = b.copies[index_of(w.tier)];
  const bool reading = w.mode == access::read;
  const bool readable = reading ? holds_data(c.state)
                                : (c.state == copy_state::valid || c.state == copy_state::dirty);
  // An overwrite of an absent copy needs storage, not bytes: it is granted
  // on an empty copy in state loading, which only its release settles.
  const bool blank = w.mode == access::overwrite && c.state == copy_state::absent;
  if (readable || blank) {
    if (writer_ahead || writer_active(b)) return false;
    if (reading) {
      ++c.readers;
    } else {
      if (b.leases > 0 || b.transfers > 0) return false;
      if (blank) {
        if (!c.storage) {
          if (!make_room(w.tier, b.bytes, w.cls, false, w.requested_at)) {
            if (auto blocked = room_blocked(w.tier, b.bytes, b.desc.name, w.requested_at)) {
              fail_waiters(b, w.tier, blocked, w.requested_at);
            } else {
              space_waiters_[index_of(w.tier)].insert(id.value);
              fail_if_held_by_leases(id, w.tier, w.requested_at);
            }
            return false;
          }
          try {
            c.storage = tiers_[index_of(w.tier)]->allocate(b.bytes, b.desc.name);
          } catch (...) {
            fail_waiters(b, w.tier, std::current_exception());
            return false;
          }
        }
        set_state(b, w.tier, copy_state::loading);
      }
      c.writer = true;
    }
    ++b.leases;
    c.last_use = ++clock_;
    c.evict_requested = false;
    if (tiers_[index_of(w.tier)]->memory() != memory_kind::file)
      w.data = std::span<std::byte>(c.storage.data, static_cast<std::size_t>(b.desc.size_bytes));
    // release: publishes `data` to the holder, who loads the status with acquire.
    w.status.store(detail::lease_status::granted, std::memory_order_release);
    w.status.notify_all();
    return true;
  }
  if (c.state == copy_state::absent && !writer_active(b))
    start_load(id, w.tier, w.cls, false, w.requested_at);
  return false;
}

// `since`: when the load was asked for (see make_room).
void block_store::start_load(block_id id, tier_kind to, traffic_class cls, bool hint,
                             std::chrono::steady_clock::time_point since) {
  block_record& b = record(id);
  copy_record& c = b.copies[index_of(to)];
  if (c.state != copy_state::absent || writer_active(b)) return;
  const tier_kind home = b.desc.home;
  if (to == home) {
    // The home copy is stale: the newest bytes are in a dirty copy. Bring them home.
    for (tier_kind t : all_tiers)
      if (b.copies[index_of(t)].state == copy_state::dirty) {
        start_writeback(id, t, cls == traffic_class::demand ? cls : traffic_class::writeback);
        return;
      }
    return;  // a write-back is in flight already
  }
  // The source: the nearest tier holding the newest bytes with a link to `to`.
  std::optional<tier_kind> source;
  int best = 99;
  for (tier_kind t : all_tiers) {
    if (t == to || !holds_data(b.copies[index_of(t)].state)) continue;
    if (!links_[index_of(t)][index_of(to)]) continue;
    const int distance = std::abs(int(index_of(t)) - int(index_of(to)));
    if (distance < best) {
      best = distance;
      source = t;
    }
  }
  if (!source) {
    fail_waiters(b, to,
                 std::make_exception_ptr(user_error(
                     "block \"" + b.desc.name + "\": no link into the " +
                     std::string(name(to)) + " tier from a tier holding its bytes")));
    return;
  }
  if (!c.storage) {
    if (!make_room(to, b.bytes, cls, hint, since)) {
      if (hint)
        ++counters_.prefetches_dropped;
      else if (auto blocked = room_blocked(to, b.bytes, b.desc.name, since))
        fail_waiters(b, to, blocked, since);  // a later request may try the write-backs again
      else {
        space_waiters_[index_of(to)].insert(id.value);
        fail_if_held_by_leases(id, to, since);
      }
      return;
    }
    try {
      c.storage = tiers_[index_of(to)]->allocate(b.bytes, b.desc.name);
    } catch (...) {
      fail_waiters(b, to, std::current_exception());
      return;
    }
  }
  set_state(b, to, copy_state::loading);
  ++b.copies[index_of(*source)].sources;
  ++loads_[index_of(to)];
  submit(id, *source, to, cls);
}

void block_store::start_writeback(block_id id, tier_kind from, traffic_class cls) {
  block_record& b = record(id);
  const tier_kind home = b.desc.home;
  TF_ASSERT(b.copies[index_of(from)].state == copy_state::dirty);
  if (b.copies[index_of(home)].state != copy_state::absent) return;  // one write-back at a time
  // A writer may supersede the bytes at its release, dropping every other
  // copy: nothing may read from them meanwhile.
  if (writer_active(b)) return;
  if (!links_[index_of(from)][index_of(home)]) {
    if (!first_error_)
      first_error_ = std::make_exception_ptr(user_error(
          "block \"" + b.desc.name + "\": no link from the " + std::string(name(from)) +
          " tier to its home tier " + std::string(name(home))));
    return;
  }
  set_state(b, from, copy_state::writing_back);
  set_state(b, home, copy_state::loading);
  ++b.copies[index_of(from)].sources;
  ++counters_.writebacks;
  submit(id, from, home, cls);
}

void block_store::submit(block_id id, tier_kind from, tier_kind to, traffic_class cls) {
  block_record& b = record(id);
  ++b.transfers;
  ++transfers_in_flight_;
  transfer t;
  t.block = id;
  t.block_name = b.desc.name;
  t.from = from;
  t.to = to;
  t.source = b.copies[index_of(from)].storage;
  t.destination = b.copies[index_of(to)].storage;
  t.bytes = b.bytes;
  t.cls = cls;
  // Lock order: the store's lock, then the link's. The link calls back
  // without its lock held.
  links_[index_of(from)][index_of(to)]->submit(
      std::move(t), [this, id, from, to, cls](std::exception_ptr e) {
        on_transfer_done(id, from, to, cls, std::move(e));
      });
}

void block_store::on_transfer_done(block_id id, tier_kind from, tier_kind to, traffic_class cls,
                                   std::exception_ptr error) {
  lock_guard lock(mutex_);
  block_record& b = record(id);
  copy_record& src = b.copies[index_of(from)];
  const tier_kind home = b.desc.home;
  TF_ASSERT(src.sources > 0 && b.transfers > 0 && transfers_in_flight_ > 0);
  --src.sources;
  --b.transfers;
  --transfers_in_flight_;
  if (error) ++counters_.failed_transfers;
  if (to == home) {  // a write-back
    if (!error) {
      set_state(b, home, copy_state::valid);
      for (tier_kind t : all_tiers) {
        copy_record& c = b.copies[index_of(t)];
        if (c.state == copy_state::dirty || c.state == copy_state::writing_back)
          set_state(b, t, copy_state::valid);
      }
      b.writeback_failures = 0;
      b.writeback_error = nullptr;
    } else {
      writeback_failed(id, from, cls, error);
    }
  } else if (!error) {
    const bool home_current = b.copies[index_of(home)].state == copy_state::valid;
    set_state(b, to, home_current ? copy_state::valid : copy_state::dirty);
  } else {
    if (!first_error_) first_error_ = error;
    copy_record& dst = b.copies[index_of(to)];
    set_state(b, to, copy_state::absent);
    tiers_[index_of(to)]->deallocate(dst.storage);
    dst.storage = {};
    dst.evict_requested = false;
    fail_waiters(b, to, error);
    wake_space_waiters(to);
  }
  schedule(id);
  wake_space_waiters(from);  // the source may have become a victim
  wake_space_waiters(to);    // so may a loaded copy nobody waits for (a prefetch)
  drain();
  if (transfers_in_flight_ == 0) idle_cv_.notify_all();
  // Drop this engine thread's reference under the lock: whoever receives the
  // error (through the lock or a lease's status) then holds the last one.
  error = nullptr;
}

// A write-back from `from` failed: try it again while attempts remain, else
// keep the dirty copy where it is and report. Nothing here may start the same
// write-back again once the attempts are used up — that was the loop a
// persistent EIO or ENOSPC turned into.
void block_store::writeback_failed(block_id id, tier_kind from, traffic_class cls,
                                   std::exception_ptr error) {
  block_record& b = record(id);
  const tier_kind home = b.desc.home;
  set_state(b, home, copy_state::absent);
  set_state(b, from, copy_state::dirty);
  bool retry = ++b.writeback_failures < writeback_attempts_;
  try {
    std::rethrow_exception(error);
  } catch (const user_error&) {
    retry = false;  // a missing link or a refused request: trying again changes nothing
  } catch (...) {
  }
  if (retry) {
    start_writeback(id, from, cls);
    if (b.copies[index_of(home)].state == copy_state::loading) return;  // submitted
  }
  const unsigned attempts = b.writeback_failures;
  b.writeback_failures = 0;
  // Name the write-back and its tries; the errno and the I/O's context stay.
  std::exception_ptr reported = error;
  try {
    std::rethrow_exception(error);
  } catch (const user_error&) {
  } catch (const tierflow::error& e) {
    error_context context = e.context();
    context.operation = "write-back to the " + std::string(name(home)) + " tier (" +
                        std::to_string(attempts) + (attempts == 1 ? " try" : " tries") +
                        "): " + (context.operation.empty() ? "I/O" : context.operation);
    if (context.block.empty()) context.block = b.desc.name;
    reported = std::make_exception_ptr(tierflow::error(e.code(), std::move(context)));
  } catch (...) {
  }
  b.writeback_error = reported;
  b.writeback_failed_at = std::chrono::steady_clock::now();
  // The evictions waiting on it are dropped: every copy holding data is dirty
  // (the home is stale) and cannot go without a write-back.
  for (copy_record& c : b.copies) c.evict_requested = false;
  if (!first_error_) first_error_ = reported;
  fail_waiters(b, home, reported);
  // Whoever waits for room that these copies were to free must look again:
  // make_room() now passes them over, and room_blocked() may say it never comes.
  for (tier_kind t : all_tiers)
    if (tiers_[index_of(t)]) wake_space_waiters(t);
}

namespace {

bool pending_in(const detail::lease_state& w, tier_kind t) {
  return w.tier == t && w.status.load(std::memory_order_relaxed) == detail::lease_status::pending;
}

void fail_lease(detail::lease_state& w, std::exception_ptr error) {
  w.error = std::move(error);
  // release: publishes `error` to the holder.
  w.status.store(detail::lease_status::failed, std::memory_order_release);
  w.status.notify_all();
}

}  // namespace

void block_store::fail_waiters(block_record& b, tier_kind t, std::exception_ptr error,
                               std::chrono::steady_clock::time_point requested_by) {
  for (auto& w : b.waiters)
    if (pending_in(*w, t) && w->requested_at <= requested_by) fail_lease(*w, error);
}

bool block_store::waited_on(const block_record& b, tier_kind t) {
  return std::any_of(b.waiters.begin(), b.waiters.end(),
                     [t](const auto& w) { return w->waited && pending_in(*w, t); });
}

void block_store::fail_waited(block_record& b, tier_kind t, std::exception_ptr error) {
  for (auto& w : b.waiters)
    if (w->waited && pending_in(*w, t)) fail_lease(*w, error);
}

// ---- room and eviction ------------------------------------------------------------

bool block_store::droppable(const block_record& b, tier_kind t) const {
  const copy_record& c = b.copies[index_of(t)];
  return t != b.desc.home && c.state == copy_state::valid && c.readers == 0 && !c.writer &&
         c.sources == 0 && !has_waiter(b, t);
}

void block_store::drop(block_id id, tier_kind t) {
  block_record& b = record(id);
  copy_record& c = b.copies[index_of(t)];
  TF_ASSERT(t != b.desc.home && c.readers == 0 && !c.writer && c.sources == 0,
            "dropping a copy that is in use");
  if (c.state != copy_state::absent) set_state(b, t, copy_state::absent);
  if (c.storage) tiers_[index_of(t)]->deallocate(c.storage);
  c.storage = {};
  c.evict_requested = false;
  ++evictions_[index_of(t)];
  wake_space_waiters(t);
}

// `since` is when the room was asked for. A dirty copy whose write-back used
// up its attempts at or after then is no victim: this request already paid
// for that write-back, and trying it again on every wake-up would loop. One
// that failed earlier is tried once more (the disk may be back).
bool block_store::make_room(tier_kind t, std::uint64_t bytes, traffic_class cls, bool hint,
                            std::chrono::steady_clock::time_point since) {
  tier& target = *tiers_[index_of(t)];
  if (target.can_allocate(bytes)) return true;
  // Victims, least recently used first: unleased copies nothing reads from
  // and nobody waits for. Clean ones are dropped now; dirty ones (not for a
  // hint) are written back and dropped when that completes.
  std::vector<std::pair<std::uint64_t, std::uint32_t>> victims;
  for (std::uint32_t i = 0; i < blocks_.size(); ++i) {
    const block_record& v = blocks_[i];
    const copy_record& c = v.copies[index_of(t)];
    if (t == v.desc.home || c.readers > 0 || c.writer || c.sources > 0) continue;
    if (c.state != copy_state::valid && c.state != copy_state::dirty) continue;
    if (has_waiter(v, t)) continue;
    if (c.state == copy_state::dirty && v.writeback_error && v.writeback_failed_at >= since) continue;
    victims.emplace_back(c.last_use, i);
  }
  std::sort(victims.begin(), victims.end());
  std::uint64_t pending = 0;
  for (const auto& [last_use, i] : victims) {
    block_record& v = blocks_[i];
    copy_record& c = v.copies[index_of(t)];
    if (c.state == copy_state::valid) {
      drop(block_id{i}, t);
      if (target.can_allocate(bytes)) return true;
    } else if (!hint && pending < bytes) {
      c.evict_requested = true;
      // A write-back to make room for demand inherits its class: demand must
      // not wait behind background traffic, even its own write-backs.
      if (v.copies[index_of(v.desc.home)].state == copy_state::absent)
        start_writeback(block_id{i}, t,
                        cls == traffic_class::demand ? traffic_class::demand
                                                     : traffic_class::writeback);
      pending += v.bytes;
    }
  }
  return target.can_allocate(bytes);
}

// Null, or the error for a request of `bytes` in `t` (for `block`, asked for
// at `since`) that no release or transfer will ever make room for, because
// dirty copies make_room() will not try to write back again for it (stuck
// ones) hold the space: either the budget less the home copies and the stuck
// ones is smaller than the request, or the tier holds nothing but those
// (so nothing will ever be freed there, whatever the free space's shape).
// Waiting for room then would be waiting for ever.
std::exception_ptr block_store::room_blocked(tier_kind t, std::uint64_t bytes,
                                             const std::string& block,
                                             std::chrono::steady_clock::time_point since) const {
  const tier& target = *tiers_[index_of(t)];
  std::uint64_t held = 0;
  bool others = false;  // a copy whose release, drop or transfer will wake the waiter
  const block_record* failed = nullptr;
  for (const block_record& v : blocks_) {
    const copy_record& c = v.copies[index_of(t)];
    if (t == v.desc.home) {
      held += v.bytes;
    } else if (holds_data(c.state) && v.writeback_error && v.writeback_failed_at >= since) {
      held += v.bytes;
      if (!failed) failed = &v;
    } else if (c.storage) {
      others = true;
    }
  }
  if (!failed) return nullptr;
  const bool never = held + bytes > target.budget() || (!others && !target.can_allocate(bytes));
  if (!never) return nullptr;
  int errnum = EIO;
  std::string cause;
  try {
    std::rethrow_exception(failed->writeback_error);
  } catch (const tierflow::error& e) {
    errnum = e.errnum();
    cause = e.what();
  } catch (const std::exception& e) {
    cause = e.what();
  }
  return std::make_exception_ptr(tierflow::error(
      errnum, error_context{"make room (dirty copies whose write-back failed hold the tier; \"" +
                            failed->desc.name + "\": " + cause + ")"}
                  .range(0, bytes)
                  .in_tier(std::string(name(t)))
                  .of_block(block)));
}

// Null, or the error for a request of `bytes` in `t` (for `block`, asked for
// at `since`, make_room() having failed for it) in a waiting_thread store
// that only the end of a lease could make room for. Each copy in `t` is
//   - on its way to free or settle room: a transfer reads it or loads it
//     (its completion wakes the waiters on `t`, who look again), or
//     make_room() can drop it (clean, unleased, nobody waiting for it) or
//     write it back (dirty, with a way home, no writer of its block, its
//     write-back not failed since the request);
//   - or fixed: a home copy; a dirty copy that cannot go home (its write-back
//     failed since the request, or no link); a copy held by a lease — granted,
//     asked for (its waiter keeps make_room() off it), or a writer of its
//     block, whose release drops or writes it back.
// The request never gets room when nothing is on its way, or when the fixed
// copies leave less than `bytes` of the budget: the waiting thread holds every
// lease, and none ends while it waits. Worked example: a 16 KiB tier holding
// leased 4 KiB copies at 0 and 8 KiB (the one between released and dropped)
// has 8 KiB free in two pieces; an 8 KiB request gets neither, and nothing
// else is there to move.
std::exception_ptr block_store::room_held_by_leases(tier_kind t, std::uint64_t bytes,
                                                    const std::string& block,
                                                    std::chrono::steady_clock::time_point since) const {
  const tier& target = *tiers_[index_of(t)];
  bool on_its_way = false;
  std::uint64_t fixed = 0, leased_bytes = 0, home_bytes = 0, stuck_bytes = 0;
  std::vector<const block_record*> leased;
  for (const block_record& v : blocks_) {
    const copy_record& c = v.copies[index_of(t)];
    const tier_kind home = v.desc.home;
    if (t == home) {
      fixed += v.bytes;
      home_bytes += v.bytes;
    } else if (!c.storage) {
      continue;
    } else if (c.sources > 0 || (c.state == copy_state::loading && !c.writer)) {
      on_its_way = true;  // a transfer in flight
    } else if (c.readers > 0 || c.writer || has_waiter(v, t) ||
               (c.state == copy_state::dirty && writer_active(v))) {
      fixed += v.bytes;
      leased_bytes += v.bytes;
      leased.push_back(&v);
    } else if (c.state == copy_state::valid) {
      on_its_way = true;  // make_room() drops it
    } else if ((v.writeback_error && v.writeback_failed_at >= since) ||
               !links_[index_of(t)][index_of(home)]) {
      fixed += v.bytes;
      stuck_bytes += v.bytes;
    } else {
      on_its_way = true;  // make_room() writes it back, then drops it
    }
  }
  if (on_its_way && fixed + bytes <= target.budget()) return nullptr;

  std::string message = "block \"" + block + "\" (" + format_bytes(double(bytes)) +
                        ") can never get room in tier " + std::string(name(t)) +
                        " while its holder waits: budget " + format_bytes(double(target.budget())) +
                        ", " + format_bytes(double(target.used())) + " in use";
  if (const auto largest = target.largest_free())
    message += ", largest free piece " + format_bytes(double(*largest));
  if (!leased.empty()) {
    constexpr std::size_t named = 4;  // the message stays one readable line
    message += ", " + format_bytes(double(leased_bytes)) + " held by the leases of ";
    for (std::size_t i = 0; i < leased.size() && i < named; ++i)
      message += (i ? ", \"" : "\"") + leased[i]->desc.name + "\" (" +
                 format_bytes(double(leased[i]->bytes)) + ")";
    if (leased.size() > named) message += " and " + std::to_string(leased.size() - named) + " more";
  }
  if (home_bytes) message += ", " + format_bytes(double(home_bytes)) + " by home copies";
  if (stuck_bytes)
    message += ", " + format_bytes(double(stuck_bytes)) + " by dirty copies that cannot go home";
  message += on_its_way ? "; the budget less those is too small for it"
                        : "; nothing in flight or evictable will free more";
  message += " (the store's leases are all held by the thread that waits: release one first)";
  error_context context{"acquire"};
  context.length = bytes;
  context.tier = std::string(name(t));
  context.block = block;
  return std::make_exception_ptr(tierflow::error(EDEADLK, std::move(context), std::move(message)));
}

// In a waiting_thread store, fails the leases of `id` waited on in `t` (parked
// for room make_room() could not make) when only a release could make it.
void block_store::fail_if_held_by_leases(block_id id, tier_kind t,
                                         std::chrono::steady_clock::time_point since) {
  if (holder_ != lease_holder::waiting_thread) return;
  block_record& b = record(id);
  if (!waited_on(b, t)) return;
  if (auto held = room_held_by_leases(t, b.bytes, b.desc.name, since)) fail_waited(b, t, held);
}

void block_store::settle_evictions(block_id id) {
  block_record& b = record(id);
  const tier_kind home = b.desc.home;
  for (tier_kind t : all_tiers) {
    copy_record& c = b.copies[index_of(t)];
    if (!c.evict_requested) continue;
    if (t == home || c.state == copy_state::absent || has_waiter(b, t)) {
      c.evict_requested = false;
      continue;
    }
    if (c.readers > 0 || c.writer) continue;  // settled again on release
    if (droppable(b, t)) {
      drop(id, t);
    } else if (c.state == copy_state::dirty &&
               b.copies[index_of(home)].state == copy_state::absent && !writer_active(b)) {
      start_writeback(id, t, traffic_class::writeback);
    }
  }
}

// ---- hints -------------------------------------------------------------------------

void block_store::prefetch(block_id id, tier_kind where, traffic_class cls) {
  lock_guard lock(mutex_);
  block_record& b = record(id);
  if (!has_tier(where)) return;
  ++counters_.prefetches;
  if (closed_) {
    ++counters_.prefetches_dropped;
    return;
  }
  if (b.copies[index_of(where)].state != copy_state::absent || writer_active(b)) return;
  start_load(id, where, cls, /*hint=*/true, std::chrono::steady_clock::now());
  drain();
}

void block_store::evict(block_id id, tier_kind where) {
  lock_guard lock(mutex_);
  block_record& b = record(id);
  if (!has_tier(where) || where == b.desc.home) return;
  copy_record& c = b.copies[index_of(where)];
  if (c.state == copy_state::absent) return;
  c.evict_requested = true;
  // Asked for again: a write-back that failed before gets its attempts anew.
  if (c.state == copy_state::dirty) b.writeback_error = nullptr;
  schedule(id);
  drain();
}

void block_store::flush() {
  {
    lock_guard lock(mutex_);
    for (std::uint32_t i = 0; i < blocks_.size(); ++i) {
      block_record& b = blocks_[i];
      if (writer_active(b)) continue;
      for (tier_kind t : all_tiers)
        if (b.copies[index_of(t)].state == copy_state::dirty) {
          b.writeback_error = nullptr;  // asked for again: tried anew
          start_writeback(block_id{i}, t, traffic_class::writeback);
          break;
        }
    }
    drain();
  }
  // Ends: each write-back succeeds or uses up its attempts, and nothing
  // resubmits one after that.
  wait_idle();
  lock_guard lock(mutex_);
  if (first_error_) std::rethrow_exception(std::exchange(first_error_, nullptr));
}

void block_store::close() {
  {
    lock_guard lock(mutex_);
    if (closed_) return;
    refuse_if_leased();
  }
  flush();  // throws a failed write-back's error: the store stays open
  lock_guard lock(mutex_);
  refuse_if_leased();  // one taken while flushing
  closed_ = true;
}

void block_store::refuse_if_leased() const {
  for (const block_record& b : blocks_) {
    const bool waited_for = std::any_of(b.waiters.begin(), b.waiters.end(), [](const auto& w) {
      return w->status.load(std::memory_order_relaxed) == detail::lease_status::pending;
    });
    if (b.leases > 0 || waited_for)
      throw user_error("block store: close() while a lease of block \"" + b.desc.name + "\" is " +
                       (b.leases > 0 ? "held" : "waited for") + " (release every lease first)");
  }
}

void block_store::refuse_if_closed(std::string_view what) const {
  if (closed_) throw user_error("block store: " + std::string(what) + "() after close()");
}

// ---- observation ---------------------------------------------------------------------

copy_state block_store::state(block_id id, tier_kind where) const {
  lock_guard lock(mutex_);
  return record(id).copies[index_of(where)].state;
}

void block_store::check_invariants() const {
  lock_guard lock(mutex_);
  check_invariants_locked();
}

void block_store::check_invariants_locked() const {
  std::array<std::uint64_t, tier_count> resident{};
  std::uint64_t transfers = 0;
  for (const block_record& b : blocks_) {
    const tier_kind home = b.desc.home;
    const copy_record& h = b.copies[index_of(home)];
    TF_ASSERT(h.storage, "a home copy lost its storage");
    TF_ASSERT(h.state == copy_state::valid || h.state == copy_state::absent ||
                  h.state == copy_state::loading,
              "a home copy is dirty");
    unsigned writers = 0, readers = 0, newest = 0, writing_back = 0;
    std::uint32_t sources = 0;
    for (tier_kind t : all_tiers) {
      const copy_record& c = b.copies[index_of(t)];
      if (c.storage) resident[index_of(t)] += b.bytes;
      if (t != home) TF_ASSERT(bool(c.storage) == (c.state != copy_state::absent),
                               "storage without a copy, or a copy without storage");
      writers += c.writer ? 1 : 0;
      readers += c.readers;
      sources += c.sources;
      if (c.state == copy_state::dirty || c.state == copy_state::writing_back) ++newest;
      if (c.state == copy_state::writing_back) ++writing_back;
      if (c.readers > 0) TF_ASSERT(holds_data(c.state), "a read lease on a copy without data");
      if (c.writer)
        TF_ASSERT(holds_data(c.state) || c.state == copy_state::loading, "a write lease on an absent copy");
      if (c.sources > 0) TF_ASSERT(holds_data(c.state), "a transfer from a copy without data");
    }
    TF_ASSERT(writers <= 1, "two writers on one block");
    if (writers == 1) TF_ASSERT(readers == 0 && b.transfers == 0, "a writer beside readers or transfers");
    TF_ASSERT(b.leases == writers + readers, "lease count out of step");
    TF_ASSERT(sources == b.transfers, "transfer count out of step");
    TF_ASSERT(writing_back <= 1, "two write-backs of one block");
    if (newest > 0) TF_ASSERT(h.state != copy_state::valid, "a dirty copy beside a current home");
    if (h.state == copy_state::absent)
      TF_ASSERT(newest > 0 || writers == 1, "a stale home with no dirty copy: data lost");
    if (h.state == copy_state::loading)
      TF_ASSERT(writing_back == 1 || h.writer, "a home loading without a write-back or an overwrite");
    transfers += b.transfers;
  }
  TF_ASSERT(transfers == transfers_in_flight_, "in-flight transfer count out of step");
  for (tier_kind t : all_tiers) {
    const auto& tr = tiers_[index_of(t)];
    if (!tr) continue;
    TF_ASSERT(resident[index_of(t)] == tr->used(), "a tier's use differs from its copies");
    TF_ASSERT(tr->used() <= tr->budget() && tr->high_water() <= tr->budget(),
              "a tier went past its budget");
  }
}

store_telemetry block_store::telemetry() const {
  store_telemetry out;
  {
    lock_guard lock(mutex_);
    out = counters_;
    out.blocks = blocks_.size();
    for (tier_kind t : all_tiers) {
      const auto& tr = tiers_[index_of(t)];
      if (!tr) continue;
      tier_telemetry x;
      x.kind = t;
      x.name = tr->name();
      x.budget = tr->budget();
      x.used = tr->used();
      x.high_water = tr->high_water();
      TF_ASSERT(x.high_water <= x.budget, "a tier went past its budget");
      x.loads = loads_[index_of(t)];
      x.evictions = evictions_[index_of(t)];
      x.details = tr->details();
      out.tiers.push_back(std::move(x));
    }
  }
  out.elapsed_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - created_at_).count();
  for (const auto& row : links_)
    for (const auto& l : row)
      if (l) out.links.push_back(l->telemetry());
  if (trace_) out.trace_events_dropped = trace_->dropped();
  return out;
}

void block_store::write_trace(std::ostream& out) const {
  if (trace_) {
    trace_->write_json(out);
  } else {
    trace_recorder empty(0);
    empty.write_json(out);
  }
}

void block_store::record_wait(const detail::lease_state& s,
                              std::chrono::steady_clock::time_point start,
                              std::chrono::steady_clock::time_point end, bool blocked) {
  std::string block_name;
  {
    lock_guard lock(mutex_);
    if (!blocked) {
      ++counters_.ready_at_wait;
      return;
    }
    ++counters_.stalls;
    counters_.stall_ns += nanoseconds(end - start);
    block_name = record(s.block).desc.name;
  }
  if (trace_) {
    trace_->record("wait " + block_name, "wait", trace_recorder::track_group::waits,
                   trace_recorder::thread_track(), start, end - start,
                   {{"tier", std::string(name(s.tier))}, {"access", std::string(name(s.mode))}});
  }
}

}  // namespace tierflow
