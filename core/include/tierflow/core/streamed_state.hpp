// Elementwise optimizer state in a block store: for each tensor, a few fp32
// buffers of its element count (Adam's master, exp_avg, exp_avg_sq...) kept in
// blocks at a home tier (NVMe) and streamed through a stage tier (host memory)
// in sub-groups of bounded size, read(i+1) ‖ update(i) ‖ write(i-1).
//
// Each buffer is one *key* of its tensor. A tensor's buffers are cut into
// chunks of one length, chosen when the tensor is registered so that one chunk
// of every key it has then fits in `sub_group_bytes`; chunk c of every key is
// one sub-group of the stream (run_optimizer_stream). So the stage tier needs
// room for a few sub-groups whatever the size of the largest tensor, and the
// update rule (core knows none) sees one chunk at a time: the same elements of
// every key, and where they start in the tensor.
//
//   streamed_state state(store, {"exp_avg", "exp_avg_sq"}, {.sub_group_bytes = 16 << 20});
//   const std::size_t w = state.add_tensor("layer0.w", n, {0, 1});
//   state.stream({{w, {{0, access::write}, {1, access::write}}}},
//                [&](const streamed_chunk& c) { adam(param + c.first, c.buffers[0], c.buffers[1]); });
//
// A key's chunk is *fresh* until some pass wrote it: its bytes are
// unspecified, and the caller chooses access::overwrite for it (chunk_fresh()
// tells) — it is then neither read nor prefetched. Not thread-safe: one pass
// or registration at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tierflow/core/block.hpp"
#include "tierflow/core/optimizer_stream.hpp"

namespace tierflow {

class block_store;

struct streamed_state_options {
  tier_kind home = tier_kind::nvme;   // where the state lives
  tier_kind stage = tier_kind::host;  // where passes lease it
  // The most bytes one chunk of all of a tensor's keys may take (each key's
  // block rounded to block_alignment): at least one page per key. The stage
  // tier should hold a few such sub-groups (`depth` and the write-backs in
  // flight) for the pipeline to overlap; one is enough for it to make progress.
  std::uint64_t sub_group_bytes = 0;
  std::size_t depth = 3;  // sub-groups resident at once (see optimizer_stream_options)
};

// One chunk as a pass's update sees it.
struct streamed_chunk {
  std::size_t item = 0;          // the index of the pass item
  std::size_t tensor = 0;
  std::size_t chunk = 0;         // its index in the tensor
  std::uint64_t first = 0;       // its first element in the tensor
  std::uint64_t elements = 0;    // its length: every buffer's size
  // One per key the item asked for, in its order. A read-only key's buffer
  // must not be written; an overwritten one must be written in full.
  std::span<const std::span<float>> buffers;
};

class streamed_state {
 public:
  // `key_names` name the keys (the index of a name is its key) in block
  // names: "<tensor>.<key>.<chunk>". Throws user_error when sub_group_bytes
  // cannot hold a page, or the store lacks the home or stage tier.
  streamed_state(block_store& store, std::vector<std::string> key_names, streamed_state_options options);
  streamed_state(const streamed_state&) = delete;
  streamed_state& operator=(const streamed_state&) = delete;

  // Registers a tensor of `elements` fp32 elements with a buffer for each of
  // `keys`, and creates its blocks at home (all fresh). Its chunk length is
  // the most whole pages per key that keep one chunk of all `keys` within
  // sub_group_bytes. A tensor of 0 elements has no chunk and no block.
  // Throws user_error for a bad or repeated key or a name already used, and
  // what create_block throws (budget_exceeded, tierflow::error ENOSPC naming
  // the file): the tensor is not registered then, and the blocks made before
  // the failure stay allocated, unused, until the store closes.
  std::size_t add_tensor(std::string tensor_name, std::uint64_t elements, std::span<const std::size_t> keys);
  // Gives tensor `t` a buffer for `key` (fresh), in its chunks. Throws as
  // add_tensor; a key the tensor has already is left as it is.
  void add_key(std::size_t t, std::size_t key);

  std::size_t tensor_count() const noexcept { return tensors_.size(); }
  const std::string& name(std::size_t t) const;
  std::uint64_t elements(std::size_t t) const;
  std::uint64_t chunk_elements(std::size_t t) const;
  std::size_t chunk_count(std::size_t t) const;
  bool has_key(std::size_t t, std::size_t key) const;
  // Whether no pass has written chunk `c` of `key` yet (its bytes are unspecified).
  bool chunk_fresh(std::size_t t, std::size_t key, std::size_t c) const;
  // Whether any chunk of `key` was written.
  bool any_written(std::size_t t, std::size_t key) const;
  // Makes every chunk of `key` fresh again (nothing is written or freed).
  void forget(std::size_t t, std::size_t key);
  // Which chunks of `key` are fresh, one flag per chunk; and setting them, for
  // blocks written outside a pass (a checkpoint restored into the store).
  // Throws user_error for a key the tensor lacks or a count that is not its chunks'.
  std::vector<bool> fresh_chunks(std::size_t t, std::size_t key) const;
  void set_fresh_chunks(std::size_t t, std::size_t key, std::vector<bool> fresh);
  // Bytes of the blocks at home (aligned), for every tensor and key.
  std::uint64_t home_bytes() const noexcept { return home_bytes_; }
  std::uint64_t sub_group_bytes() const noexcept { return options_.sub_group_bytes; }

  // What one pass does with one tensor: the keys it leases, and how. Every key
  // must be the tensor's (user_error, before anything is leased). A fresh
  // chunk leased read or write holds unspecified bytes: the update tells by
  // chunk_fresh(), which stays as it was until the update returns.
  struct pass_item {
    std::size_t tensor = 0;
    std::vector<std::pair<std::size_t, access>> keys;
  };
  using chunk_update = std::function<void(const streamed_chunk&)>;

  // One streamed pass over `items`, chunk by chunk in order: leases the
  // chunk's blocks in the stage tier, calls `update` on the calling thread,
  // releases them (written keys dirty) and sends them home, and returns once
  // everything written is home. A chunk whose update returned is no longer
  // fresh in the keys it wrote. Throws what run_optimizer_stream throws: the
  // chunks before the failing one stay updated and written, the failing
  // chunk's blocks keep their old bytes unless its update had run.
  // `pace` (may be null) spreads the pass over time (stream_pace).
  optimizer_stream_stats stream(std::span<const pass_item> items, const chunk_update& update,
                                stream_pace* pace = nullptr);

 private:
  struct tensor_record {
    std::string name;
    std::uint64_t elements = 0;
    std::uint64_t chunk_elements = 0;
    // Per key (indexed by key): whether the tensor has it, the block of each
    // chunk, and which chunks are fresh.
    std::vector<bool> has;
    std::vector<std::vector<block_id>> blocks;
    std::vector<std::vector<bool>> fresh;
  };
  const tensor_record& record(std::size_t t) const;
  void check_key(std::size_t key) const;
  std::vector<block_id> make_blocks(const tensor_record& r, std::size_t key);

  block_store& store_;
  std::vector<std::string> key_names_;
  streamed_state_options options_;
  std::vector<tensor_record> tensors_;
  std::uint64_t home_bytes_ = 0;
};

}  // namespace tierflow
