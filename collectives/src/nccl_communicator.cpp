// The NCCL backend (nccl.hpp): a non-blocking NCCL communicator whose
// collectives are enqueued on one stream, each completed by an event, and
// which every host wait and a watchdog thread poll for NCCL's asynchronous
// error and the timeout — the communicator is aborted (never left to hang)
// on either.

#include "tierflow/collectives/nccl.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "tierflow/collectives/watchdog.hpp"
#include "tierflow/core/cuda_error.hpp"
#include "tierflow/core/cuda_handles.hpp"
#include "tierflow/core/error.hpp"

// Windows (ncclCommWindowRegister) and CTA policies came with NCCL 2.27; the
// copy-engine policy (NCCL_CTA_POLICY_ZERO) with 2.28.3, checked below.
#if NCCL_VERSION_CODE < 22700
#error "tierflow's NCCL backend needs NCCL 2.27 or later"
#endif

namespace tierflow::collectives {

namespace {

using clock = std::chrono::steady_clock;

std::string cuda_text(cudaError_t rc) { return std::string(cudaGetErrorName(rc)) + ": " + cudaGetErrorString(rc); }

// NCCL's words for a failure: the code's, and the communicator's last error
// where it has one ("unhandled system error (run with NCCL_DEBUG=INFO for
// details): socket ... closed").
std::string nccl_text(ncclResult_t rc, ncclComm_t comm) {
  std::string text = ncclGetErrorString(rc);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += ": " + std::string(last);
  return text;
}

ncclDataType_t nccl_type(dtype t) {
  switch (t) {
    case dtype::fp32: return ncclFloat32;
    case dtype::bf16: return ncclBfloat16;
    case dtype::fp16: return ncclFloat16;
  }
  throw user_error("nccl: an unknown dtype");
}

ncclRedOp_t nccl_op(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::max: return ncclMax;
    case reduce_op::min: return ncclMin;
  }
  throw user_error("nccl: an unknown reduction");
}

// Sleeps a little longer each time, up to 1 ms: a collective that ends
// within microseconds is seen within microseconds, a long one costs a
// thousand wake-ups a second.
class backoff {
 public:
  void pause() {
    std::this_thread::sleep_for(next_);
    next_ = std::min(next_ * 2, std::chrono::microseconds(1000));
  }

 private:
  std::chrono::microseconds next_{10};
};

// Polls `comm` until its pending operation (init, a group's enqueue, a
// window's registration, finalize) leaves ncclInProgress, or `deadline`
// passes. Returns its state: ncclSuccess, an error, or ncclInProgress when
// the deadline passed first.
ncclResult_t settle(ncclComm_t comm, clock::time_point deadline) {
  backoff wait;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t rc = ncclCommGetAsyncError(comm, &state); rc != ncclSuccess) return rc;
    if (state != ncclInProgress || clock::now() >= deadline) return state;
    wait.pause();
  }
}

// Aborts `comm` (never blocks on the peers), logging rather than throwing.
void abort_comm(ncclComm_t comm) noexcept {
  // ncclInProgress: the abort goes on inside NCCL; the handle is not
  // touched again either way.
  if (const ncclResult_t rc = ncclCommAbort(comm); rc != ncclSuccess && rc != ncclInProgress)
    std::fprintf(stderr, "tierflow: warning: ncclCommAbort: %s\n", ncclGetErrorString(rc));
}

// Aborts `comm` with `device` current (NCCL's calls act on the current
// device), restoring the thread's device after; never throws.
void abort_on(int device, ncclComm_t comm) noexcept {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  (void)cudaSetDevice(device);
  abort_comm(comm);
  if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();
}

// ---- the communicator's state, shared with its work -----------------------------------------------

class nccl_work;

// Everything a work needs after the communicator's call returned: the
// NCCL handle and whether it broke. `mutex` orders every NCCL call on the
// handle (NCCL allows no two at once on one communicator) and guards the rest.
struct nccl_state {
  nccl_state(int rank_, int size_, int device_, std::chrono::milliseconds timeout_,
             std::shared_ptr<ce_telemetry> telemetry_)
      : rank(rank_), size(size_), device(device_), timeout(timeout_), telemetry(std::move(telemetry_)) {}

