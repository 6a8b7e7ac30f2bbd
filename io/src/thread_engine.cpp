// The thread-pool backend: pread/pwrite on a pool of threads, for where
// io_uring is unavailable (seccomp, an old kernel, kernel.io_uring_disabled)
// or not wanted. Same chunking and the same failure semantics as io_uring:
// the threads take chunks of the queue's front request, so one large request
// is spread over every thread.
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "detail/backends.hpp"
#include "detail/request.hpp"
#include "tierflow/core/thread_annotations.hpp"

namespace tierflow::io::detail {
namespace {

using access = operation_access;

// What became of one chunk.
struct chunk_result {
  int errnum = 0;
  bool past_end = false;
  std::uint64_t failed_offset = 0;
  std::uint64_t failed_length = 0;
  std::uint64_t transferred = 0;
};

class thread_engine final : public engine {
 public:
  // threads × queue_depth pool threads (at most 256): each synchronous call is
  // one request in flight, so the same settings keep the same number of
  // requests in flight as on io_uring.
  explicit thread_engine(const engine_config& config) : engine(config) {
    const unsigned pool = std::min(config_.threads * config_.queue_depth, max_pool);
    threads_.reserve(pool);
    for (unsigned i = 0; i < pool; ++i) threads_.emplace_back([this] { run(); });
  }

  ~thread_engine() override {
    {
      lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_.notify_all();
    // The threads drain the queue before they leave: nothing submitted is dropped.
    for (std::thread& t : threads_) t.join();
  }

  void submit(operation& op) override {
    access::start(op);
    {
      lock_guard lock(mutex_);
      access::next(op) = nullptr;
      access::in_queue(op) = true;
      if (tail_ != nullptr) access::next(*tail_) = &op;
      else head_ = &op;
      tail_ = &op;
    }
    work_.notify_one();
  }

  file_registration register_file(const file& f) override {
    return make_file_registration(f, -1);  // nothing to register for pread/pwrite
  }
  buffer_registration register_buffer(std::span<std::byte> memory) override {
    return make_buffer_registration(memory, -1, false);
  }
  backend_kind backend() const noexcept override { return backend_kind::threads; }
  std::string describe() const override {
    return "threads: " + std::to_string(threads_.size()) + " pread/pwrite thread(s), block " +
           std::to_string(config_.block_size);
  }

 protected:
  void unregister_file(const file&, int) noexcept override {}
  void unregister_buffer(int) noexcept override {}

 private:
  void pop_front() TF_REQUIRES(mutex_) {
    operation* op = head_;
    head_ = access::next(*op);
    if (head_ == nullptr) tail_ = nullptr;
    access::next(*op) = nullptr;
    access::in_queue(*op) = false;
  }

  void run() {
    unique_lock lock(mutex_);
    for (;;) {
      while (head_ == nullptr && !stopping_) lock.wait(work_);
      if (head_ == nullptr) return;  // stopping, and nothing left
      operation& op = *head_;
      std::uint64_t& issued = access::issued(op);
      if (issued == op.length()) {  // empty, or failed while queued
        pop_front();
        if (access::chunks_in_flight(op) == 0) {
          lock.unlock();
          access::complete(op);
          lock.lock();
        }
        continue;
      }
      const chunk_plan plan = plan_chunk(op, issued, config_.block_size);
      issued += plan.length;
      ++access::chunks_in_flight(op);
      if (issued == op.length()) pop_front();
      if (head_ != nullptr) work_.notify_one();  // more chunks for another thread
      lock.unlock();

      const chunk_result r = transfer(op, plan);

      lock.lock();
      if (r.errnum != 0) {
        // Only the queue's front can have chunks in flight and still be queued.
        if (access::in_queue(op)) pop_front();
        access::fail(op, r.errnum, r.failed_offset, r.failed_length, r.past_end);
      }
      access::add_transferred(op, r.transferred);
      if (--access::chunks_in_flight(op) == 0 && issued == op.length() && !access::in_queue(op)) {
        lock.unlock();
        access::complete(op);
        lock.lock();
      }
    }
  }

  // Moves one chunk with pread/pwrite, resubmitting the remainder of short
  // transfers and retrying EINTR/EAGAIN; stops at the first error.
  chunk_result transfer(const operation& op, chunk_plan c) {
    const file& f = *op.target();
    const bool reading = op.kind() == op_kind::read;
    chunk_result r;
    unsigned retries = 0;
    while (c.length > 0) {
      std::uint64_t length = c.length;
      bool direct = c.direct;
      ssize_t n;
      int err = 0;
      fault_decision fault{};
      if (config_.faults) fault = config_.faults->decide(op.kind(), f.path(), c.offset, c.length);
      if (fault.errnum != 0) {
        n = -1;
        err = fault.errnum;
      } else {
        if (fault.length != 0 && fault.length < length) {
          length = fault.length;
          if (direct) {
            const std::uint64_t aligned = length - length % file::offset_alignment;
            if (aligned != 0) length = aligned;
            else direct = false;
          }
        }
        const int fd = direct ? f.direct_fd() : f.buffered_fd();
        n = reading ? ::pread(fd, c.address, length, static_cast<off_t>(c.offset))
                    : ::pwrite(fd, c.address, length, static_cast<off_t>(c.offset));
        if (n < 0) err = errno;  // captured at once
      }
      if (n < 0) {
        if ((err == EINTR || err == EAGAIN) && ++retries < max_retries) continue;
        r.errnum = err;
      } else if (n == 0) {
        // End of file for a read; a write that makes no progress is an I/O error.
        r.errnum = reading ? ENODATA : EIO;
        r.past_end = reading;
      }
      if (r.errnum != 0) {
        r.failed_offset = c.offset;
        r.failed_length = c.length;
        return r;
      }
      const auto done = static_cast<std::uint64_t>(n);
      r.transferred += done;
      c.offset += done;
      c.address += done;
      c.length -= done;
      c.direct = c.direct && aligned_for_direct(f, c.offset, c.address, c.length);
      retries = 0;
    }
    return r;
  }

  static constexpr unsigned max_pool = 256;
  mutex mutex_;
  std::condition_variable work_;
  operation* head_ TF_GUARDED_BY(mutex_) = nullptr;
  operation* tail_ TF_GUARDED_BY(mutex_) = nullptr;
  bool stopping_ TF_GUARDED_BY(mutex_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<engine> make_thread_engine(const engine_config& config) {
  return std::make_unique<thread_engine>(config);
}

}  // namespace tierflow::io::detail
