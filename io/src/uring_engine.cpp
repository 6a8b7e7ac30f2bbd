// The io_uring backend: one ring per worker thread.
//
// Each worker owns its ring outright (IORING_SETUP_SINGLE_ISSUER: only that
// thread submits or registers; DEFER_TASKRUN: completions run when it asks for
// them, not as interrupts to other threads). Requests reach a worker through a
// lock-free intrusive stack; the worker cuts them into chunks (its fixed pool
// of `queue_depth` completion objects, pointed at by each SQE's user_data),
// prepares as many SQEs as it has free chunks and enters the kernel once per
// batch: io_uring_submit_and_wait(1) submits and sleeps until something
// completes. A submitter wakes a sleeping worker by writing an eventfd that
// the ring always has a read armed on, so the worker never polls.
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include "detail/backends.hpp"
#include "detail/request.hpp"
#include "tierflow/core/thread_annotations.hpp"
#include "tierflow/io/probe.hpp"

namespace tierflow::io::detail {
namespace {

using access = operation_access;

class uring_engine;
class uring_worker;

// The worker running on this thread, if any: a submit() from a completion
// callback goes straight to the worker's own queue, no atomics, no wake-up.
thread_local uring_worker* current_worker = nullptr;

// One chunk in flight: the completion object an SQE's user_data points at.
struct chunk {
  operation* op = nullptr;
  std::uint64_t offset = 0;
  std::byte* address = nullptr;
  std::uint64_t length = 0;  // still to move
  bool direct = false;
  unsigned retries = 0;
  chunk* next_free = nullptr;
};

// A registration carried to every worker by a control operation.
struct control_request {
  enum class what { add_file, remove_file, add_buffer, remove_buffer } action;
  int slot = 0;
  int fds[2] = {-1, -1};
  iovec memory{};
};

constexpr unsigned setup_single_issuer = IORING_SETUP_SINGLE_ISSUER;
constexpr unsigned setup_defer_taskrun = IORING_SETUP_DEFER_TASKRUN;
constexpr unsigned setup_coop_taskrun = IORING_SETUP_COOP_TASKRUN;

std::string flag_names(unsigned flags) {
  std::string out;
  auto add = [&](unsigned f, const char* name) {
    if ((flags & f) == 0) return;
    if (!out.empty()) out += '|';
    out += name;
  };
  add(IORING_SETUP_SQPOLL, "SQPOLL");
  add(setup_single_issuer, "SINGLE_ISSUER");
  add(setup_defer_taskrun, "DEFER_TASKRUN");
  add(setup_coop_taskrun, "COOP_TASKRUN");
  return out.empty() ? "none" : out;
}

class uring_worker {
 public:
  uring_worker(uring_engine& owner, const engine_config& config);
  ~uring_worker();
  uring_worker(const uring_worker&) = delete;
  uring_worker& operator=(const uring_worker&) = delete;

  // Starts the thread and waits until its ring is set up; rethrows its error.
  void start();
  // Queues `op` from any thread.
  void push(operation& op);
  // Queues `op` from this worker's own thread (a completion callback).
  void push_local(operation& op);
  // Asks the worker to finish everything queued and leave; then joins it.
  void stop_and_join();

  const uring_engine* owner() const noexcept { return &owner_; }
  unsigned setup_flags() const noexcept { return setup_flags_; }
  bool files_table() const noexcept { return files_table_; }
  bool buffers_table() const noexcept { return buffers_table_; }

 private:
  void run(std::promise<void>& ready);
  void set_up_ring();
  void arm_wake();
  void wake() noexcept;
  io_uring_sqe* next_sqe();
  void take_incoming();
  void append_pending(operation& op);
  void pop_pending();
  void issue();
  void start_chunk(chunk* c);
  void on_result(chunk* c, int res);
  void reap();
  void wait_for_events();
  void run_control(operation& op);
  bool idle() const noexcept { return in_flight_ == 0 && pending_head_ == nullptr; }

  uring_engine& owner_;
  const engine_config& config_;
  fault_injector* faults_;
  io_uring ring_{};
  bool ring_ready_ = false;
  unsigned setup_flags_ = 0;
  bool files_table_ = false;
  bool buffers_table_ = false;
  unique_fd wake_fd_;
  std::uint64_t wake_value_ = 0;

