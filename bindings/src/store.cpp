// tierflow._core.Store, Lease and PrefetchScheduler: the block store (tiers
// with budgets, the blocks homed in them, leases on their copies) and core's
// schedule-driven prefetcher, as a Python engine (ZeRO-3's hooks) drives them
// around each module's forward and backward. The logic stays in C++; what is
// here is argument parsing, lifetimes and the GIL.
//
// Lifetimes: the block_store lives in a store_state shared by the Store, its
// schedulers and every Lease taken from it, so whichever goes last frees it —
// a Lease that outlives its Store still ends against a live store, and the
// store's destructor (which requires every lease ended) runs only after the
// last Lease did. An array a lease's wait() returned keeps the Lease object
// (and so the tier's memory) alive, but its bytes belong to the lease only
// until it is released; that is documented, not enforced.
//
// Threads: no call holds the GIL while it waits, whether for the store's lock,
// a load or a write-back. Each Lease and each PrefetchScheduler has a mutex
// (taken with the GIL released, held for bookkeeping only, never while
// taking the GIL); core's scheduler is single-threaded by contract, so
// every call into it is under its mutex. A lease's wait() blocks outside the
// lease's mutex, counted in `waiting_`, so that another thread's `ready` does
// not block behind it; releasing a lease that a thread waits on is refused.
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "bindings.hpp"
#include "work.hpp"
#include "tierflow/core/block.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/lease.hpp"
#include "tierflow/core/scheduler.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/core/thread_annotations.hpp"
#include "tierflow/core/tier.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {

// bindings.hpp's contract; the dict is tierflow.config's AioConfig.engine_options().
io::engine_config parse_engine_options(const nb::dict& options) {
  io::engine_config c;
  for (auto [key, value] : options) {
    const std::string name = nb::cast<std::string>(nb::isinstance<nb::str>(key) ? nb::str(key) : nb::repr(key));
    const std::string where = "aio." + name;
    std::uint64_t v = 0;
    if (nb::isinstance<nb::bool_>(value) || !nb::isinstance<nb::int_>(value) || !nb::try_cast(value, v))
      throw user_error(where + ": " + nb::cast<std::string>(nb::repr(value)) + " is not a whole number");
    auto in = [&](std::uint64_t low, std::uint64_t high) {
      if (v < low || v > high)
        throw user_error(where + ": " + std::to_string(v) + " is not in " + std::to_string(low) + ".." +
                         std::to_string(high));
    };
    if (name == "block_size") {
      if (v == 0 || v % 4096 != 0 || v > (1u << 30))
        throw user_error(where + ": " + std::to_string(v) + " is not a multiple of 4096 between 4 KiB and 1 GiB");
      c.block_size = v;
    } else if (name == "queue_depth") {
      in(1, 4096);
      c.queue_depth = static_cast<unsigned>(v);
    } else if (name == "threads") {
      in(1, 256);
      c.threads = static_cast<unsigned>(v);
    } else if (name == "submit_batch") {
      in(0, 4096);
      c.submit_batch = static_cast<unsigned>(v);
    } else {
      throw user_error(where + ": unknown key (block_size, queue_depth, threads, submit_batch)");
    }
  }
  io::validate(c);  // the engine's own checks: the same ranges
  return c;
}

nb::dict engine_options_of(const io::engine_config& c) {
  nb::dict out;
  out["block_size"] = c.block_size;
  out["queue_depth"] = c.queue_depth;
  out["threads"] = c.threads;
  out["submit_batch"] = c.submit_batch;
  return out;
}

namespace {

constexpr std::uint64_t default_file_size = 256ull << 20;  // nvme_tier_options' default

access parse_access(const std::string& text) {
  for (access a : {access::read, access::write, access::overwrite})
    if (text == name(a)) return a;
  throw user_error("mode: unknown mode '" + text + "' (expected read, write or overwrite)");
}

traffic_class parse_traffic(const std::string& text) {
  for (std::size_t k = 0; k < traffic_class_count; ++k) {
    const auto c = static_cast<traffic_class>(k);
    if (text == name(c)) return c;
  }
  throw user_error("traffic: unknown traffic class '" + text +
                   "' (expected demand, prefetch, writeback or optimizer_stream)");
}

tiers::device_backend parse_backend(const std::string& text) {
  if (text == "auto") return tiers::device_backend::automatic;
  if (text == "cuda") return tiers::device_backend::cuda;
  if (text == "stand_in") return tiers::device_backend::stand_in;
  throw user_error("device_backend: unknown backend '" + text + "' (expected auto, cuda or stand_in)");
}

dirty dirty_of(bool d) { return d ? dirty::yes : dirty::no; }

// The store and what the bindings know of it, shared by the Store, its
// schedulers and its leases (see the top of this file). Immutable once made;
// block_store is thread-safe.
struct store_state {
  std::unique_ptr<block_store> store;
  int cuda_device = -1;  // the device tier's CUDA device; -1 for a stand-in or no device tier
};

class scheduler_handle;

// tierflow._core.Lease: one core lease, granted by a Store or a
// PrefetchScheduler (`granter_`), and the bytes it was granted.
class lease_handle {
 public:
  // Made with the GIL released (it reads the block's name under the store's
  // lock); a scheduler's lease gets the reference that keeps its granter
  // alive afterwards, from hold_granter().
  lease_handle(std::shared_ptr<const store_state> state, lease granted, scheduler_handle* granter)
      : state_(std::move(state)),
        granter_(granter),
        block_(granted.block()),
        tier_(granted.tier()),
        mode_(granted.mode()),
        memory_(state_->store->tier_of(tier_).memory()),
        block_name_(state_->store->describe(block_).name) {
    // A scheduler's lease comes granted (the scheduler waited for it); its
    // wait() must not wait, and count, a second time.
    if (granter_ != nullptr) {
      data_ = granted.data();
      granted_ = true;
    }
    lease_ = std::move(granted);
  }