  const int rank, size, device;
  const std::chrono::milliseconds timeout;
  const std::shared_ptr<ce_telemetry> telemetry;

  std::mutex mutex;
  ncclComm_t comm = nullptr;  // null once aborted
  std::exception_ptr broken;
  // Issued, not yet seen finished: the watchdog's (held, so a work dropped
  // unfinished is still watched; the list ends before the communicator).
  std::vector<std::shared_ptr<nccl_work>> outstanding;
  std::vector<ncclWindow_t> windows;

  std::string who() const {
    return "nccl communicator (rank " + std::to_string(rank) + " of " + std::to_string(size) + ", cuda:" +
           std::to_string(device) + ")";
  }

  // Marks the communicator broken by `what`'s failure, settles every
  // outstanding work (done if its event already was, failed else) and
  // aborts NCCL. Needs `mutex`.
  std::exception_ptr break_locked(const std::string& what, const std::string& cause);

  // What a collective past its deadline fails with.
  std::string timed_out() const {
    return "not done after the timeout of " + std::to_string(timeout.count()) +
           " ms (a rank missing, dead or stuck); aborted";
  }

  // The watchdog's check: notes the outstanding works that have finished;
  // breaks the communicator on NCCL's asynchronous error or once one is
  // past its deadline. Whether any is still outstanding. Needs `mutex`.
  bool watch_locked();

  // Reads NCCL's asynchronous error; breaks the communicator on one.
  void poll_locked(const std::string& what) {
    if (broken || comm == nullptr) return;  // (null: finalized, every collective done)
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t rc = ncclCommGetAsyncError(comm, &state); rc != ncclSuccess) {
      break_locked(what, "ncclCommGetAsyncError: " + nccl_text(rc, comm));
    } else if (state != ncclSuccess && state != ncclInProgress) {
      break_locked(what, nccl_text(state, comm));
    }
  }
};

// One collective: done when the event recorded after it on the stream is.
class nccl_work final : public work {
 public:
  nccl_work(std::shared_ptr<nccl_state> state, std::string what, cuda_event event, clock::time_point deadline)
      : state_(std::move(state)), what_(std::move(what)), event_(std::move(event)), deadline_(deadline) {}
  // Already finished: failed (the communicator was broken when it was
  // issued), or done (a collective of nothing, which NCCL is not asked for).
  nccl_work(std::shared_ptr<nccl_state> state, std::string what, std::exception_ptr failed)
      : state_(std::move(state)), what_(std::move(what)), finished_(true), error_(std::move(failed)) {}

  bool done() const override {
    std::lock_guard lock(state_->mutex);
    return check_locked();
  }

  void wait() override {
    backoff pause;
    for (;;) {
      {
        std::lock_guard lock(state_->mutex);
        if (check_locked()) {
          if (error_) std::rethrow_exception(error_);
          return;
        }
        if (clock::now() >= deadline_) state_->break_locked(what_, state_->timed_out());
      }
      pause.pause();
    }
  }

  bool finished_locked() const noexcept { return finished_; }
  bool of(const nccl_state& state) const noexcept { return state_.get() == &state; }
  const std::string& what() const noexcept { return what_; }
  clock::time_point deadline() const noexcept { return deadline_; }
  // The event recorded after the collective (none for one finished when issued).
  cudaEvent_t event() const noexcept { return event_.get(); }
  // Throws its error if it failed. Needs the mutex, and finished.
  void rethrow_locked() const {
    if (error_) std::rethrow_exception(error_);
  }

  // Called by break_locked (under the mutex): done if the event already
  // was, before the abort that follows; failed with `failure` else.
  void settle_locked(const std::exception_ptr& failure) {
    if (finished_) return;
    if (cudaEventQuery(event_.get()) == cudaSuccess) {
      finished_ = true;
      return;
    }
    (void)cudaGetLastError();
    finished_ = true;
    error_ = failure;
  }