  // Shared with submitters.
  std::atomic<operation*> incoming_{nullptr};  // intrusive stack, newest first
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> stop_{false};

  // Worker-private.
  std::vector<chunk> chunks_;
  chunk* free_ = nullptr;
  unsigned in_flight_ = 0;  // chunks with an SQE outstanding (the eventfd read not counted)
  operation* pending_head_ = nullptr;
  operation* pending_tail_ = nullptr;
  std::thread thread_;
};

class uring_engine final : public engine {
 public:
  explicit uring_engine(const engine_config& config) : engine(config) {
    file_slots_.assign(config_.max_registered_files, false);
    buffer_slots_.assign(config_.max_registered_buffers, false);
    workers_.reserve(config_.threads);
    for (unsigned i = 0; i < config_.threads; ++i) {
      workers_.push_back(std::make_unique<uring_worker>(*this, config_));
    }
    try {
      for (auto& w : workers_) w->start();
    } catch (...) {
      for (auto& w : workers_) w->stop_and_join();
      throw;
    }
  }

  ~uring_engine() override {
    for (auto& w : workers_) w->stop_and_join();
  }

  void submit(operation& op) override {
    access::start(op);
    if (current_worker != nullptr && current_worker->owner() == this) {
      current_worker->push_local(op);
      return;
    }
    const std::size_t n = workers_.size();
    // Relaxed: the counter only spreads requests, it orders nothing.
    const std::size_t i = n == 1 ? 0 : next_worker_.fetch_add(1, std::memory_order_relaxed) % n;
    workers_[i]->push(op);
  }

  file_registration register_file(const file& f) override {
    TF_ASSERT(current_worker == nullptr || current_worker->owner() != this,
              "register_file() from a completion callback");
    const int slot = take_slot(slot_table::files);
    if (slot < 0) throw error(ENFILE, error_context{"register file (table full)"}.at(f.path()));
    control_request request{control_request::what::add_file, slot * 2, {f.direct_fd(), f.buffered_fd()}};
    if (const int err = broadcast(request); err != 0) {
      control_request undo{control_request::what::remove_file, slot * 2};
      broadcast(undo);
      give_slot(slot_table::files, slot);
      throw error(err, error_context{"io_uring_register_files_update"}.at(f.path()));
    }
    return make_file_registration(f, slot);
  }

  buffer_registration register_buffer(std::span<std::byte> memory) override {
    TF_ASSERT(current_worker == nullptr || current_worker->owner() != this,
              "register_buffer() from a completion callback");
    const int index = take_slot(slot_table::buffers);
    if (index < 0) throw error(ENOBUFS, error_context{"register buffer (table full)"}.range(0, memory.size()));
    bool tables = true;
    for (auto& w : workers_) tables = tables && w->buffers_table();
    // The kernel takes at most 1 GiB per registered buffer; bigger ones (and
    // rings without a buffer table) move their data with plain READ/WRITE.
    if (!tables || memory.size() > (std::size_t{1} << 30) || memory.empty()) {
      return make_buffer_registration(memory, index, false);
    }
    control_request request{control_request::what::add_buffer, index};
    request.memory = iovec{memory.data(), memory.size()};
    if (const int err = broadcast(request); err != 0) {
      control_request undo{control_request::what::remove_buffer, index};
      broadcast(undo);
      give_slot(slot_table::buffers, index);
      throw error(err, error_context{"io_uring_register_buffers_update"}.range(0, memory.size()));
    }
    return make_buffer_registration(memory, index, true);
  }

  backend_kind backend() const noexcept override { return backend_kind::uring; }

  std::string describe() const override {
    const uring_worker& w = *workers_.front();
    return "io_uring: " + std::to_string(workers_.size()) + " ring(s), queue depth " +
           std::to_string(config_.queue_depth) + ", block " + std::to_string(config_.block_size) +
           ", setup " + flag_names(w.setup_flags()) + ", registered files " +
           (w.files_table() ? "yes" : "no") + ", registered buffers " + (w.buffers_table() ? "yes" : "no");
  }