  ~lease_handle() {
    nb::gil_scoped_release unlocked;  // ending the lease takes the store's lock
    {
      lock_guard lock(mutex_);
      wait_copies();
      lease_ = lease();  // releases it clean if it was not (withdraws it if never granted)
    }
    state_.reset();  // perhaps the last owner: the store then waits for its transfers
  }
  lease_handle(const lease_handle&) = delete;
  lease_handle& operator=(const lease_handle&) = delete;

  // Blocks (GIL released) until granted; the copy's bytes as an array (see
  // the docstring in bind_store), None for a file tier's copy.
  nb::object wait() TF_EXCLUDES(mutex_) {
    std::span<std::byte> bytes;
    {
      nb::gil_scoped_release unlocked;
      bool granted = false;
      {
        lock_guard lock(mutex_);
        refuse_if_released("wait");
        granted = granted_;
        if (granted) {
          bytes = data_;
        } else {
          ++waiting_;
        }
      }
      if (!granted) bytes = wait_for_grant();
    }
    return array_over(bytes);
  }

  nb::object data() TF_EXCLUDES(mutex_) {
    std::span<std::byte> bytes;
    {
      nb::gil_scoped_release unlocked;
      lock_guard lock(mutex_);
      refuse_if_released("data");
      if (!granted_)
        throw user_error("Lease.data: " + label() + " has not been granted yet (call wait() first)");
      bytes = data_;
    }
    return array_over(bytes);
  }

  bool ready() TF_EXCLUDES(mutex_) {
    nb::gil_scoped_release unlocked;
    lock_guard lock(mutex_);
    if (released_) return false;
    return granted_ || lease_.ready();
  }

  // Starts a copy of the granted copy's bytes into `out` (see the docstring).
  py_work copy_into(buffer& out, const std::string& traffic, std::optional<std::uint64_t> offset)
      TF_EXCLUDES(mutex_) {
    const traffic_class cls = parse_traffic(traffic);
    auto copied = std::make_shared<collectives::signalled_work>();
    {
      nb::gil_scoped_release unlocked;
      lock_guard lock(mutex_);
      refuse_if_released("copy_into");
      if (!granted_)
        throw user_error("Lease.copy_into: " + label() + " has not been granted yet (call wait() first)");
      const std::span<std::byte> into{static_cast<std::byte*>(out.data()), out.nbytes()};
      auto finish = [copied](std::exception_ptr e) { copied->finish(std::move(e)); };
      if (offset) state_->store->copy_out(lease_, *offset, into, cls, std::move(finish));
      else state_->store->copy_out(lease_, into, cls, std::move(finish));
      copies_.push_back(copied);
    }
    return {copied, std::nullopt, out};
  }

  std::uint32_t block() const noexcept { return block_.value; }
  std::string tier() const { return std::string(name(tier_)); }
  std::string mode() const { return std::string(name(mode_)); }
  bool released() TF_EXCLUDES(mutex_) {
    lock_guard lock(mutex_);
    return released_;
  }

  // Ends it through whoever granted it (the scheduler tracks its leases).
  void release(bool d);
  // Ends it against the store; refused for a scheduler's lease.
  void release_to_store(bool d, const char* caller) TF_EXCLUDES(mutex_) {
    if (granter_ != nullptr)
      throw user_error(std::string(caller) + ": " + label() +
                       " was granted by PrefetchScheduler.acquire; release it with "
                       "PrefetchScheduler.release (or Lease.release)");
    nb::gil_scoped_release unlocked;
    lease l = take(d, caller);
    state_->store->release(std::move(l), dirty_of(d));
  }

  // Hands the core lease over for its release, once: refuses a second
  // release, one while another thread waits on it, and a dirty release the
  // store would take for a bug (a read lease, or one never granted).
  lease take(bool d, const char* caller) TF_EXCLUDES(mutex_) {
    lock_guard lock(mutex_);
    refuse_if_released(caller);
    if (waiting_ > 0)
      throw user_error(std::string(caller) + ": " + label() +
                       " is being waited on by another thread (release it after wait() returned)");
    if (d && mode_ == access::read)
      throw user_error(std::string(caller) + ": dirty=True for " + label() +
                       ", a read lease (acquire it with mode='write' or 'overwrite' to change its bytes)");
    if (d && !granted_)
      throw user_error(std::string(caller) + ": dirty=True for " + label() +
                       ", which was never granted (wait() did not return its bytes), so nothing was written");
    wait_copies();
    released_ = true;
    data_ = {};
    return std::move(lease_);
  }