  // Whether it has finished; asks the event and NCCL once. Needs the mutex.
  bool check_locked() const {
    if (finished_) return true;
    const cudaError_t rc = cudaEventQuery(event_.get());
    if (rc == cudaSuccess) {
      finished_ = true;
      return true;
    }
    (void)cudaGetLastError();  // (cudaErrorNotReady is no error, but is reported like one)
    if (rc != cudaErrorNotReady) {
      state_->break_locked(what_, "cudaEventQuery: " + cuda_text(rc));
    } else {
      state_->poll_locked(what_);
    }
    if (!finished_ && state_->broken) {  // (break_locked settled it, unless it broke before this was listed)
      finished_ = true;
      error_ = state_->broken;
    }
    return finished_;
  }

  std::shared_ptr<nccl_state> state_;
  std::string what_;
  cuda_event event_;
  clock::time_point deadline_{};
  mutable bool finished_ = false;
  mutable std::exception_ptr error_;
};

std::exception_ptr nccl_state::break_locked(const std::string& what, const std::string& cause) {
  if (broken) return broken;
  const std::string message =
      who() + ": " + what + " failed: " + cause + "; the communicator is broken, every later collective fails";
  broken = std::make_exception_ptr(error(ECONNABORTED, error_context{what}.in_tier("device"), message));
  for (const auto& w : outstanding) w->settle_locked(broken);
  outstanding.clear();
  if (comm != nullptr) {
    abort_on(device, std::exchange(comm, nullptr));  // (its windows go with it)
    windows.clear();
  }
  return broken;
}

bool nccl_state::watch_locked() {
  if (broken || comm == nullptr) return false;  // (broken: every work settled; null: finalized, all done)
  std::optional<cuda_device_scope> on;  // (the events and NCCL's calls are the device's)
  try {
    on.emplace(device);
  } catch (const std::exception& e) {  // the device is gone: so is every collective on it
    break_locked(outstanding.empty() ? "watchdog" : outstanding.front()->what(), e.what());
    return false;
  }
  // A copy: a check may break the communicator, which empties the list.
  const std::vector<std::shared_ptr<nccl_work>> watched = outstanding;
  for (const auto& w : watched) {
    if (!w->check_locked() && clock::now() >= w->deadline()) break_locked(w->what(), timed_out());
    if (broken) return false;
  }
  std::erase_if(outstanding, [](const std::shared_ptr<nccl_work>& w) { return w->finished_locked(); });
  return !outstanding.empty();
}

// How often the watchdog checks the collectives under way: a tenth of the
// timeout, between 1 and 100 ms (NCCL's error is seen within that).
std::chrono::milliseconds watch_period(std::chrono::milliseconds timeout) {
  return std::clamp(timeout / 10, std::chrono::milliseconds(1), std::chrono::milliseconds(100));
}

// ---- the communicator ---------------------------------------------------------------------------

class nccl_communicator_impl final : public nccl_communicator {
 public:
  nccl_communicator_impl(const nccl_options& options, cta_policy policy, cuda_stream own, CUstream_st* stream,
                         std::shared_ptr<nccl_state> state)
      : nccl_communicator(options.device, stream, policy),
        own_(std::move(own)),
        state_(std::move(state)),
        watchdog_("tf-nccl-watch", watch_period(state_->timeout), [state = state_] {
          std::lock_guard lock(state->mutex);
          return state->watch_locked();
        }) {}

  ~nccl_communicator_impl() override {
    watchdog_.stop();  // (before NCCL's communicator ends: it polls it)
    std::lock_guard lock(state_->mutex);
    if (state_->comm == nullptr) return;  // aborted when it broke
    try {
      close_locked();
    } catch (const std::exception& e) {  // (cudaGetDevice or cudaSetDevice failed: the device is gone)
      std::fprintf(stderr, "tierflow: warning: %s: %s; aborted\n", state_->who().c_str(), e.what());
      if (state_->comm != nullptr) abort_on(device(), std::exchange(state_->comm, nullptr));
    }
  }