 protected:
  void unregister_file(const file&, int slot) noexcept override {
    control_request request{control_request::what::remove_file, slot * 2};
    broadcast(request);
    give_slot(slot_table::files, slot);
  }
  void unregister_buffer(int index) noexcept override {
    control_request request{control_request::what::remove_buffer, index};
    bool tables = true;
    for (auto& w : workers_) tables = tables && w->buffers_table();
    if (tables) broadcast(request);
    give_slot(slot_table::buffers, index);
  }

 private:
  enum class slot_table { files, buffers };
  std::vector<bool>& slots_of(slot_table t) TF_REQUIRES(slots_mutex_) {
    return t == slot_table::files ? file_slots_ : buffer_slots_;
  }
  int take_slot(slot_table t) {
    lock_guard lock(slots_mutex_);
    std::vector<bool>& slots = slots_of(t);
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (!slots[i]) {
        slots[i] = true;
        return static_cast<int>(i);
      }
    }
    return -1;
  }
  void give_slot(slot_table t, int i) noexcept {
    lock_guard lock(slots_mutex_);
    slots_of(t)[static_cast<std::size_t>(i)] = false;
  }

  // Runs `request` on every worker's thread (registration must come from the
  // ring's single issuer); returns the first errno, 0 when all succeeded.
  int broadcast(const control_request& request) noexcept {
    std::vector<control_request> copies(workers_.size(), request);
    std::unique_ptr<operation[]> ops(new operation[workers_.size()]);
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      access::prepare_control(ops[i], reinterpret_cast<std::uintptr_t>(&copies[i]));
      access::start(ops[i]);
      workers_[i]->push(ops[i]);
    }
    int first = 0;
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      ops[i].wait_quietly();
      if (first == 0) first = ops[i].errnum();
    }
    return first;
  }

  std::vector<std::unique_ptr<uring_worker>> workers_;
  std::atomic<std::size_t> next_worker_{0};
  mutex slots_mutex_;
  std::vector<bool> file_slots_ TF_GUARDED_BY(slots_mutex_);
  std::vector<bool> buffer_slots_ TF_GUARDED_BY(slots_mutex_);
};

// ---- worker -------------------------------------------------------------------

uring_worker::uring_worker(uring_engine& owner, const engine_config& config)
    : owner_(owner), config_(config), faults_(config.faults.get()), chunks_(config.queue_depth) {
  for (chunk& c : chunks_) {
    c.next_free = free_;
    free_ = &c;
  }
}

uring_worker::~uring_worker() { TF_ASSERT(!thread_.joinable(), "uring_worker destroyed while running"); }

