// Blocks: the unit of residency and movement — one shard of one parameter,
// gradient or optimizer state — and the small vocabulary around them: the
// tiers a copy can live in, the states of a copy, how a lease uses it and
// which traffic class moves it.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/core/dtype.hpp"

namespace tierflow {

// Every copy of a block starts on a 4 KiB boundary and occupies a whole
// number of 4 KiB pages, so it can be read and written with O_DIRECT and
// registered with the CUDA driver without bounce copies.
inline constexpr std::uint64_t block_alignment = 4096;

// `bytes` rounded up to block_alignment.
constexpr std::uint64_t aligned_size(std::uint64_t bytes) noexcept {
  return (bytes + block_alignment - 1) / block_alignment * block_alignment;
}

// The tiers, fastest first. The numeric order is the order of nearness used to
// choose the source of a load (the nearest tier holding the data).
enum class tier_kind : unsigned char { device = 0, host = 1, nvme = 2 };
inline constexpr std::size_t tier_count = 3;

constexpr std::size_t index_of(tier_kind t) noexcept { return static_cast<std::size_t>(t); }

// "device", "host", "nvme".
constexpr std::string_view name(tier_kind t) noexcept {
  switch (t) {
    case tier_kind::device: return "device";
    case tier_kind::host: return "host";
    case tier_kind::nvme: return "nvme";
  }
  return "unknown";
}

// Parses "device", "host" or "nvme"; throws user_error naming `what` otherwise.
tier_kind parse_tier_kind(std::string_view text, std::string_view what);

// The state of one block's copy in one tier.
//
//   absent ──load──▶ loading ──▶ valid ⇄ dirty ──▶ writing_back ──▶ valid
//      ▲                │                                │
//      └── failed ──────┘              failed ───────────┘ (back to dirty)
//
// valid: equal to the newest contents, which the home tier also holds.
// dirty: the newest contents, not yet in the home tier (whose copy is then absent).
// writing_back: dirty, and being copied to the home tier right now (readable).
// A copy leaves valid or dirty for absent when it is evicted or superseded by a
// newer write elsewhere. The home tier keeps its storage while absent: absent
// there means "stale, the newest contents are in a dirty copy".
enum class copy_state : unsigned char { absent, loading, valid, dirty, writing_back };

constexpr std::string_view name(copy_state s) noexcept {
  switch (s) {
    case copy_state::absent: return "absent";
    case copy_state::loading: return "loading";
    case copy_state::valid: return "valid";
    case copy_state::dirty: return "dirty";
    case copy_state::writing_back: return "writing_back";
  }
  return "unknown";
}

// Whether the state machine above has an edge `from` → `to`.
constexpr bool is_legal_transition(copy_state from, copy_state to) noexcept {
  using s = copy_state;
  switch (from) {
    case s::absent: return to == s::loading;
    case s::loading: return to == s::valid || to == s::dirty || to == s::absent;
    case s::valid: return to == s::dirty || to == s::absent;
    case s::dirty: return to == s::valid || to == s::writing_back || to == s::absent;
    case s::writing_back: return to == s::valid || to == s::dirty;
  }
  return false;
}

// Whether a copy in state `s` holds the newest contents.
constexpr bool holds_data(copy_state s) noexcept {
  return s == copy_state::valid || s == copy_state::dirty || s == copy_state::writing_back;
}

// How a lease releases its copy: dirty::yes when the holder wrote to it.
enum class dirty : bool { no = false, yes = true };

// What a lease may do with its copy. Read leases are shared; a write lease is
// exclusive over the whole block (no other lease on any tier, no transfer).
// An overwrite lease is a write lease whose holder replaces every byte: an
// absent copy is not loaded first (its bytes are unspecified until written),
// and releasing it clean discards such a copy.
enum class access : unsigned char { read, write, overwrite };

constexpr std::string_view name(access a) noexcept {
  return a == access::read ? "read" : a == access::write ? "write" : "overwrite";
}

// Traffic classes on a link, most urgent first. Demand (compute is waiting)
// never queues behind the others; the background classes share what is left
// by weight (see fair_queue.hpp).
enum class traffic_class : unsigned char { demand = 0, prefetch = 1, writeback = 2, optimizer_stream = 3 };
inline constexpr std::size_t traffic_class_count = 4;

constexpr std::size_t index_of(traffic_class c) noexcept { return static_cast<std::size_t>(c); }

constexpr std::string_view name(traffic_class c) noexcept {
  switch (c) {
    case traffic_class::demand: return "demand";
    case traffic_class::prefetch: return "prefetch";
    case traffic_class::writeback: return "writeback";
    case traffic_class::optimizer_stream: return "optimizer_stream";
  }
  return "unknown";
}

// A block's identity inside one store: dense, starting at 0, in creation order.
struct block_id {
  std::uint32_t value = 0;
  friend constexpr auto operator<=>(block_id, block_id) = default;
};

// What a block is. Immutable once the block exists.
struct block_desc {
  std::string name;                 // unique in the store, e.g. "layers.3.mlp.w1.exp_avg"
  std::uint64_t size_bytes = 0;     // 0: computed from shape and type
  tierflow::dtype type = tierflow::dtype::fp32;
  std::vector<std::int64_t> shape;  // may be empty (a flat byte range)
  tier_kind home = tier_kind::host;  // the tier that always holds its storage
};

// Fills in size_bytes from the shape when it is 0 and checks the description:
// a non-empty name, a non-zero size, a shape (when given) whose element count
// times the element size equals size_bytes. Throws user_error naming the block.
block_desc validated(block_desc desc);

}  // namespace tierflow