  // Ends NCCL's communicator — deregisters the windows, flushes what is
  // enqueued (ncclCommFinalize), then frees it, aborting instead where a
  // peer keeps that from ending within the timeout. Needs the mutex. The
  // works still listed are left to their holders (done, or failed with the
  // abort: done() asks the event).
  void close_locked() {
    const cuda_device_scope on(device());
    const auto deadline = clock::now() + state_->timeout;
    ncclComm_t comm = std::exchange(state_->comm, nullptr);
    bool clean = true;
    for (ncclWindow_t win : std::exchange(state_->windows, {})) {
      ncclResult_t rc = ncclCommWindowDeregister(comm, win);
      if (rc == ncclInProgress) rc = settle(comm, deadline);
      clean = clean && rc == ncclSuccess;
    }
    if (clean) {
      ncclResult_t rc = ncclCommFinalize(comm);
      if (rc == ncclInProgress) rc = settle(comm, deadline);
      clean = rc == ncclSuccess;
    }
    if (clean) {
      state_->outstanding.clear();  // (finalized: every one done)
      if (const ncclResult_t rc = ncclCommDestroy(comm); rc != ncclSuccess)
        std::fprintf(stderr, "tierflow: warning: ncclCommDestroy: %s\n", ncclGetErrorString(rc));
    } else {
      std::fprintf(stderr, "tierflow: warning: %s: not finalized within %lld ms; aborted\n", state_->who().c_str(),
                   static_cast<long long>(state_->timeout.count()));
      // The works not done fail (the abort ends their kernels, and their events with them).
      state_->comm = comm;
      state_->break_locked("close", "not finalized within the timeout of " +
                                        std::to_string(state_->timeout.count()) + " ms; aborted");
    }
  }

  int rank() const noexcept override { return state_->rank; }
  int size() const noexcept override { return state_->size; }
  std::string_view backend() const noexcept override { return "nccl"; }

  work_ptr all_gather(const void* in, void* out, std::span<const std::size_t> counts, dtype t) override {
    const std::vector<std::size_t> elements = checked_counts(counts, "all_gather");
    const std::size_t total = std::accumulate(elements.begin(), elements.end(), std::size_t{0});
    if (total == 0) return issue("all_gather", nullptr);  // (nothing at all: no NCCL call)
    const ncclDataType_t type = nccl_type(t);
    const std::size_t element = size_of(t);
    const bool even = std::all_of(elements.begin(), elements.end(), [&](std::size_t n) { return n == elements[0]; });
    return issue("all_gather", [=, this](ncclComm_t comm) {
      if (even) return ncclAllGather(in, out, elements[0], type, comm, stream());
      // No all-gather-v in NCCL: rank r broadcasts its shard into its slot
      // on every rank, every broadcast in one group (one launch).
      ncclResult_t rc = ncclGroupStart();
      std::size_t offset = 0;
      for (int r = 0; r < size() && rc == ncclSuccess; ++r) {
        void* slot = static_cast<std::byte*>(out) + offset * element;
        if (elements[r] != 0) rc = ncclBroadcast(r == rank() ? in : slot, slot, elements[r], type, r, comm, stream());
        offset += elements[r];
      }
      const ncclResult_t end = ncclGroupEnd();  // (ends the group even after a failed call in it)
      return rc != ncclSuccess ? rc : end;
    });
  }

