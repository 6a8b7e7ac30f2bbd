// The host half of cuda_zenflow_device's gradient path, kept free of CUDA so
// that a build or a machine without a GPU tests it: the widening of a
// downloaded bf16/fp16 gradient into fp32 and its addition into a window's
// sum, spread over an executor's threads, and the bookkeeping of the pinned
// slots the gradients come down into.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "kernels.hpp"
#include "tiles.hpp"
#include "tierflow/core/assert.hpp"
#include "tierflow/core/dtype.hpp"
#include "tierflow/core/zenflow/engine.hpp"
#include "tierflow/optim/executor.hpp"

namespace tierflow::optim::detail {

// dst[i] = src[i] as fp32 for i < n; src holds `type` (fp32, bf16 or fp16).
// Widening is exact, so every SIMD target and every split over the threads
// give the same bits.
inline void widen_gradient(executor& ex, const void* src, dtype type, float* dst, std::size_t n) {
  const std::int64_t target = ex.target();
  for_each_tile(ex, n, [&](std::size_t begin, std::size_t end) {
    convert_range(target, src, type, dst, dtype::fp32, 1.0f, begin, end);
  });
}

// sum[k] += src[k] (src widened to fp32) for every element k of the columns
// in `runs` (column c is elements [c·rows, (c+1)·rows)); other elements of
// `sum` are not touched. Element by element the same fp32 addition as a
// plain loop, whatever the threads. `runs` ascending and inside `sum`.
inline void accumulate_gradient(executor& ex, const void* src, dtype type, std::span<const zenflow::column_run> runs,
                                std::uint64_t rows, std::span<float> sum) {
  // The runs laid end to end: the tiles cut that line, whatever the runs' lengths.
  std::vector<std::uint64_t> starts(runs.size() + 1, 0);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    TF_ASSERT(runs[i].begin < runs[i].end && runs[i].end * rows <= sum.size(), "accumulate: a run outside the weight");
    starts[i + 1] = starts[i] + (runs[i].end - runs[i].begin) * rows;
  }
  const std::int64_t target = ex.target();
  const auto* bytes = static_cast<const std::byte*>(src);
  const std::size_t element = size_of(type);
  for_each_tile(ex, starts.back(), [&](std::size_t begin, std::size_t end) {
    // Widened a piece at a time into a buffer that stays in L1.
    std::array<float, 2048> widened;
    std::size_t run = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
    while (begin < end) {
      const std::uint64_t at = runs[run].begin * rows + (begin - starts[run]);  // element of the weight
      const std::size_t piece = static_cast<std::size_t>(std::min<std::uint64_t>(
          {end - begin, starts[run + 1] - begin, widened.size()}));
      float* out = sum.data() + at;
      if (type == dtype::fp32) {
        const float* in = reinterpret_cast<const float*>(bytes) + at;
        for (std::size_t i = 0; i < piece; ++i) out[i] += in[i];
      } else {
        convert_range(target, bytes + at * element, type, widened.data(), dtype::fp32, 1.0f, 0, piece);
        for (std::size_t i = 0; i < piece; ++i) out[i] += widened[i];
      }
      begin += piece;
      if (begin == starts[run + 1]) ++run;
    }
  });
}

// Which weight's gradient is on its way down into which pinned slot. A step
// begins with the weights the host will ask for, in the order it will ask;
// the device starts a download into each free slot (issue), the host takes a
// weight's slot when it asks for it (take) and frees it once it has read it
// (release), which lets the next weight's download start. A weight asked
// for out of the plan is a miss: the caller waits for every download in
// flight and replans with that weight first (replan_from). Not thread-safe:
// the trainer's thread owns it.
class download_ring {
 public:
  struct issued {
    std::size_t weight;
    unsigned slot;
  };

  explicit download_ring(unsigned slots) : slots_(slots) { TF_ASSERT(slots > 0); }

  unsigned slots() const noexcept { return static_cast<unsigned>(slots_.size()); }

  // A new step whose gradients are downloaded in `order`. Every slot becomes
  // free: the host is done with the last step's (the engine reads a
  // downloaded gradient before it asks for the next, and the next step
  // starts after this one's last). Returns whether some slot still had a
  // download nobody took, which the caller must wait for before the slot
  // is written again by a copy that is not behind it on the same stream, or
  // before the gradient it reads may be overwritten.
  bool begin(std::vector<std::size_t> order) {
    bool untaken = false;
    for (slot& s : slots_) {
      untaken |= s.state == slot_state::issued;
      s = slot{};
    }
    order_ = std::move(order);
    next_ = 0;
    return untaken;
  }

  // The next planned weight and the free slot to download it into, if both
  // exist; the slot is then issued to that weight.
  std::optional<issued> issue() {
    if (next_ == order_.size()) return std::nullopt;
    for (unsigned i = 0; i < slots_.size(); ++i) {
      if (slots_[i].state != slot_state::free) continue;
      slots_[i] = {slot_state::issued, order_[next_]};
      return issued{order_[next_++], i};
    }
    return std::nullopt;
  }

  // The slot issued to `w`, now taken by the host; nullopt when none was
  // (a miss).
  std::optional<unsigned> take(std::size_t w) {
    for (unsigned i = 0; i < slots_.size(); ++i) {
      if (slots_[i].state == slot_state::issued && slots_[i].weight == w) {
        slots_[i].state = slot_state::taken;
        return i;
      }
    }
    return std::nullopt;
  }

  // The host has read slot `i`.
  void release(unsigned i) {
    TF_ASSERT(i < slots_.size() && slots_[i].state == slot_state::taken, "download ring: releasing a slot not taken");
    slots_[i] = slot{};
  }

  // After a miss on `w`, once every download in flight has completed: the
  // slots free, and the plan `w` first, then the planned weights not yet
  // taken, in their order (those issued but not taken are downloaded again).
  void replan_from(std::size_t w) {
    std::vector<std::size_t> rest{w};
    for (std::size_t i = 0; i < order_.size(); ++i) {
      const std::size_t v = order_[i];
      if (v == w) continue;
      const bool issued_untaken = std::any_of(slots_.begin(), slots_.end(), [&](const slot& s) {
        return s.state == slot_state::issued && s.weight == v;
      });
      if (i >= next_ || issued_untaken) rest.push_back(v);
    }
    begin(std::move(rest));
  }

  // `w` leaves this step's plan (a hand-over gave all of it to the device).
  // Returns the slot its download was issued to and nobody took, now free:
  // the caller waits for that copy, which still reads w's gradient.
  std::optional<unsigned> drop(std::size_t w) {
    std::optional<unsigned> freed;
    for (unsigned i = 0; i < slots_.size(); ++i) {
      if (slots_[i].state == slot_state::issued && slots_[i].weight == w) {
        slots_[i] = slot{};
        freed = i;
      }
    }
    const auto pending = order_.begin() + static_cast<std::ptrdiff_t>(next_);
    if (const auto it = std::find(pending, order_.end(), w); it != order_.end()) order_.erase(it);
    return freed;
  }

  // The slot taken and not yet released, if any.
  std::optional<unsigned> held() const {
    for (unsigned i = 0; i < slots_.size(); ++i)
      if (slots_[i].state == slot_state::taken) return i;
    return std::nullopt;
  }

 private:
  enum class slot_state : unsigned char { free, issued, taken };
  struct slot {
    slot_state state = slot_state::free;
    std::size_t weight = 0;
  };
  std::vector<slot> slots_;
  std::vector<std::size_t> order_;
  std::size_t next_ = 0;  // order_[next_] is the next to issue
};

}  // namespace tierflow::optim::detail
