// One asynchronous read or write: the caller owns it (no allocation per
// request), prepares it, hands it to engine::submit() and then either waits on
// it or lets its completion callback chain the next piece of work.
//
// Life of an operation:
//
//   idle ──prepare_*()──> idle ──submit()──> queued ──(engine)──> completing ──> done
//                                               ^                     │ callback
//                                               └──── submit() ───────┘ (resubmitted)
//
// - The operation must stay alive and untouched from submit() until ready()
//   is true (or until its callback resubmitted it; then until the next ready()).
// - The callback runs on an engine thread, once, before ready() turns true.
//   It may read the result and may prepare and resubmit this same operation
//   (or submit others); it must not block, throw, or destroy the operation.
// - A failed operation never reports success: wait() rethrows its
//   tierflow::error, which names the operation, file, offset, length and errno.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>

namespace tierflow::io {

class file;
class buffer_registration;
class operation;

namespace detail {
struct operation_access;
}

enum class op_kind : std::uint8_t { read, write, control };

// Completion callback: a plain function and a context pointer (no allocation,
// callable from C and from the Python bindings' trampolines).
using completion_fn = void (*)(operation& op, void* context);

class operation {
 public:
  operation() = default;
  ~operation();
  operation(const operation&) = delete;
  operation& operator=(const operation&) = delete;

  // Prepares a read of `into.size()` bytes of `f` at `offset` into `into`.
  // Clears any registered buffer or callback set before. Needs: not in flight.
  void prepare_read(const file& f, std::uint64_t offset, std::span<std::byte> into);
  // Prepares a write of `from` to `f` at `offset`. Same contract.
  void prepare_write(const file& f, std::uint64_t offset, std::span<const std::byte> from);
  // Moves the data through a buffer registered with the engine (READ_FIXED /
  // WRITE_FIXED on io_uring): the prepared span must lie inside it.
  void use_buffer(const buffer_registration& registration);
  // Calls `fn(*this, context)` on an engine thread when the operation completes.
  void on_complete(completion_fn fn, void* context) noexcept {
    callback_ = fn;
    callback_context_ = context;
  }

  // True once the operation completed (successfully or not) and the engine no
  // longer touches it. Acquire: the data and result are visible after it.
  bool ready() const noexcept { return state_.load(std::memory_order_acquire) == state_done; }
  // Blocks until ready(), without spinning; then throws the operation's
  // tierflow::error if it failed.
  void wait();
  // Blocks until ready(); never throws.
  void wait_quietly() noexcept;

  // Results, valid once complete (in the callback, or after ready()).
  bool failed() const noexcept { return errnum_ != 0; }
  int errnum() const noexcept { return errnum_; }
  // The tierflow::error of a failed operation (null otherwise).
  std::exception_ptr error() const noexcept { return error_; }
  void rethrow_if_failed() const;
  std::uint64_t bytes_transferred() const noexcept { return transferred_; }

  op_kind kind() const noexcept { return kind_; }
  const file* target() const noexcept { return file_; }
  std::uint64_t offset() const noexcept { return offset_; }
  std::size_t length() const noexcept { return length_; }
  std::byte* data() const noexcept { return data_; }

  // Free for the caller (e.g. an index into its own tables).
  void* user_data = nullptr;

 private:
  friend struct detail::operation_access;
  static constexpr std::uint32_t state_idle = 0, state_queued = 1, state_completing = 2,
                                 state_done = 3;

  // What to do (set by prepare_*, read by the engine).
  op_kind kind_ = op_kind::read;
  const file* file_ = nullptr;
  std::uint64_t offset_ = 0;
  std::size_t length_ = 0;
  std::byte* data_ = nullptr;
  const buffer_registration* registration_ = nullptr;
  completion_fn callback_ = nullptr;
  void* callback_context_ = nullptr;

  // Result.
  int errnum_ = 0;
  std::uint64_t transferred_ = 0;
  std::exception_ptr error_;

  // Engine-private progress, touched only by the engine thread(s) that own
  // the operation while it is in flight.
  operation* next_ = nullptr;           // intrusive queue link
  std::uint64_t issued_ = 0;            // bytes handed out as chunks so far
  std::uint32_t chunks_in_flight_ = 0;  // chunks issued and not yet completed
  bool in_queue_ = false;               // still in the engine's queue of work
  std::uint64_t failed_offset_ = 0;     // the chunk that failed
  std::uint64_t failed_length_ = 0;
  bool past_end_ = false;               // a read reached end of file
  std::uintptr_t control_ = 0;          // control requests' argument

  // Completion hand-off to waiters.
  std::atomic<std::uint32_t> state_{state_idle};
  std::mutex mutex_;
  std::condition_variable done_;
};

}  // namespace tierflow::io
