// What every communicator shares (communicator.hpp).
#include "tierflow/collectives/communicator.hpp"

#include <string>
#include <utility>

#include "tierflow/core/error.hpp"

namespace tierflow::collectives {

std::string_view name(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::max: return "max";
    case reduce_op::min: return "min";
  }
  return "unknown";
}

bool signalled_work::done() const {
  std::lock_guard lock(mutex_);
  return finished_;
}

void signalled_work::wait() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return finished_; });
  if (error_) std::rethrow_exception(error_);
}

void signalled_work::finish(std::exception_ptr error) {
  {
    std::lock_guard lock(mutex_);
    finished_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

work_ptr communicator::all_gather_after(const work_ptr& after, const void* in, void* out,
                                        std::span<const std::size_t> counts, dtype t) {
  if (after) after->wait();
  return all_gather(in, out, counts, t);
}

void check_stride(const communicator& c, std::size_t count, std::size_t stride) {
  if (c.size() > 1 && count > stride)
    throw user_error("all_gather_strided: " + std::to_string(count) + " elements a rank overlap at a stride of " +
                     std::to_string(stride));
}

}  // namespace tierflow::collectives