  void hold_granter(nb::object granter) { granter_object_ = std::move(granter); }

  const store_state* store() const noexcept { return state_.get(); }
  const scheduler_handle* granter() const noexcept { return granter_; }

  // "the lease of block "l0.w" in tier device"
  std::string label() const {
    return "the lease of block \"" + block_name_ + "\" in tier " + std::string(name(tier_));
  }

  std::string repr() TF_EXCLUDES(mutex_) {
    std::string status;
    {
      lock_guard lock(mutex_);
      status = released_ ? "released" : granted_ ? "granted" : lease_.ready() ? "ready" : "pending";
    }
    return "<tierflow Lease of block " + std::to_string(block_.value) + " (\"" + block_name_ +
           "\") in " + std::string(name(tier_)) + ", " + std::string(name(mode_)) + ", " + status + ">";
  }

 private:
  void refuse_if_released(const char* what) const TF_REQUIRES(mutex_) {
    if (released_)
      throw user_error("Lease." + std::string(what) + ": " + label() + " was released already");
  }

  // The wait itself, outside the mutex: while waiting_ > 0, take() refuses to
  // move lease_ away, and nothing else writes it, so reading it here races
  // with nothing (the analysis cannot follow that counter).
  std::span<std::byte> wait_for_grant() TF_EXCLUDES(mutex_) TF_NO_THREAD_SAFETY_ANALYSIS {
    std::span<std::byte> bytes;
    try {
      bytes = lease_.wait();  // throws the failed load's error, naming the block
    } catch (...) {
      lock_guard lock(mutex_);
      --waiting_;
      throw;
    }
    lock_guard lock(mutex_);
    --waiting_;
    granted_ = true;
    data_ = bytes;
    return bytes;
  }

  // A view of the copy's bytes owned by this Lease's Python object: CPU
  // memory as a NumPy array, CUDA memory as a DLPack array on its device.
  nb::object array_over(std::span<std::byte> bytes) {
    if (memory_ == memory_kind::file) return nb::none();
    const nb::object owner = nb::find(this);  // the Python Lease this method was called on
    const std::size_t shape[1] = {bytes.size()};
    if (memory_ == memory_kind::device) {
      return nb::ndarray<nb::array_api, std::uint8_t, nb::ndim<1>>(
                 bytes.data(), 1, shape, owner, nullptr, nb::dtype<std::uint8_t>(),
                 nb::device::cuda::value, state_->cuda_device)
          .cast();
    }
    return nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>>(bytes.data(), 1, shape, owner).cast();
  }

  // The lease ends only once its copies out have: they read its copy.
  // Their errors are for their Works to raise.
  void wait_copies() TF_REQUIRES(mutex_) {
    for (const auto& c : copies_) {
      try {
        c->wait();
      } catch (...) {
      }
    }
    copies_.clear();
  }

  std::shared_ptr<const store_state> state_;
  scheduler_handle* const granter_;  // null: granted by the Store
  nb::object granter_object_;        // keeps the granting scheduler alive for release()
  const block_id block_;
  const tier_kind tier_;
  const access mode_;
  const memory_kind memory_;
  const std::string block_name_;  // for messages, without the store's lock

  mutable mutex mutex_;
  lease lease_ TF_GUARDED_BY(mutex_);
  std::span<std::byte> data_ TF_GUARDED_BY(mutex_);  // once granted
  bool granted_ TF_GUARDED_BY(mutex_) = false;         // wait() returned the bytes
  bool released_ TF_GUARDED_BY(mutex_) = false;
  unsigned waiting_ TF_GUARDED_BY(mutex_) = 0;         // threads inside wait_for_grant()
  std::vector<collectives::work_ptr> copies_ TF_GUARDED_BY(mutex_);  // copy_into's, until the release
};

class store_handle {
 public:
  store_handle(std::uint64_t host_budget, const std::optional<std::string>& nvme_dir,
               std::uint64_t nvme_budget, std::uint64_t device_budget,
               const std::string& device_backend, bool trace, bool checksums,
               std::uint64_t file_size, bool single_holder, const std::optional<nb::dict>& aio) {
    const tiers::device_backend backend = parse_backend(device_backend);
    // Options without their tier would be read and ignored: refuse them.
    if (!nvme_dir) {
      if (nvme_budget != 0) throw user_error("nvme_budget: given without nvme_dir");
      if (checksums) throw user_error("checksums: given without nvme_dir (they cover NVMe blocks)");
      if (file_size != default_file_size) throw user_error("file_size: given without nvme_dir");
      if (aio) throw user_error("aio: given without nvme_dir (it configures the NVMe tier's I/O engine)");
    }
    const io::engine_config io = aio ? parse_engine_options(*aio) : io::engine_config{};
    if (device_budget == 0 && backend != tiers::device_backend::automatic)
      throw user_error("device_backend: '" + device_backend + "' given without device_budget");
    if (file_size == 0) throw user_error("file_size: 0 (each NVMe file must hold at least one block)");

    tiers::store_config config;
    config.host = tiers::host_tier_options{.budget = host_budget};
    if (nvme_dir)
      config.nvme = tiers::nvme_tier_options{
          .directory = *nvme_dir, .budget = nvme_budget, .file_size = file_size, .checksums = checksums, .io = io};
    if (device_budget != 0)
      config.device = tiers::device_tier_options{.budget = device_budget, .backend = backend};
    config.store.trace = trace;
    config.store.holder = single_holder ? lease_holder::waiting_thread : lease_holder::any_thread;
    auto state = std::make_shared<store_state>();
    {
      nb::gil_scoped_release unlocked;  // maps and touches the host region, probes the directory
      state->store = tiers::make_store(std::move(config));
      if (state->store->has_tier(tier_kind::device)) {
        const tier& device = state->store->tier_of(tier_kind::device);
        if (device.memory() == memory_kind::device) state->cuda_device = std::stoi(device.details().at("device"));
      }
    }
    state_ = std::move(state);
    if (nvme_dir) io_ = io;
  }

