#include "tierflow/core/streamed_state.hpp"

#include <algorithm>

#include "tierflow/core/error.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/core/units.hpp"

namespace tierflow {
namespace {

constexpr std::uint64_t floats_per_page = block_alignment / sizeof(float);

}  // namespace

streamed_state::streamed_state(block_store& store, std::vector<std::string> key_names,
                               streamed_state_options options)
    : store_(store), key_names_(std::move(key_names)), options_(options) {
  if (key_names_.empty()) throw user_error("streamed state: no key");
  if (options_.sub_group_bytes < block_alignment)
    throw user_error("streamed state: a sub-group of " + format_bytes(double(options_.sub_group_bytes)) +
                     " cannot hold one page (" + std::to_string(block_alignment) + " bytes)");
  if (options_.depth == 0) throw user_error("streamed state: depth must be at least 1");
  for (const tier_kind t : {options_.home, options_.stage}) {
    if (!store_.has_tier(t))
      throw user_error("streamed state: the store has no " + std::string(tierflow::name(t)) + " tier");
  }
}

const streamed_state::tensor_record& streamed_state::record(std::size_t t) const {
  if (t >= tensors_.size())
    throw user_error("streamed state: no tensor " + std::to_string(t) + " (" + std::to_string(tensors_.size()) +
                     " registered)");
  return tensors_[t];
}

void streamed_state::check_key(std::size_t key) const {
  if (key >= key_names_.size())
    throw user_error("streamed state: no key " + std::to_string(key) + " (" + std::to_string(key_names_.size()) +
                     " named)");
}

std::vector<block_id> streamed_state::make_blocks(const tensor_record& r, std::size_t key) {
  std::vector<block_id> ids;
  for (std::uint64_t first = 0, c = 0; first < r.elements; first += r.chunk_elements, ++c) {
    const std::uint64_t n = std::min(r.chunk_elements, r.elements - first);
    ids.push_back(store_.create_block({.name = r.name + "." + key_names_[key] + "." + std::to_string(c),
                                       .size_bytes = n * sizeof(float),
                                       .type = dtype::fp32,
                                       .shape = {static_cast<std::int64_t>(n)},
                                       .home = options_.home}));
    home_bytes_ += aligned_size(n * sizeof(float));  // allocated, even when a later block fails
  }
  return ids;
}

std::size_t streamed_state::add_tensor(std::string tensor_name, std::uint64_t elements,
                                       std::span<const std::size_t> keys) {
  if (keys.empty()) throw user_error("streamed state: tensor " + tensor_name + " has no key");
  for (std::size_t i = 0; i < keys.size(); ++i) {
    check_key(keys[i]);
    if (std::count(keys.begin(), keys.end(), keys[i]) > 1)
      throw user_error("streamed state: tensor " + tensor_name + " names key " + key_names_[keys[i]] + " twice");
  }
  const std::uint64_t pages = options_.sub_group_bytes / block_alignment / keys.size();
  if (pages == 0)
    throw user_error("streamed state: a sub-group of " + format_bytes(double(options_.sub_group_bytes)) +
                     " cannot hold one page of each of " + std::to_string(keys.size()) + " keys");
  tensor_record r;
  r.name = std::move(tensor_name);
  r.elements = elements;
  r.chunk_elements = pages * floats_per_page;
  r.has.assign(key_names_.size(), false);
  r.blocks.resize(key_names_.size());
  r.fresh.resize(key_names_.size());
  for (const std::size_t key : keys) {
    r.blocks[key] = make_blocks(r, key);
    r.fresh[key].assign(r.blocks[key].size(), true);
    r.has[key] = true;
  }
  tensors_.push_back(std::move(r));
  return tensors_.size() - 1;
}

void streamed_state::add_key(std::size_t t, std::size_t key) {
  record(t);
  check_key(key);
  tensor_record& r = tensors_[t];
  if (r.has[key]) return;
  std::vector<block_id> ids = make_blocks(r, key);
  r.fresh[key].assign(ids.size(), true);
  r.blocks[key] = std::move(ids);
  r.has[key] = true;
}

const std::string& streamed_state::name(std::size_t t) const { return record(t).name; }
std::uint64_t streamed_state::elements(std::size_t t) const { return record(t).elements; }
std::uint64_t streamed_state::chunk_elements(std::size_t t) const { return record(t).chunk_elements; }

std::size_t streamed_state::chunk_count(std::size_t t) const {
  const tensor_record& r = record(t);
  return static_cast<std::size_t>((r.elements + r.chunk_elements - 1) / r.chunk_elements);
}

bool streamed_state::has_key(std::size_t t, std::size_t key) const {
  const tensor_record& r = record(t);
  check_key(key);
  return r.has[key];
}

bool streamed_state::chunk_fresh(std::size_t t, std::size_t key, std::size_t c) const {
  if (!has_key(t, key)) throw user_error("streamed state: tensor " + name(t) + " has no " + key_names_[key]);
  const tensor_record& r = tensors_[t];
  if (c >= r.fresh[key].size())
    throw user_error("streamed state: tensor " + r.name + " has no chunk " + std::to_string(c));
  return r.fresh[key][c];
}

bool streamed_state::any_written(std::size_t t, std::size_t key) const {
  if (!has_key(t, key)) return false;
  const auto& fresh = tensors_[t].fresh[key];
  return std::find(fresh.begin(), fresh.end(), false) != fresh.end();
}

void streamed_state::forget(std::size_t t, std::size_t key) {
  if (!has_key(t, key)) return;
  auto& fresh = tensors_[t].fresh[key];
  std::fill(fresh.begin(), fresh.end(), true);
}

std::vector<bool> streamed_state::fresh_chunks(std::size_t t, std::size_t key) const {
  if (!has_key(t, key)) throw user_error("streamed state: tensor " + name(t) + " has no " + key_names_[key]);
  return tensors_[t].fresh[key];
}

void streamed_state::set_fresh_chunks(std::size_t t, std::size_t key, std::vector<bool> fresh) {
  if (!has_key(t, key)) throw user_error("streamed state: tensor " + name(t) + " has no " + key_names_[key]);
  if (fresh.size() != chunk_count(t))
    throw user_error("streamed state: tensor " + name(t) + " has " + std::to_string(chunk_count(t)) + " chunks, not " +
                     std::to_string(fresh.size()));
  tensors_[t].fresh[key] = std::move(fresh);
}

optimizer_stream_stats streamed_state::stream(std::span<const pass_item> items, const chunk_update& update,
                                              stream_pace* pace) {
  // Everything is checked before the first lease, so a refused pass changes nothing.
  struct chunk_ref {
    std::size_t item, chunk;
  };
  std::vector<sub_group> groups;
  std::vector<chunk_ref> refs;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const pass_item& item = items[i];
    const tensor_record& r = record(item.tensor);
    for (const auto& key_mode : item.keys) {
      if (!has_key(item.tensor, key_mode.first))
        throw user_error("streamed state: tensor " + r.name + " has no " + key_names_[key_mode.first]);
    }
    for (std::size_t c = 0; c < chunk_count(item.tensor); ++c) {
      sub_group g;
      for (const auto& [key, mode] : item.keys) {
        g.blocks.push_back(r.blocks[key][c]);
        g.modes.push_back(mode);
      }
      groups.push_back(std::move(g));
      refs.push_back({i, c});
    }
  }

  optimizer_stream_options stream_options;
  stream_options.depth = options_.depth;
  stream_options.stage = options_.stage;
  stream_options.evict_after_update = options_.home != options_.stage;
  stream_options.pace = pace;
  std::vector<std::span<float>> buffers;
  return run_optimizer_stream(
      store_, groups,
      [&](std::size_t index, std::span<const std::span<std::byte>> bytes) {
        const auto [i, c] = refs[index];
        const pass_item& item = items[i];
        tensor_record& r = tensors_[item.tensor];
        const std::uint64_t first = c * r.chunk_elements;
        const std::uint64_t n = std::min(r.chunk_elements, r.elements - first);
        buffers.clear();
        for (const auto& b : bytes) buffers.emplace_back(reinterpret_cast<float*>(b.data()), n);
        update(streamed_chunk{.item = i, .tensor = item.tensor, .chunk = c, .first = first, .elements = n,
                              .buffers = buffers});
        for (const auto& [key, mode] : item.keys) {
          if (mode != access::read) r.fresh[key][c] = false;
        }
      },
      stream_options);
}

}  // namespace tierflow