  // `after` (a host read, in the engine) is waited for here, as by default.
  // Pieces side by side (or one rank's alone) are one all-gather; else one
  // broadcast a rank into its place, in one group (one launch).
  work_ptr all_gather_strided(const work_ptr& after, const void* in, void* out, std::size_t count,
                              std::size_t stride, dtype t) override {
    check_stride(*this, count, stride);
    if (after) after->wait();
    if (count == 0) return issue("all_gather", nullptr);
    const ncclDataType_t type = nccl_type(t);
    const std::size_t step = stride * size_of(t);
    return issue("all_gather", [=, this](ncclComm_t comm) {
      if (stride == count || size() == 1) return ncclAllGather(in, out, count, type, comm, stream());
      ncclResult_t rc = ncclGroupStart();
      for (int r = 0; r < size() && rc == ncclSuccess; ++r) {
        void* piece = static_cast<std::byte*>(out) + r * step;
        rc = ncclBroadcast(r == rank() ? in : piece, piece, count, type, r, comm, stream());
      }
      const ncclResult_t end = ncclGroupEnd();
      return rc != ncclSuccess ? rc : end;
    });
  }

  work_ptr reduce_scatter(const void* in, void* out, std::span<const std::size_t> counts, dtype t,
                          reduce_op op) override {
    const std::vector<std::size_t> elements = checked_counts(counts, "reduce_scatter");
    const std::size_t total = std::accumulate(elements.begin(), elements.end(), std::size_t{0});
    if (total == 0) return issue("reduce_scatter", nullptr);
    const ncclDataType_t type = nccl_type(t);
    const ncclRedOp_t nop = nccl_op(op);
    const std::size_t element = size_of(t);
    const bool even = std::all_of(elements.begin(), elements.end(), [&](std::size_t n) { return n == elements[0]; });
    return issue("reduce_scatter", [=, this](ncclComm_t comm) {
      if (even) return ncclReduceScatter(in, out, elements[0], type, nop, comm, stream());
      // No reduce-scatter-v in NCCL: one reduce per rank onto it of its
      // slice, in one group. A non-root's receive buffer is not used; it
      // gets `in` (a valid device pointer) where `out` may be empty.
      ncclResult_t rc = ncclGroupStart();
      std::size_t offset = 0;
      for (int r = 0; r < size() && rc == ncclSuccess; ++r) {
        const void* slice = static_cast<const std::byte*>(in) + offset * element;
        if (elements[r] != 0)
          rc = ncclReduce(slice, r == rank() ? out : const_cast<void*>(in), elements[r], type, nop, r, comm,
                          stream());
        offset += elements[r];
      }
      const ncclResult_t end = ncclGroupEnd();
      return rc != ncclSuccess ? rc : end;
    });
  }

  work_ptr all_reduce(void* inout, std::size_t count, dtype t, reduce_op op) override {
    if (count == 0) return issue("all_reduce", nullptr);
    const ncclDataType_t type = nccl_type(t);
    const ncclRedOp_t nop = nccl_op(op);
    return issue("all_reduce", [=, this](ncclComm_t comm) {
      return ncclAllReduce(inout, inout, count, type, nop, comm, stream());
    });
  }

  work_ptr broadcast(void* buffer, std::size_t count, dtype t, int root) override {
    if (root < 0 || root >= size())
      throw user_error("broadcast: root " + std::to_string(root) + " is not a rank of " + std::to_string(size()));
    if (count == 0) return issue("broadcast", nullptr);
    const ncclDataType_t type = nccl_type(t);
    return issue("broadcast", [=, this](ncclComm_t comm) {
      return ncclBroadcast(buffer, buffer, count, type, root, comm, stream());
    });
  }

  void stream_wait(const work_ptr& w, CUstream_st* waiter) override {
    const auto* mine = dynamic_cast<const nccl_work*>(w.get());
    if (mine == nullptr || !mine->of(*state_))
      throw user_error("nccl: stream_wait: the work is not one of this communicator's");
    std::lock_guard lock(state_->mutex);
    if (mine->check_locked()) {  // done on the GPU: nothing to wait for
      mine->rethrow_locked();
      return;
    }
    const cuda_device_scope on(device());
    TF_CUDA_CHECK(cudaStreamWaitEvent(waiter, mine->event(), 0),
                  error_context{"cudaStreamWaitEvent"}.in_tier("device").of_block(mine->what()));
  }