  ~store_handle() {
    nb::gil_scoped_release unlocked;  // the store waits for the transfers in flight
    state_.reset();
  }
  store_handle(const store_handle&) = delete;
  store_handle& operator=(const store_handle&) = delete;

  // Creates a block of `size_bytes` homed in `home` ("host" or "nvme").
  std::uint32_t create_block(const std::string& name, std::uint64_t size_bytes,
                             const std::string& home) {
    block_desc desc{.name = name, .size_bytes = size_bytes, .home = parse_tier_kind(home, "home")};
    nb::gil_scoped_release unlocked;  // an NVMe home may preallocate a file
    return store().create_block(std::move(desc)).value;
  }

  std::size_t block_count() const {
    nb::gil_scoped_release unlocked;
    return store().block_count();
  }

  std::vector<std::string> tiers() const {
    std::vector<std::string> out;
    for (std::size_t k = 0; k < tier_count; ++k) {
      const auto kind = static_cast<tier_kind>(k);  // fastest first: the enum's order
      if (store().has_tier(kind)) out.emplace_back(name(kind));
    }
    return out;
  }

  bool device_is_cuda() const noexcept { return state_->cuda_device >= 0; }

  // The I/O engine the NVMe tier was built with, or None without one.
  std::optional<nb::dict> io_config() const {
    if (!io_) return std::nullopt;
    return engine_options_of(*io_);
  }

  std::optional<std::uint32_t> find(const std::string& name) const {
    std::optional<block_id> id;
    {
      nb::gil_scoped_release unlocked;
      id = store().find(name);
    }
    if (!id) return std::nullopt;
    return id->value;
  }

  nb::dict describe(std::uint32_t block) const {
    const block_desc* desc = nullptr;
    {
      nb::gil_scoped_release unlocked;
      desc = &store().describe(block_id{block});  // valid for the store's life
    }
    nb::dict out;
    out["name"] = desc->name;
    out["size_bytes"] = desc->size_bytes;
    out["home"] = std::string(name(desc->home));
    return out;
  }

  std::unique_ptr<lease_handle> acquire(std::uint32_t block, const std::string& tier,
                                        const std::string& mode, const std::string& traffic) {
    const tier_kind where = parse_tier_kind(tier, "tier");
    const access how = parse_access(mode);
    const traffic_class cls = parse_traffic(traffic);
    nb::gil_scoped_release unlocked;  // the store's lock; a device allocation
    return std::make_unique<lease_handle>(state_, store().acquire(block_id{block}, where, how, cls),
                                          nullptr);
  }

  void release(lease_handle& l, bool d) {
    if (l.store() != state_.get())
      throw user_error("Store.release: " + l.label() + " was taken from another Store");
    l.release_to_store(d, "Store.release");
  }

  void prefetch(std::uint32_t block, const std::string& tier, const std::string& traffic) {
    const tier_kind where = parse_tier_kind(tier, "tier");
    const traffic_class cls = parse_traffic(traffic);
    nb::gil_scoped_release unlocked;
    store().prefetch(block_id{block}, where, cls);
  }

  void evict(std::uint32_t block, const std::string& tier) {
    const tier_kind where = parse_tier_kind(tier, "tier");
    nb::gil_scoped_release unlocked;
    store().evict(block_id{block}, where);
  }

  void flush() {
    nb::gil_scoped_release unlocked;  // waits for every write-back
    store().flush();
  }

  void close() {
    nb::gil_scoped_release unlocked;  // flushes first
    store().close();
  }

  std::string state(std::uint32_t block, const std::string& tier) const {
    const tier_kind where = parse_tier_kind(tier, "tier");
    nb::gil_scoped_release unlocked;
    return std::string(name(store().state(block_id{block}, where)));
  }

  // The store's counters, as the JSON the CLI prints, parsed into a dict.
  nb::dict telemetry() const {
    std::string json;
    {
      nb::gil_scoped_release unlocked;
      json = store().telemetry_json();
    }
    return nb::cast<nb::dict>(nb::module_::import_("json").attr("loads")(json));
  }