void uring_worker::start() {
  std::promise<void> ready;
  std::future<void> started = ready.get_future();
  // The promise moves into the thread: set_value() must not race with its destruction here.
  thread_ = std::thread([this, promise = std::move(ready)]() mutable { run(promise); });
  try {
    started.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

void uring_worker::stop_and_join() {
  if (!thread_.joinable()) return;
  stop_.store(true, std::memory_order_release);
  // Unconditional: the worker may be about to sleep, and the eventfd read it
  // keeps armed turns this write into a completion that wakes it.
  wake();
  thread_.join();
}

void uring_worker::wake() noexcept {
  const std::uint64_t one = 1;
  while (::write(wake_fd_.get(), &one, sizeof one) < 0 && errno == EINTR) {
  }
}

void uring_worker::set_up_ring() {
  const uring_capabilities& caps = probe_uring();
  auto has = [&](const char* flag) {
    auto it = caps.setup_flags.find(flag);
    return it != caps.setup_flags.end() && it->second;
  };
  // Most wanted first; each is tried and EINVAL falls through to the next.
  std::vector<unsigned> candidates;
  if (config_.sqpoll) {
    if (has("single_issuer")) candidates.push_back(IORING_SETUP_SQPOLL | setup_single_issuer);
    candidates.push_back(IORING_SETUP_SQPOLL);
  }
  if (has("defer_taskrun")) candidates.push_back(setup_single_issuer | setup_defer_taskrun);
  if (has("single_issuer") && has("coop_taskrun")) candidates.push_back(setup_single_issuer | setup_coop_taskrun);
  if (has("coop_taskrun")) candidates.push_back(setup_coop_taskrun);
  candidates.push_back(0);

  // One SQE per chunk plus the eventfd read: the SQ can never overflow, and
  // the CQ (twice the SQ) can hold every completion that can be outstanding.
  const unsigned entries = config_.queue_depth + 1;
  int rc = -EINVAL;
  for (unsigned flags : candidates) {
    io_uring_params params{};
    params.flags = flags;
    if (flags & IORING_SETUP_SQPOLL) params.sq_thread_idle = config_.sqpoll_idle_ms;
    rc = io_uring_queue_init_params(entries, &ring_, &params);
    if (rc == 0) {
      setup_flags_ = flags;
      break;
    }
    if (rc != -EINVAL && rc != -EPERM) break;  // EPERM: SQPOLL without the privilege
  }
  TF_CHECK_ERRNO_RESULT(rc, error_context{"io_uring_queue_init"});
  ring_ready_ = true;
  // Fewer fd lookups per io_uring_enter; harmless where unsupported.
  (void)io_uring_register_ring_fd(&ring_);
  files_table_ = io_uring_register_files_sparse(&ring_, config_.max_registered_files * 2) == 0;
  buffers_table_ = io_uring_register_buffers_sparse(&ring_, config_.max_registered_buffers) == 0;

  wake_fd_ = unique_fd(TF_CHECK_SYSCALL(::eventfd(0, EFD_CLOEXEC), error_context{"eventfd"}));
  arm_wake();
}

io_uring_sqe* uring_worker::next_sqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {
    // Cannot happen with the sizes above; a submit makes room if it ever does.
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
  }
  TF_ASSERT(sqe != nullptr, "io_uring submission queue full");
  return sqe;
}

void uring_worker::arm_wake() {
  io_uring_sqe* sqe = next_sqe();
  io_uring_prep_read(sqe, wake_fd_.get(), &wake_value_, sizeof wake_value_, 0);
  io_uring_sqe_set_data(sqe, this);  // the worker itself tags the wake-up
}

void uring_worker::run(std::promise<void>& ready) {
  try {
    set_up_ring();
  } catch (...) {
    if (ring_ready_) io_uring_queue_exit(&ring_);
    ready.set_exception(std::current_exception());
    return;
  }
  current_worker = this;
  ready.set_value();

  for (;;) {
    take_incoming();
    issue();
    // Acquire: pairs with stop_and_join()'s release; everything submitted
    // before the stop is in `incoming_` by then (submit happens-before ~engine).
    if (idle() && stop_.load(std::memory_order_acquire) &&
        incoming_.load(std::memory_order_acquire) == nullptr) {
      break;
    }
    wait_for_events();
    reap();
  }
  current_worker = nullptr;
  io_uring_queue_exit(&ring_);  // cancels the armed eventfd read
}

void uring_worker::push(operation& op) {
  operation* head = incoming_.load(std::memory_order_relaxed);
  do {
    access::next(op) = head;
    // Release: the worker's acquire exchange in take_incoming() sees the
    // prepared operation (and everything its submitter wrote before).
  } while (!incoming_.compare_exchange_weak(head, &op, std::memory_order_release, std::memory_order_relaxed));
  // Dekker with the worker's way to sleep (wait_for_events): we published the
  // request, then look at `sleeping_`; it published `sleeping_`, then looks at
  // the queue. The two seq_cst fences make sure at least one side sees the
  // other: either the worker finds this request, or we wake it.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_relaxed) && sleeping_.exchange(false, std::memory_order_relaxed)) {
    wake();
  }
}

void uring_worker::push_local(operation& op) { append_pending(op); }

void uring_worker::append_pending(operation& op) {
  access::next(op) = nullptr;
  access::in_queue(op) = true;
  if (pending_tail_ != nullptr) access::next(*pending_tail_) = &op;
  else pending_head_ = &op;
  pending_tail_ = &op;
}

void uring_worker::pop_pending() {
  operation* op = pending_head_;
  pending_head_ = access::next(*op);
  if (pending_head_ == nullptr) pending_tail_ = nullptr;
  access::next(*op) = nullptr;
  access::in_queue(*op) = false;
}

