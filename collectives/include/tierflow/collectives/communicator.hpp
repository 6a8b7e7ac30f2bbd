// A communicator: the collectives a fixed group of ranks runs together.
//
// Every rank issues the same collectives in the same order (as with NCCL or
// torch.distributed); each call returns at once with a `work` handle, and the
// collectives of one communicator complete in the order they were issued.
// Buffers are the backend's kind of memory (host memory for Gloo) and must
// stay valid, unread and unwritten by anyone else, until the handle is done.
//
// Uneven shards: all_gather and reduce_scatter take each rank's element count,
// `counts[r]` for rank r, the same span on every rank; a count may be 0.
//
// Failure: a collective that fails (a peer died, a timeout passed) fails its
// handle with a tierflow::error naming the backend, the rank, the collective
// and the cause; the communicator is then broken: every collective pending or
// issued later fails at once with the same cause. Nothing reconnects silently —
// the caller makes a new communicator if it wants one.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>

#include "tierflow/core/dtype.hpp"

namespace tierflow::collectives {

enum class reduce_op : unsigned char { sum, max, min };

// "sum", "max", "min".
std::string_view name(reduce_op op) noexcept;

// The completion of one collective on this rank.
class work {
 public:
  virtual ~work() = default;
  // Whether it has finished, done or failed; never blocks.
  virtual bool done() const = 0;
  // Blocks until it has finished; throws its error if it failed.
  virtual void wait() = 0;
};
using work_ptr = std::shared_ptr<work>;

// A work finished by whoever runs it (a backend's thread, a transfer's
// completion): finish() once, with nullptr on success or the error wait()
// then throws. Thread-safe.
class signalled_work final : public work {
 public:
  bool done() const override;
  void wait() override;
  void finish(std::exception_ptr error);

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool finished_ = false;
  std::exception_ptr error_;
};

class communicator {
 public:
  virtual ~communicator() = default;

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  // "gloo", "nccl", ...
  virtual std::string_view backend() const noexcept = 0;

  // `out` (sum(counts) elements) becomes every rank's `in` (counts[rank()]
  // elements), in rank order. In place when `in` is this rank's slot of `out`
  // (out + sum(counts[0..rank())) elements).
  virtual work_ptr all_gather(const void* in, void* out, std::span<const std::size_t> counts, dtype t) = 0;
  // all_gather, started once `after` is done (a read still filling this
  // rank's slot): it takes this call's place in the order. A backend with a
  // thread of its own (Gloo) waits for `after` there, so this returns at
  // once; when `after` fails the collective fails with its error and the
  // communicator is broken (this rank could not take part). By default the
  // caller waits here, and `after`'s error is thrown here, nothing issued.
  virtual work_ptr all_gather_after(const work_ptr& after, const void* in, void* out,
                                    std::span<const std::size_t> counts, dtype t);
  // `out` gets every rank's `in` (`count` elements, the same on every rank),
  // rank r's at `out + r * stride` elements; what lies between the pieces is
  // left alone. So a chunk of every rank's shard is gathered into its place
  // in the full tensor, the rest of which other chunks' gathers fill. In
  // place when `in` is this rank's piece. Started once `after` (null:
  // nothing) is done, as all_gather_after's. Refused (user_error) when
  // `count` exceeds `stride` with more than one rank: the pieces would overlap.
  virtual work_ptr all_gather_strided(const work_ptr& after, const void* in, void* out, std::size_t count,
                                      std::size_t stride, dtype t) = 0;
  // `out` (counts[rank()] elements) becomes the reduction over the ranks of
  // their `in` (sum(counts) elements)'s slice for this rank.
  virtual work_ptr reduce_scatter(const void* in, void* out, std::span<const std::size_t> counts, dtype t,
                                  reduce_op op) = 0;
  // `inout` (`count` elements) becomes the reduction over the ranks of theirs.
  virtual work_ptr all_reduce(void* inout, std::size_t count, dtype t, reduce_op op) = 0;
  // `buffer` (`count` elements) becomes the root's on every rank.
  virtual work_ptr broadcast(void* buffer, std::size_t count, dtype t, int root) = 0;
};

// Throws all_gather_strided's user_error when `count` elements a rank
// overlap at `stride` on `c` (more than one rank): for its backends.
void check_stride(const communicator& c, std::size_t count, std::size_t stride);

}  // namespace tierflow::collectives