  void write_trace(const std::string& path) const {
    nb::gil_scoped_release unlocked;  // a long run's trace is large
    errno = 0;
    std::ofstream out(path);
    // errno is what open(2) set; a failure without one is still an I/O error.
    if (!out) throw error(errno != 0 ? errno : EIO, error_context{"open"}.at(path));
    store().write_trace(out);
    if (!out.flush()) throw error(errno != 0 ? errno : EIO, error_context{"write"}.at(path));
  }

  const std::shared_ptr<const store_state>& shared() const noexcept { return state_; }

 private:
  block_store& store() const { return *state_->store; }

  std::shared_ptr<const store_state> state_;
  std::optional<io::engine_config> io_;  // the NVMe tier's, as built
};

// tierflow._core.PrefetchScheduler: core's prefetch_scheduler over a Store,
// one call at a time (its contract), with the GIL released while it waits.
class scheduler_handle {
 public:
  scheduler_handle(const store_handle& store, std::size_t max_lookahead, std::size_t min_lookahead,
                   double budget_share, std::size_t evict_distance, double staging_share)
      : state_(store.shared()),
        scheduler_(std::make_unique<prefetch_scheduler>(
            *state_->store, scheduler_options{.max_lookahead = max_lookahead,
                                              .min_lookahead = min_lookahead,
                                              .budget_share = budget_share,
                                              .evict_distance = evict_distance,
                                              .staging_share = staging_share})) {}

  ~scheduler_handle() {
    nb::gil_scoped_release unlocked;
    scheduler_.reset();  // before the store it refers to
    state_.reset();
  }
  scheduler_handle(const scheduler_handle&) = delete;
  scheduler_handle& operator=(const scheduler_handle&) = delete;

  void set_schedule(const std::vector<std::tuple<std::uint32_t, std::string, std::string>>& given)
      TF_EXCLUDES(mutex_) {
    std::vector<block_access> accesses;
    accesses.reserve(given.size());
    for (const auto& [block, tier, mode] : given)
      accesses.push_back({block_id{block}, parse_tier_kind(tier, "tier"), parse_access(mode)});
    nb::gil_scoped_release unlocked;
    lock_guard lock(mutex_);
    // The positions of the leases out in this iteration index the schedule.
    if (in_iteration_)
      throw user_error("PrefetchScheduler.set_schedule: inside an iteration (call it before "
                       "begin_iteration() or after end_iteration())");
    scheduler_->set_schedule(std::move(accesses));
  }

  std::vector<std::tuple<std::uint32_t, std::string, std::string>> schedule() TF_EXCLUDES(mutex_) {
    std::vector<block_access> copy;
    {
      nb::gil_scoped_release unlocked;
      lock_guard lock(mutex_);
      copy = scheduler_->schedule();
    }
    std::vector<std::tuple<std::uint32_t, std::string, std::string>> out;
    out.reserve(copy.size());
    for (const block_access& a : copy)
      out.emplace_back(a.block.value, std::string(name(a.where)), std::string(name(a.mode)));
    return out;
  }

  void begin_iteration() TF_EXCLUDES(mutex_) {
    nb::gil_scoped_release unlocked;  // reads the telemetry, hints the first prefetches
    lock_guard lock(mutex_);
    if (in_iteration_)
      throw user_error("PrefetchScheduler.begin_iteration: called twice without end_iteration()");
    scheduler_->begin_iteration();
    in_iteration_ = true;
  }

  std::unique_ptr<lease_handle> acquire(std::uint32_t block, const std::string& tier,
                                        const std::string& mode) TF_EXCLUDES(mutex_) {
    const tier_kind where = parse_tier_kind(tier, "tier");
    const access how = parse_access(mode);
    std::unique_ptr<lease_handle> granted;
    {
      nb::gil_scoped_release unlocked;  // waits for the copy
      lock_guard lock(mutex_);
      if (!in_iteration_)
        throw user_error("PrefetchScheduler.acquire: outside begin_iteration()/end_iteration()");
      granted = std::make_unique<lease_handle>(state_, scheduler_->acquire(block_id{block}, where, how), this);
    }
    granted->hold_granter(nb::find(this));
    return granted;
  }

  void release(lease_handle& l, bool d) TF_EXCLUDES(mutex_) {
    if (l.granter() != this)
      throw user_error("PrefetchScheduler.release: " + l.label() +
                       (l.granter() == nullptr
                            ? " was taken with Store.acquire; release it with Store.release"
                            : " was granted by another PrefetchScheduler"));
    nb::gil_scoped_release unlocked;
    lease taken = l.take(d, "PrefetchScheduler.release");
    lock_guard lock(mutex_);
    scheduler_->release(std::move(taken), dirty_of(d));
  }

  void end_iteration() TF_EXCLUDES(mutex_) {
    nb::gil_scoped_release unlocked;
    lock_guard lock(mutex_);
    if (!in_iteration_)
      throw user_error("PrefetchScheduler.end_iteration: called without begin_iteration()");
    scheduler_->end_iteration();
    in_iteration_ = false;
  }

