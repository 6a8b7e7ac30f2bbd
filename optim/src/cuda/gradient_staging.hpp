// The host half of cuda_zenflow_device's gradient path, kept free of CUDA so
// that a build or a machine without a GPU tests it: the bookkeeping of the
// pinned slots the gradients come down into. (The widening and adding of the
// downloaded gradients is tierflow/optim/gradients.hpp.)
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>
#include <vector>

#include "tierflow/core/assert.hpp"

namespace tierflow::optim::detail {

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