  bool register_window(void* buffer, std::size_t bytes) override {
    if (reinterpret_cast<std::uintptr_t>(buffer) % NCCL_WIN_REQUIRED_ALIGNMENT != 0)
      throw user_error("nccl: register_window: the buffer is not aligned to " +
                       std::to_string(NCCL_WIN_REQUIRED_ALIGNMENT) + " bytes (allocate it with nccl_memory)");
    std::lock_guard lock(state_->mutex);
    if (state_->broken) std::rethrow_exception(state_->broken);
    const cuda_device_scope on(device());
    ncclComm_t comm = state_->comm;
    ncclWindow_t win = nullptr;
    // Collective: it returns once every rank registered (or, non-blocking,
    // ncclInProgress until then).
    ncclResult_t rc = ncclCommWindowRegister(comm, buffer, bytes, &win, NCCL_WIN_COLL_SYMMETRIC);
    if (rc == ncclInProgress) rc = settle(comm, clock::now() + state_->timeout);
    if (rc == ncclSuccess) {
      state_->windows.push_back(win);
      return true;
    }
    if (state_->telemetry) state_->telemetry->window_registration_failed.fetch_add(1, std::memory_order_relaxed);
    std::fprintf(stderr, "tierflow: warning: %s: ncclCommWindowRegister of %zu bytes: %s; its collectives run on SMs\n",
                 state_->who().c_str(), bytes, nccl_text(rc, comm).c_str());
    // A refusal may leave the communicator in error (or still registering,
    // past the timeout): then it is broken like any failed collective.
    if (rc == ncclInProgress) {
      state_->break_locked("register_window", "not done after the timeout of " +
                                                  std::to_string(state_->timeout.count()) + " ms; aborted");
    } else {
      state_->poll_locked("register_window");
    }
    return false;
  }

 private:
  std::vector<std::size_t> checked_counts(std::span<const std::size_t> counts, std::string_view what) const {
    if (counts.size() != static_cast<std::size_t>(size()))
      throw user_error(std::string(what) + ": " + std::to_string(counts.size()) + " counts for " +
                       std::to_string(size()) + " ranks");
    return {counts.begin(), counts.end()};
  }

  // Enqueues one collective (`enqueue`; null for one of nothing, done at
  // once, as in the Gloo backend), waits
  // for NCCL to have enqueued it (non-blocking: ncclInProgress until the
  // kernels are on the stream, and no CUDA call may touch the stream
  // before), and records its event.
  template <typename Enqueue>
  work_ptr issue(const std::string& what, Enqueue enqueue) {
    const auto deadline = clock::now() + state_->timeout;
    std::lock_guard lock(state_->mutex);
    if (state_->broken) return std::make_shared<nccl_work>(state_, what, state_->broken);
    if constexpr (std::is_same_v<Enqueue, std::nullptr_t>) {
      return std::make_shared<nccl_work>(state_, what, std::exception_ptr{});  // (nothing to move: done)
    } else {
      const cuda_device_scope on(device());
      ncclResult_t rc = enqueue(state_->comm);
      if (rc == ncclInProgress) rc = settle(state_->comm, deadline);
      if (rc == ncclInProgress)
        return failed(what, "not enqueued within the timeout of " + std::to_string(state_->timeout.count()) +
                                " ms; aborted");
      if (rc != ncclSuccess) return failed(what, nccl_text(rc, state_->comm));
      return recorded(what, deadline);
    }
  }

  // The work of a collective just enqueued: an event recorded after it.
  // Needs the mutex, and the communicator's device current.
  work_ptr recorded(const std::string& what, clock::time_point deadline) {
    cuda_event event = cuda_event::create();
    if (const cudaError_t rc = cudaEventRecord(event.get(), stream()); rc != cudaSuccess) {
      (void)cudaGetLastError();
      return failed(what, "cudaEventRecord: " + cuda_text(rc));
    }
    auto w = std::make_shared<nccl_work>(state_, what, std::move(event), deadline);
    std::erase_if(state_->outstanding, [](const std::shared_ptr<nccl_work>& o) { return o->finished_locked(); });
    state_->outstanding.push_back(w);
    watchdog_.arm();
    return w;
  }