  nb::dict stats() TF_EXCLUDES(mutex_) {
    scheduler_stats s;
    {
      nb::gil_scoped_release unlocked;
      lock_guard lock(mutex_);
      s = scheduler_->stats();
    }
    const auto seconds = [](std::chrono::nanoseconds d) { return std::chrono::duration<double>(d).count(); };
    nb::dict out;
    out["iterations"] = s.iterations;
    out["rerecords"] = s.rerecords;
    out["accesses"] = s.accesses;
    out["stalled_accesses"] = s.stalled_accesses;
    out["stall_seconds"] = seconds(s.stall);
    out["last_iteration_stall_seconds"] = seconds(s.last_iteration_stall);
    out["lookahead"] = s.lookahead;
    nb::list per_access;
    for (const auto d : s.per_access_stall) per_access.append(seconds(d));
    out["per_access_stall_seconds"] = per_access;
    return out;
  }

 private:
  std::shared_ptr<const store_state> state_;
  mutex mutex_;
  std::unique_ptr<prefetch_scheduler> scheduler_ TF_PT_GUARDED_BY(mutex_);  // set for the object's life
  bool in_iteration_ TF_GUARDED_BY(mutex_) = false;  // core asserts on a misplaced call: checked here first
};

void lease_handle::release(bool d) {
  if (granter_ != nullptr) {
    granter_->release(*this, d);
  } else {
    release_to_store(d, "Lease.release");
  }
}

}  // namespace

