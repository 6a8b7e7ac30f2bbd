// What both backends share: how a request is cut into chunks, how a chunk's
// result is judged, and how an operation is completed and handed back.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <utility>

#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/io/engine.hpp"
#include "tierflow/io/file.hpp"
#include "tierflow/io/operation.hpp"

namespace tierflow::io::detail {

// The operation whose completion callback this thread is running, and
// whether that callback submitted it again. complete() asks this, not the
// operation: once resubmitted, the operation may complete on another engine
// thread, and its owner free it, before the callback even returns.
struct callback_frame {
  const operation* op = nullptr;
  bool resubmitted = false;
};
inline thread_local callback_frame current_callback;

// The engines' access to an operation's private progress fields.
struct operation_access {
  static operation*& next(operation& op) { return op.next_; }
  static std::uint64_t& issued(operation& op) { return op.issued_; }
  static std::uint32_t& chunks_in_flight(operation& op) { return op.chunks_in_flight_; }
  static bool& in_queue(operation& op) { return op.in_queue_; }
  static std::uintptr_t& control(operation& op) { return op.control_; }
  static const buffer_registration* registration(const operation& op) { return op.registration_; }
  // Turns `op` into a control request carrying `argument` (engine-internal).
  static void prepare_control(operation& op, std::uintptr_t argument) {
    op.kind_ = op_kind::control;
    op.file_ = nullptr;
    op.length_ = 0;
    op.data_ = nullptr;
    op.registration_ = nullptr;
    op.callback_ = nullptr;
    op.control_ = argument;
  }
  static void set_errnum(operation& op, int errnum) { op.errnum_ = errnum; }

  // Marks `op` queued; called by engine::submit before the engine sees it.
  static void start(operation& op) {
    const std::uint32_t state = op.state_.load(std::memory_order_relaxed);
    TF_ASSERT(state != operation::state_queued, "operation submitted while in flight");
    TF_ASSERT(op.kind_ == op_kind::control || op.file_ != nullptr, "operation submitted before prepare_*()");
    op.errnum_ = 0;
    op.transferred_ = 0;
    op.error_ = nullptr;
    op.issued_ = 0;
    op.chunks_in_flight_ = 0;
    op.in_queue_ = false;
    op.past_end_ = false;
    op.next_ = nullptr;
    // Relaxed is enough: the hand-off to the engine thread (a queue push with
    // release) orders these writes.
    op.state_.store(operation::state_queued, std::memory_order_relaxed);
    if (current_callback.op == &op) current_callback.resubmitted = true;
  }

  // Records a chunk's success.
  static void add_transferred(operation& op, std::uint64_t bytes) { op.transferred_ += bytes; }

  // Records the first failure of `op`: nothing more of it is issued.
  static void fail(operation& op, int errnum, std::uint64_t offset, std::uint64_t length,
                   bool past_end = false) {
    if (op.errnum_ == 0) {
      op.errnum_ = errnum;
      op.failed_offset_ = offset;
      op.failed_length_ = length;
      op.past_end_ = past_end;
    }
    op.issued_ = op.length_;
  }
  static bool has_failed(const operation& op) { return op.errnum_ != 0; }

  // Completes `op`: builds its error, runs its callback, and (unless the
  // callback resubmitted it) publishes it to waiters. After this returns the
  // engine must not touch `op`.
  static void complete(operation& op) noexcept {
    if (op.errnum_ != 0 && op.kind_ != op_kind::control) {
      try {
        error_context context{op.kind_ == op_kind::read ? (op.past_end_ ? "read past end of file" : "read")
                                                        : "write"};
        context.at(op.file_->path()).range(op.offset_, op.length_);
        if (op.failed_offset_ != op.offset_ || op.failed_length_ != op.length_) {
          context.operation += " (failed at offset " + std::to_string(op.failed_offset_) + ", length " +
                               std::to_string(op.failed_length_) + ")";
        }
        op.error_ = std::make_exception_ptr(error(op.errnum_, std::move(context)));
      } catch (...) {
        op.error_ = std::current_exception();  // std::bad_alloc: still a failure
      }
    }
    if (op.callback_ != nullptr) {
      op.state_.store(operation::state_completing, std::memory_order_relaxed);
      // A callback that resubmitted the operation handed it to an engine
      // again (possibly already running, or done, on another thread): hands
      // off without touching it. submit() in the callback runs on this
      // thread and marks the frame (an outer completion's is restored).
      const callback_frame outer = std::exchange(current_callback, callback_frame{&op, false});
      op.callback_(op, op.callback_context_);
      const bool resubmitted = current_callback.resubmitted;
      current_callback = outer;
      if (resubmitted) return;
    }
    // Publish under the mutex and notify while holding it: a waiter that sees
    // `done` may destroy the operation, and cannot get past the mutex before
    // we let go of it. The release store pairs with ready()'s acquire load.
    std::lock_guard lock(op.mutex_);
    op.state_.store(operation::state_done, std::memory_order_release);
    op.done_.notify_all();
  }
};

// One piece of a request as the kernel sees it.
struct chunk_plan {
  std::uint64_t offset = 0;
  std::byte* address = nullptr;
  std::uint64_t length = 0;
  bool direct = false;  // through the O_DIRECT descriptor
};

inline bool aligned_for_direct(const file& f, std::uint64_t offset, const std::byte* address,
                               std::uint64_t length) noexcept {
  constexpr std::uint64_t block = file::offset_alignment;
  return f.is_direct() && offset % block == 0 && length % block == 0 && length > 0 &&
         reinterpret_cast<std::uintptr_t>(address) % f.memory_alignment() == 0;
}

// The next chunk of `op` from byte `issued` on. Aligned bodies go through the
// O_DIRECT descriptor in pieces of at most `block_size`; an unaligned head (up
// to the next 4 KiB boundary), a tail under 4 KiB and any request whose buffer
// is not aligned for O_DIRECT go through the buffered descriptor, so no
// read-modify-write of a shared block ever happens in user space.
inline chunk_plan plan_chunk(const operation& op, std::uint64_t issued, std::uint64_t block_size) noexcept {
  constexpr std::uint64_t block = file::offset_alignment;
  const file& f = *op.target();
  chunk_plan c;
  c.offset = op.offset() + issued;
  c.address = op.data() + issued;
  const std::uint64_t remaining = op.length() - issued;
  const std::uint64_t head = (block - c.offset % block) % block;
  const bool body_aligned =
      reinterpret_cast<std::uintptr_t>(c.address + head) % f.memory_alignment() == 0;
  if (!f.is_direct() || !body_aligned) {
    c.length = remaining < block_size ? remaining : block_size;
  } else if (head != 0) {
    c.length = remaining < head ? remaining : head;
  } else if (remaining < block) {
    c.length = remaining;
  } else {
    const std::uint64_t body = remaining - remaining % block;
    c.length = body < block_size ? body : block_size;
    c.direct = true;
  }
  return c;
}

// How many times a chunk is resubmitted after EINTR / EAGAIN before the
// errno is reported as the request's failure.
inline constexpr unsigned max_retries = 64;

}  // namespace tierflow::io::detail
