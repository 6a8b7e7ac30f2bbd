#include "tierflow/io/operation.hpp"

#include "tierflow/core/assert.hpp"
#include "tierflow/io/engine.hpp"
#include "tierflow/io/file.hpp"

namespace tierflow::io {

operation::~operation() {
  const std::uint32_t state = state_.load(std::memory_order_acquire);
  TF_ASSERT(state == state_idle || state == state_done, "operation destroyed while in flight");
  // Taking the mutex orders the destruction after the engine's last touch
  // (complete() notifies while holding it).
  std::lock_guard lock(mutex_);
}

void operation::prepare_read(const file& f, std::uint64_t offset, std::span<std::byte> into) {
  TF_ASSERT(state_.load(std::memory_order_relaxed) != state_queued, "prepare_read() while in flight");
  kind_ = op_kind::read;
  file_ = &f;
  offset_ = offset;
  length_ = into.size();
  data_ = into.data();
  registration_ = nullptr;
  callback_ = nullptr;
  callback_context_ = nullptr;
}

void operation::prepare_write(const file& f, std::uint64_t offset, std::span<const std::byte> from) {
  TF_ASSERT(state_.load(std::memory_order_relaxed) != state_queued, "prepare_write() while in flight");
  kind_ = op_kind::write;
  file_ = &f;
  offset_ = offset;
  length_ = from.size();
  // The engine never writes through the pointer of a write request.
  data_ = const_cast<std::byte*>(from.data());
  registration_ = nullptr;
  callback_ = nullptr;
  callback_context_ = nullptr;
}

void operation::use_buffer(const buffer_registration& registration) {
  const std::span<std::byte> memory = registration.memory();
  TF_ASSERT(data_ >= memory.data() && data_ + length_ <= memory.data() + memory.size(),
            "the operation's span lies outside the registered buffer");
  registration_ = &registration;
}

void operation::wait_quietly() noexcept {
  if (ready()) return;
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return state_.load(std::memory_order_acquire) == state_done; });
}

void operation::wait() {
  wait_quietly();
  rethrow_if_failed();
}

void operation::rethrow_if_failed() const {
  if (error_) std::rethrow_exception(error_);
}

}  // namespace tierflow::io