void bind_store(nb::module_& m) {
  nb::class_<lease_handle>(m, "Lease",
      "The right to use one block's copy in one tier, from Store.acquire or\n"
      "PrefetchScheduler.acquire. While held, the copy stays in its tier. wait()\n"
      "gives its bytes; release() (or leaving a `with` block) ends it. A Lease\n"
      "dropped without release() is released clean.")
      // Any: a NumPy array, a DLPack array or None, by the tier (see the docstring).
      .def("wait", &lease_handle::wait, nb::sig("def wait(self) -> typing.Any"),
           "Blocks until the lease is granted (the GIL released) and returns the copy's bytes:\n"
           "a uint8 array of the block's size_bytes over the copy itself, never a copy of it — a\n"
           "NumPy array for the host tier and the device stand-in, a DLPack array on the right\n"
           "CUDA device for the CUDA device tier (torch.from_dlpack views either), None for a\n"
           "file tier (NVMe), whose copy has no address. The array is valid only until the lease\n"
           "is released: its memory then goes back to the tier. Write to it only under a 'write'\n"
           "or 'overwrite' lease. On the CUDA tier, the kernels torch queued on it must have\n"
           "finished before the release (the store's copies and frees run on their own streams).\n"
           "Raises the load's error (TierflowError naming the block, the file, the errno) when\n"
           "the copy could not be made; a later acquire tries again.")
      .def_prop_ro("data", &lease_handle::data, nb::sig("def data(self) -> typing.Any"),
                   "The array wait() returned, once it has (ValueError before, or after release).")
      .def_prop_ro("ready", &lease_handle::ready,
                   "Whether wait() would return at once (with the bytes, or by raising the load's\n"
                   "error); False once released.")
      .def_prop_ro("released", &lease_handle::released, "Whether the lease was released.")
      .def("copy_into", &lease_handle::copy_into, "out"_a, "traffic"_a = "demand", nb::kw_only(),
           "offset"_a = nb::none(),
           "Starts copying the granted copy's bytes into `out`, CPU memory of the caller's (a\n"
           "C-contiguous tensor or array of at least the block's size rounded up to whole 4 KiB\n"
           "pages, starting on a page boundary), over the link from this tier to the host tier:\n"
           "from NVMe, a read straight into `out` (no copy in the host tier), counted in the\n"
           "nvme->host link's telemetry. Returns a Work at once (its wait() raises the read's\n"
           "error, naming the block and the file); the release waits for it. `traffic`: the\n"
           "class it runs in. `offset` (bytes): copy only the part of the block from there on\n"
           "that fills `out` (both in whole pages, within the block), so a pipeline can start on\n"
           "the first part; refused for a store whose checksums cover NVMe blocks (a part cannot\n"
           "be checked). A lease not granted (wait() first), a host-tier lease (read its\n"
           "bytes) or `out` too small, misaligned or past the block is a ValueError.")
      .def_prop_ro("block", &lease_handle::block, "The block's id.")
      .def_prop_ro("tier", &lease_handle::tier, "The tier of the copy: 'device', 'host' or 'nvme'.")
      .def_prop_ro("mode", &lease_handle::mode, "'read', 'write' or 'overwrite'.")
      .def("release", &lease_handle::release, "dirty"_a = false,
           "Ends the lease through whoever granted it (Store or PrefetchScheduler). dirty=True\n"
           "(a granted 'write' or 'overwrite' lease only) makes this copy the block's newest\n"
           "bytes; they reach the home tier on evict() or flush(). Releasing twice, dirty=True\n"
           "for a read lease or one never granted, or a lease another thread waits on is a\n"
           "ValueError.")
      .def("__enter__", [](lease_handle& l) -> lease_handle& { return l; }, nb::rv_policy::reference,
           "Returns the lease itself.")
      .def("__exit__",
           [](lease_handle& l, nb::handle, nb::handle, nb::handle) {
             if (!l.released()) l.release(false);
           },
           "exc_type"_a.none(), "exc_value"_a.none(), "traceback"_a.none(),
           "Releases the lease clean unless it was released in the block (release(dirty=True)\n"
           "there to keep what was written).")
      .def("__repr__", &lease_handle::repr);

  nb::class_<store_handle>(m, "Store",
      "A block store: a host tier of `host_budget` bytes; with `nvme_dir`, an NVMe tier of\n"
      "`nvme_budget` bytes of files preallocated in that directory (`file_size` bytes each,\n"
      "`checksums` verifying every block read back); with `device_budget`, a device tier of\n"
      "that many bytes. Every tier can load from every other. Blocks are created homed in\n"
      "host or nvme and leased into any tier with acquire(); no tier ever holds more than\n"
      "its budget. Leases and schedulers keep the store's memory alive, so it is freed when\n"
      "the last of them goes; close() ends its use.")
      .def(nb::init<std::uint64_t, const std::optional<std::string>&, std::uint64_t, std::uint64_t,
                    const std::string&, bool, bool, std::uint64_t, bool, const std::optional<nb::dict>&>(),
           "host_budget"_a, "nvme_dir"_a = nb::none(), "nvme_budget"_a = 0, "device_budget"_a = 0,
           "device_backend"_a = "auto", "trace"_a = false, "checksums"_a = false,
           "file_size"_a = default_file_size, "single_holder"_a = false, "aio"_a = nb::none(),
           "device_backend: 'auto' (the CUDA pool when a GPU is present, else the host stand-in),\n"
           "'cuda' (ValueError without a CUDA device) or 'stand_in' (plain host memory with the\n"
           "device's budget). trace: record every transfer and wait for write_trace().\n"
           "single_holder: every lease is held by the thread that waits on it (a single-threaded\n"
           "engine), so no lease ends while that thread waits: a Lease.wait() (or\n"
           "PrefetchScheduler.acquire) whose copy needs room that only the release of a held lease\n"
           "could make (leased copies fill the tier, or fragment it so the block fits no free\n"
           "piece, and no transfer or eviction will free more) raises TierflowError with errno\n"
           "EDEADLK naming the block, the tier, its budget, use and largest free piece, and the\n"
           "blocks whose leases hold it, instead of waiting for ever. Without it such a wait ends\n"
           "when another thread releases a lease. aio: the NVMe tier's I/O engine, a dict of\n"
           "block_size, queue_depth, threads and submit_batch (each optional), as a DeepSpeed\n"
           "config's aio section sets them (None: the engine's own defaults). Raises\n"
           "ValueError for a zero budget, an option without its tier, an unknown backend or a bad\n"
           "aio value (naming aio.<key>),\n"
           "TierflowError when the host memory cannot be mapped or nvme_dir cannot be used.")
      .def("create_block", &store_handle::create_block, "name"_a, "size_bytes"_a, "home"_a = "host",
           "Creates a block of `size_bytes` homed in `home` ('host' or 'nvme') and returns its id.\n"
           "Its bytes are unspecified until written (acquire it with mode='overwrite'). Raises\n"
           "BudgetError when the home tier's budget cannot hold it, TierflowError when its\n"
           "storage cannot be made (e.g. ENOSPC preallocating its NVMe file), ValueError for a\n"
           "name in use or a tier the store lacks.")
      .def_prop_ro("block_count", &store_handle::block_count, "How many blocks the store has.")
      .def_prop_ro("tiers", &store_handle::tiers, "The tiers present, fastest first: of 'device', 'host', 'nvme'.")
      .def("io_config", &store_handle::io_config,
           "The I/O engine the NVMe tier was built with: {'block_size', 'queue_depth', 'threads',\n"
           "'submit_batch'}; None without an NVMe tier.")
      .def_prop_ro("device_is_cuda", &store_handle::device_is_cuda,
                   "Whether the device tier is CUDA memory (False for the stand-in or no device tier).")
      .def("find", &store_handle::find, "name"_a, "The id of the block named `name`, or None.")
      .def("describe", &store_handle::describe, "block"_a,
           "{'name', 'size_bytes', 'home'} of a block (ValueError for an unknown id).")
      .def("acquire", &store_handle::acquire, "block"_a, "tier"_a = "device", "mode"_a = "read",
           "traffic"_a = "demand",
           "Asks for `block`'s copy in `tier` and returns a Lease at once; wait() on it for the\n"
           "bytes. mode: 'read' (shared), 'write' (exclusive; the bytes loaded first) or\n"
           "'overwrite' (exclusive; not loaded: write every byte). traffic: the class the load\n"
           "queues in ('demand', 'prefetch', 'writeback', 'optimizer_stream'). Loads the copy\n"
           "from the nearest tier holding the bytes, evicting unleased copies (least recently\n"
           "used first, dirty ones written back) for room; waits while leases hold the budget.\n"
           "Raises BudgetError when the block can never fit in the tier, ValueError for an\n"
           "unknown block, tier, mode or traffic, a write lease on NVMe, or after close().")
      .def("release", &store_handle::release, "lease"_a, "dirty"_a = false,
           "Ends a lease from this Store's acquire() (see Lease.release). A lease from a\n"
           "PrefetchScheduler or another Store is a ValueError.")
      .def("prefetch", &store_handle::prefetch, "block"_a, "tier"_a, "traffic"_a = "prefetch",
           "Hint: starts loading `block` into `tier` if it is absent and fits without evicting\n"
           "dirty or leased copies; otherwise dropped (counted in telemetry). Never blocks.")
      .def("evict", &store_handle::evict, "block"_a, "tier"_a,
           "Hint: drops `block`'s copy in `tier` (not its home) once no lease holds it, writing it\n"
           "back home first when dirty. Never blocks.")
      .def("flush", &store_handle::flush,
           "Writes every dirty copy back to its home tier and waits (GIL released). Raises the\n"
           "first error (TierflowError) of a transfer since the last flush, a load's included; a\n"
           "copy whose write-back failed stays dirty, so flush() can be called again.")
      .def("close", &store_handle::close,
           "flush(), then refuses new blocks and leases. Raises ValueError naming a block whose\n"
           "lease is still held or waited for (nothing is closed then: release it and call\n"
           "close() again), or flush()'s error. Calling it again after it succeeded does nothing.")
      .def("state", &store_handle::state, "block"_a, "tier"_a,
           "The state of `block`'s copy in `tier`: 'absent', 'loading', 'valid', 'dirty' or\n"
           "'writing_back' (a snapshot).")
      .def("telemetry", &store_handle::telemetry,
           "The store's counters: per tier (budget, used and high-water bytes, loads, evictions),\n"
           "per link (bytes, busy time, per traffic class), acquires and stall time.")
      .def("write_trace", &store_handle::write_trace, "path"_a,
           "Writes the trace of every transfer and blocking wait as Chrome trace_event JSON\n"
           "(ui.perfetto.dev loads it) to `path`; empty unless the store was made with trace=True.\n"
           "Raises TierflowError (errno, filename) when the file cannot be written.");

  nb::class_<scheduler_handle>(m, "PrefetchScheduler",
      "Schedule-driven prefetch over a Store, for a training loop: each iteration is an\n"
      "ordered list of accesses (given with set_schedule, or recorded from the first\n"
      "iteration and re-recorded when the order changes). At each acquire it hints the next\n"
      "accesses within a lookahead computed from measured link bandwidth and compute time\n"
      "(bounded by `budget_share` of the tier's budget and [min_lookahead, max_lookahead]),\n"
      "and on release evicts copies whose next use is further than `evict_distance` accesses\n"
      "(0: the lookahead). With `staging_share`, blocks homed on NVMe and used in the device\n"
      "tier are also read into the host tier ahead of use, within that share of the host\n"
      "tier's room beside the blocks homed there (even with budget_share 0), and a staged copy\n"
      "is evicted after its use unless used again soon. One thread drives it; calls from\n"
      "others wait their turn. It keeps its Store alive.")
      .def(nb::init<const store_handle&, std::size_t, std::size_t, double, std::size_t, double>(),
           nb::keep_alive<1, 2>(), "store"_a, "max_lookahead"_a = 64, "min_lookahead"_a = 1,
           "budget_share"_a = 0.75, "evict_distance"_a = 0, "staging_share"_a = 0.0,
           "budget_share 0 turns prefetch off (every access on demand); staging_share 0 turns\n"
           "staging off. Raises ValueError unless 1 <= min_lookahead <= max_lookahead and both\n"
           "shares are in [0, 1].")
      .def("set_schedule", &scheduler_handle::set_schedule, "accesses"_a,
           "Gives the iteration's accesses as (block, tier, mode) tuples, in order. Raises\n"
           "ValueError for an unknown block, tier or mode, or inside an iteration.")
      .def_prop_ro("schedule", &scheduler_handle::schedule,
                   "The accesses of an iteration as (block, tier, mode), given or recorded.")
      .def("begin_iteration", &scheduler_handle::begin_iteration,
           "Starts an iteration: recomputes the lookahead and prefetches the first accesses.")
      .def("acquire", &scheduler_handle::acquire, "block"_a, "tier"_a = "device", "mode"_a = "read",
           "The iteration's next access: prefetches ahead, waits for the copy (GIL released; the\n"
           "wait is the stall it measures) and returns the granted Lease. An access off the\n"
           "schedule is served on demand and the iteration is re-recorded. Release the lease\n"
           "with release() here (or Lease.release). Raises the load's error, BudgetError, or\n"
           "ValueError outside begin_iteration()/end_iteration().")
      .def("release", &scheduler_handle::release, "lease"_a, "dirty"_a = false,
           "Ends a lease from this scheduler's acquire() (dirty as in Lease.release) and evicts\n"
           "the copy when its next use lies beyond the horizon. A lease from Store.acquire or\n"
           "another scheduler is a ValueError.")
      .def("end_iteration", &scheduler_handle::end_iteration,
           "Ends the iteration; adopts its order as the schedule when it departed from it.")
      .def_prop_ro("stats", &scheduler_handle::stats,
                   "iterations, rerecords (iterations whose order changed), accesses,\n"
                   "stalled_accesses, stall_seconds, last_iteration_stall_seconds, lookahead (the\n"
                   "current one, in accesses) and per_access_stall_seconds (the last iteration's).");
}

}  // namespace tierflow::python