void uring_worker::take_incoming() {
  if (incoming_.load(std::memory_order_relaxed) == nullptr) return;
  // Acquire: pairs with push()'s release CAS.
  operation* list = incoming_.exchange(nullptr, std::memory_order_acquire);
  operation* fifo = nullptr;  // reverse the stack: first submitted, first served
  while (list != nullptr) {
    operation* next = access::next(*list);
    access::next(*list) = fifo;
    fifo = list;
    list = next;
  }
  while (fifo != nullptr) {
    operation* next = access::next(*fifo);
    if (fifo->kind() == op_kind::control) run_control(*fifo);
    else append_pending(*fifo);
    fifo = next;
  }
}

void uring_worker::run_control(operation& op) {
  const auto& request = *reinterpret_cast<const control_request*>(access::control(op));
  int rc = 0;
  switch (request.action) {
    case control_request::what::add_file:
    case control_request::what::remove_file: {
      if (!files_table_) break;  // requests use plain descriptors here
      int fds[2] = {-1, -1};
      if (request.action == control_request::what::add_file) {
        fds[0] = request.fds[0];
        fds[1] = request.fds[1];
      }
      rc = io_uring_register_files_update(&ring_, static_cast<unsigned>(request.slot), fds, 2);
      rc = rc < 0 ? rc : 0;
      break;
    }
    case control_request::what::add_buffer:
    case control_request::what::remove_buffer: {
      if (!buffers_table_) {
        rc = -EOPNOTSUPP;
        break;
      }
      // A NULL, zero-length iovec empties the slot.
      const iovec memory = request.action == control_request::what::add_buffer ? request.memory : iovec{};
      rc = io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(request.slot), &memory, nullptr, 1);
      rc = rc < 0 ? rc : 0;
      break;
    }
  }
  access::set_errnum(op, -rc);
  access::complete(op);
}

void uring_worker::issue() {
  while (free_ != nullptr && pending_head_ != nullptr) {
    operation& op = *pending_head_;
    std::uint64_t& issued = access::issued(op);
    if (issued == op.length()) {  // empty, or failed while still queued
      pop_pending();
      if (access::chunks_in_flight(op) == 0) access::complete(op);
      continue;
    }
    const chunk_plan plan = plan_chunk(op, issued, config_.block_size);
    issued += plan.length;
    ++access::chunks_in_flight(op);
    if (issued == op.length()) pop_pending();

    chunk* c = free_;
    free_ = c->next_free;
    c->op = &op;
    c->offset = plan.offset;
    c->address = plan.address;
    c->length = plan.length;
    c->direct = plan.direct;
    c->retries = 0;
    start_chunk(c);
    // Hand a batch to the kernel while the rest of the queue is refilled: the
    // device starts on these instead of idling until every SQE is prepared
    // (on a busy queue this wins more than the syscalls it costs).
    if (config_.submit_batch != 0 && io_uring_sq_ready(&ring_) >= config_.submit_batch) {
      const int rc = io_uring_submit(&ring_);
      // A failed enter leaves the SQEs queued; wait_for_events() submits them again.
      (void)rc;
    }
  }
}

void uring_worker::start_chunk(chunk* c) {
  operation& op = *c->op;
  const file& f = *op.target();
  std::uint64_t length = c->length;
  bool direct = c->direct;
  if (faults_ != nullptr) [[unlikely]] {
    const fault_decision fault = faults_->decide(op.kind(), f.path(), c->offset, c->length);
    if (fault.errnum != 0) {
      on_result(c, -fault.errnum);  // as if the kernel had said so
      return;
    }
    if (fault.length < length) {
      length = fault.length;
      if (direct) {
        const std::uint64_t aligned = length - length % file::offset_alignment;
        if (aligned != 0) length = aligned;
        else direct = false;
      }
    }
  }
  io_uring_sqe* sqe = next_sqe();
  int fd = direct ? f.direct_fd() : f.buffered_fd();
  const int slot = files_table_ ? f.registered_slot(&owner_) : -1;
  if (slot >= 0) fd = slot * 2 + (direct ? 0 : 1);
  const buffer_registration* registration = access::registration(op);
  const bool fixed = registration != nullptr && registration->fixed() && registration->owner() == &owner_;
  const auto len = static_cast<unsigned>(length);  // ≤ block_size ≤ 1 GiB
  if (op.kind() == op_kind::read) {
    if (fixed) io_uring_prep_read_fixed(sqe, fd, c->address, len, c->offset, registration->index());
    else io_uring_prep_read(sqe, fd, c->address, len, c->offset);
  } else {
    if (fixed) io_uring_prep_write_fixed(sqe, fd, c->address, len, c->offset, registration->index());
    else io_uring_prep_write(sqe, fd, c->address, len, c->offset);
  }
  if (slot >= 0) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data(sqe, c);
  ++in_flight_;
}

