// Leases: the right to use one block's copy in one tier, granted by the store.
//
// acquire() returns a lease at once; it is granted when the copy is there and
// no conflicting lease is held (read leases share, a write lease is exclusive
// over the block). While granted the copy cannot be evicted. wait() blocks
// until then — that wait is the stall the store measures.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <span>

#include "tierflow/core/block.hpp"

namespace tierflow {

class block_store;

namespace detail {

enum class lease_status : int { pending = 0, granted = 1, failed = 2, ended = 3 };

// Shared by a lease and the store. Fields other than `status` are written by
// the store under its lock before `status` leaves `pending` (a release store),
// and read by the holder after it observed that (an acquire load).
struct lease_state {
  block_id block;
  tier_kind tier = tier_kind::host;
  access mode = access::read;
  traffic_class cls = traffic_class::demand;
  std::atomic<lease_status> status{lease_status::pending};
  std::span<std::byte> data;
  std::exception_ptr error;
  std::chrono::steady_clock::time_point requested_at;
  // A thread waits on it (lease_holder::waiting_thread stores only). Written
  // and read under the store's lock.
  bool waited = false;
};

}  // namespace detail

// Move-only. Destroying a lease that was not released releases it clean (or
// withdraws the request if it was not granted yet).
class lease {
 public:
  lease() = default;
  lease(lease&& other) noexcept;
  lease& operator=(lease&& other) noexcept;
  lease(const lease&) = delete;
  lease& operator=(const lease&) = delete;
  ~lease();

  // Whether wait() would return at once.
  bool ready() const noexcept;
  // Blocks until the lease is granted and returns the copy's bytes: CPU memory
  // for host tiers, a device pointer for a CUDA device tier, empty for a file
  // tier. The span covers the block's size_bytes; its storage extends to
  // aligned_size(size_bytes) (whole pages, for O_DIRECT and DMA). Throws the
  // error of the load that failed, naming the block.
  std::span<std::byte> wait();
  // The bytes, once granted (wait() returned).
  std::span<std::byte> data() const noexcept;

  block_id block() const noexcept;
  tier_kind tier() const noexcept;
  access mode() const noexcept;
  explicit operator bool() const noexcept { return state_ != nullptr; }

 private:
  friend class block_store;
  lease(block_store* store, std::shared_ptr<detail::lease_state> state) noexcept
      : store_(store), state_(std::move(state)) {}

  block_store* store_ = nullptr;
  std::shared_ptr<detail::lease_state> state_;
};

}  // namespace tierflow