  work_ptr failed(const std::string& what, const std::string& cause) {
    return std::make_shared<nccl_work>(state_, what, state_->break_locked(what, cause));
  }

  cuda_stream own_;  // (declared first: destroyed after the communicator's state lets go of NCCL)
  std::shared_ptr<nccl_state> state_;
  watchdog watchdog_;  // (stopped first, in the destructor)
};

constexpr const char* unique_id_key = "/nccl_unique_id";

}  // namespace

int nccl_version() noexcept {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return 0;
  return version;
}

std::unique_ptr<nccl_communicator> make_nccl_communicator(const nccl_options& options) {
  const int rank = options.rank, size = options.size;
  if (size < 1) throw user_error("nccl: size " + std::to_string(size) + " is not a number of ranks");
  if (rank < 0 || rank >= size)
    throw user_error("nccl: rank " + std::to_string(rank) + " is not a rank of " + std::to_string(size));
  if (options.timeout <= std::chrono::milliseconds::zero())
    throw user_error("nccl: timeout " + std::to_string(options.timeout.count()) + " ms is not positive");
  if (options.prefix.empty()) throw user_error("nccl: prefix is empty");
  if (!options.store && size > 1) throw user_error("nccl: no store for a group of " + std::to_string(size) + " ranks");
  int devices = 0;
  TF_CUDA_CHECK(cudaGetDeviceCount(&devices), error_context{"cudaGetDeviceCount"}.in_tier("device"));
  if (options.device < 0 || options.device >= devices)
    throw user_error("nccl: device " + std::to_string(options.device) + " is not one of the " +
                     std::to_string(devices) + " here");

  const std::string where = "nccl rendezvous of rank " + std::to_string(rank) + " of " + std::to_string(size) +
                            " (prefix '" + options.prefix + "')";
  const auto deadline = clock::now() + options.timeout;
  const cuda_device_scope on(options.device);

  // The group's id: made by rank 0, got by the others from the store.
  ncclUniqueId id{};
  try {
  if (rank == 0) {
    if (const ncclResult_t rc = ncclGetUniqueId(&id); rc != ncclSuccess)
      throw error(ECONNABORTED, error_context{"ncclGetUniqueId"}, where + " failed: ncclGetUniqueId: " +
                                                                     nccl_text(rc, nullptr));
    if (options.store)
      options.store->set(options.prefix + unique_id_key, std::vector<char>(id.internal, id.internal + sizeof(id)));
  } else {
    const std::vector<char> got = options.store->get(options.prefix + unique_id_key);  // (blocks until rank 0 set it)
    if (got.size() != sizeof(id))
      throw error(EPROTO, error_context{"nccl rendezvous"},
                  where + " failed: the store's id is " + std::to_string(got.size()) + " bytes, not " +
                      std::to_string(sizeof(id)));
    std::memcpy(id.internal, got.data(), sizeof(id));
  }
  } catch (const error&) {
    throw;  // (the store's own, or ours, naming what failed)
  } catch (const std::exception& e) {
    throw error(ECONNABORTED, error_context{"nccl rendezvous"}, where + " failed: " + e.what());
  }

  // The policy NCCL can be given: zero only from 2.28.3 on (in the header
  // this was built with and in the library it runs with).
  cta_policy policy = options.policy;
  if (policy == cta_policy::zero && (NCCL_VERSION_CODE < nccl_copy_engine_version ||
                                     nccl_version() < nccl_copy_engine_version)) {
    if (options.telemetry) options.telemetry->zero_cta_unsupported.fetch_add(1, std::memory_order_relaxed);
    policy = cta_policy::standard;
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once, polled (and abortable) up to the timeout
#if NCCL_VERSION_CODE >= 22803
  if (policy == cta_policy::zero) config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
#endif
  if (policy == cta_policy::efficiency) config.CTAPolicy = NCCL_CTA_POLICY_EFFICIENCY;

  ncclComm_t comm = nullptr;
  ncclResult_t rc = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (rc == ncclInProgress) rc = settle(comm, deadline);
  if (rc != ncclSuccess) {
    const std::string cause = rc == ncclInProgress ? "ncclCommInitRankConfig not done after the timeout of " +
                                                         std::to_string(options.timeout.count()) +
                                                         " ms (a rank missing or stuck); aborted"
                                                   : "ncclCommInitRankConfig: " + nccl_text(rc, comm);
    if (comm != nullptr) abort_comm(comm);
    throw error(rc == ncclInProgress ? ETIMEDOUT : ECONNABORTED, error_context{"nccl rendezvous"},
                where + " failed: " + cause);
  }

  // From here the communicator owns `comm` (and aborts it if what follows throws).
  auto state = std::make_shared<nccl_state>(rank, size, options.device, options.timeout, options.telemetry);
  state->comm = comm;
  try {
    cuda_stream own;
    CUstream_st* stream = options.stream;
    if (stream == nullptr) {
      own = cuda_stream(options.device);
      stream = own.get();
    }
    return std::make_unique<nccl_communicator_impl>(options, policy, std::move(own), stream, state);
  } catch (...) {
    abort_comm(std::exchange(state->comm, nullptr));
    throw;
  }
}

// ---- NCCL's memory --------------------------------------------------------------------------------

nccl_memory nccl_memory::allocate(std::size_t bytes) {
  nccl_memory m;
  if (bytes == 0) return m;
  if (const ncclResult_t rc = ncclMemAlloc(&m.data_, bytes); rc != ncclSuccess)
    throw error(std::error_code(static_cast<int>(rc), detail::nccl_category()),
                error_context{"ncclMemAlloc"}.in_tier("device").range(0, bytes));
  m.bytes_ = bytes;
  return m;
}

nccl_memory::nccl_memory(nccl_memory&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

nccl_memory& nccl_memory::operator=(nccl_memory&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

nccl_memory::~nccl_memory() { reset(); }

void nccl_memory::reset() noexcept {
  if (!data_) return;
  if (const ncclResult_t rc = ncclMemFree(std::exchange(data_, nullptr)); rc != ncclSuccess)
    std::fprintf(stderr, "tierflow: warning: ncclMemFree: %s\n", ncclGetErrorString(rc));
  bytes_ = 0;
}

// ---- the crossover on one GPU --------------------------------------------------------------------

ce_crossover measure_ce_crossover(int device, const crossover_sweep& sweep) {
  nccl_options options;
  options.device = device;
  options.prefix = "tierflow.crossover";
  const auto nccl = make_nccl_communicator(options);
  peer_copy_group copies({device});
  const cuda_device_scope on(device);
  const error_context context = error_context{"cudaMalloc"}.in_tier("device").of_block("crossover sweep");
  const auto in = cuda_device_memory::allocate(sweep.max_bytes, context);
  const auto out = cuda_device_memory::allocate(sweep.max_bytes, context);
  // fp32 elements; the few bytes a size not a multiple of 4 would leave are not moved.
  const auto sm = [&](std::size_t bytes) {
    const std::size_t counts[1] = {bytes / 4};
    const work_ptr w = nccl->all_gather(in.get(), out.get(), counts, dtype::fp32);
    // Waited for as the copies are (cudaEventSynchronize's way, not the
    // polling wait()'s sleeps, which would add to NCCL's time).
    TF_CUDA_CHECK(cudaStreamSynchronize(nccl->stream()), error_context{"cudaStreamSynchronize"}.in_tier("device"));
    w->wait();  // (done: throws only if it failed)
  };
  const auto ce = [&](std::size_t bytes) {
    const std::size_t counts[1] = {bytes / 4};
    const void* const ins[1] = {in.get()};
    void* const outs[1] = {out.get()};
    copies.all_gather(ins, outs, counts, dtype::fp32)->wait();
  };
  const std::vector<ce_timing> timings = time_paths(sm, ce, sweep);
  return find_crossover(timings);
}

}  // namespace tierflow::collectives