void uring_worker::on_result(chunk* c, int res) {
  operation& op = *c->op;
  const bool reading = op.kind() == op_kind::read;
  if (res < 0) {
    // EINTR / EAGAIN: the same piece again, a bounded number of times.
    if ((res == -EINTR || res == -EAGAIN) && ++c->retries < max_retries) {
      start_chunk(c);
      return;
    }
    access::fail(op, -res, c->offset, c->length);
  } else if (res == 0) {
    // End of file for a read (never zeros); a write that makes no progress.
    access::fail(op, reading ? ENODATA : EIO, c->offset, c->length, reading);
  } else {
    const auto done = static_cast<std::uint64_t>(res);
    TF_ASSERT(done <= c->length, "io_uring completed more than was asked");
    access::add_transferred(op, done);
    if (done < c->length && !access::has_failed(op)) {
      // Short: resubmit the remainder; it stays on O_DIRECT only if still aligned.
      c->offset += done;
      c->address += done;
      c->length -= done;
      c->direct = c->direct && aligned_for_direct(*op.target(), c->offset, c->address, c->length);
      c->retries = 0;
      start_chunk(c);
      return;
    }
  }
  c->op = nullptr;
  c->next_free = free_;
  free_ = c;
  if (--access::chunks_in_flight(op) == 0 && access::issued(op) == op.length() && !access::in_queue(op)) {
    access::complete(op);
  }
}

void uring_worker::wait_for_events() {
  int rc;
  if (free_ == nullptr) {
    // Every chunk is in flight: nothing queued can start before one of them
    // completes, so wait for that (a pusher need not wake us).
    rc = io_uring_submit_and_wait(&ring_, 1);
  } else if (incoming_.load(std::memory_order_relaxed) != nullptr) {
    // More work already queued: do not sleep, but do run the completions
    // (with DEFER_TASKRUN they are only posted when we ask for events).
    rc = io_uring_submit_and_get_events(&ring_);
  } else {
    sleeping_.store(true, std::memory_order_relaxed);
    // Pairs with the fence in push(); see there.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (incoming_.load(std::memory_order_relaxed) != nullptr) {
      sleeping_.store(false, std::memory_order_relaxed);
      rc = io_uring_submit_and_get_events(&ring_);
    } else {
      // Submits the batch and sleeps in the kernel until a completion (an
      // I/O, or the eventfd read a submitter's wake() completes) is posted.
      rc = io_uring_submit_and_wait(&ring_, 1);
      sleeping_.store(false, std::memory_order_relaxed);
    }
  }
  // EINTR: a signal; EAGAIN/EBUSY: the kernel is short of resources or the CQ
  // must be drained first — reap() and come back. Anything else means the
  // ring itself is broken, which no request can recover from.
  if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME) {
    std::fprintf(stderr, "tierflow: io_uring_enter: %s\n", std::strerror(-rc));
    TF_ASSERT(false, "io_uring_enter failed");
  }
}

void uring_worker::reap() {
  io_uring_cqe* cqes[64];
  for (;;) {
    const unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, 64);
    if (n == 0) return;
    struct result {
      void* data;
      int res;
    } results[64];
    for (unsigned i = 0; i < n; ++i) results[i] = {io_uring_cqe_get_data(cqes[i]), cqes[i]->res};
    // Free the CQ slots before acting on them: acting submits more.
    io_uring_cq_advance(&ring_, n);
    for (unsigned i = 0; i < n; ++i) {
      if (results[i].data == this) {
        arm_wake();  // whatever the eventfd read returned, keep one armed
        continue;
      }
      --in_flight_;
      on_result(static_cast<chunk*>(results[i].data), results[i].res);
    }
    if (n < 64) return;
  }
}

}  // namespace

std::unique_ptr<engine> make_uring_engine(const engine_config& config) {
  return std::make_unique<uring_engine>(config);
}

}  // namespace tierflow::io::detail
