// Elementwise state in a real store (pinned host memory, NVMe extents on a
// real filesystem): chunking by the sub-group size, fresh chunks overwritten
// without a read, the stage tier's budget, and passes refused before they
// touch anything.
#include "tierflow/core/streamed_state.hpp"

#include <vector>

#include <gtest/gtest.h>

#include "../cli/temp_dir.hpp"
#include "small_store.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/store.hpp"

namespace tierflow {
namespace {

using testing::link_bytes;
using testing::small_store;

constexpr std::uint64_t kib = 1024;

// A tensor of 10000 elements and 3 keys through sub-groups of 24 KiB: chunks
// of 2 pages (2048 elements) per key, 5 of them, the last of 1808.
TEST(StreamedState, ChunksATensorSoASubGroupFitsAndStreamsEveryElement) {
  testing::temp_dir dir;
  auto store = small_store(dir.path(), 4 * 24 * kib);
  streamed_state state(*store, {"a", "b", "c"}, {.sub_group_bytes = 24 * kib});
  const std::size_t keys[] = {0, 1, 2};
  const std::size_t t = state.add_tensor("w", 10000, keys);
  EXPECT_EQ(state.chunk_elements(t), 2048u);
  EXPECT_EQ(state.chunk_count(t), 5u);
  EXPECT_EQ(store->block_count(), 15u);
  EXPECT_TRUE(state.chunk_fresh(t, 1, 4));
  EXPECT_FALSE(state.any_written(t, 1));

  const std::uint64_t read_before = link_bytes(*store, "nvme->host");
  std::vector<std::uint64_t> firsts;
  const streamed_state::pass_item fill{t, {{0, access::overwrite}, {1, access::overwrite}, {2, access::overwrite}}};
  state.stream({&fill, 1}, [&](const streamed_chunk& c) {
    firsts.push_back(c.first);
    ASSERT_EQ(c.buffers.size(), 3u);
    EXPECT_EQ(c.elements, c.chunk < 4 ? 2048u : 1808u);
    for (std::size_t k = 0; k < 3; ++k) {
      ASSERT_EQ(c.buffers[k].size(), c.elements);
      for (std::uint64_t i = 0; i < c.elements; ++i) c.buffers[k][i] = float(c.first + i) + 1e5f * float(k);
    }
  });
  EXPECT_EQ(firsts, (std::vector<std::uint64_t>{0, 2048, 4096, 6144, 8192}));
  EXPECT_EQ(link_bytes(*store, "nvme->host"), read_before) << "fresh chunks were read";
  EXPECT_FALSE(state.chunk_fresh(t, 0, 4));

  // Read a, write b from it; c untouched.
  const streamed_state::pass_item update{t, {{0, access::read}, {1, access::write}}};
  state.stream({&update, 1}, [&](const streamed_chunk& c) {
    for (std::uint64_t i = 0; i < c.elements; ++i) {
      ASSERT_EQ(c.buffers[0][i], float(c.first + i));
      ASSERT_EQ(c.buffers[1][i], float(c.first + i) + 1e5f);
      c.buffers[1][i] = -c.buffers[0][i];
    }
  });
  const streamed_state::pass_item check{t, {{1, access::read}, {2, access::read}}};
  std::uint64_t seen = 0;
  state.stream({&check, 1}, [&](const streamed_chunk& c) {
    for (std::uint64_t i = 0; i < c.elements; ++i) {
      ASSERT_EQ(c.buffers[0][i], -float(c.first + i));
      ASSERT_EQ(c.buffers[1][i], float(c.first + i) + 2e5f);
    }
    seen += c.elements;
  });
  EXPECT_EQ(seen, 10000u);
  for (const auto& tier : store->telemetry().tiers) EXPECT_LE(tier.high_water, tier.budget) << tier.name;
  EXPECT_EQ(store->tier_of(tier_kind::host).used(), 0u) << "the state went home";
  EXPECT_EQ(state.home_bytes(), 3u * (4 * 8 * kib + 8 * kib));
}

TEST(StreamedState, AddedKeysAreFreshAndAPassOverAMissingKeyIsRefusedBeforeAnyLease) {
  testing::temp_dir dir;
  auto store = small_store(dir.path(), 64 * kib);
  streamed_state state(*store, {"m", "v", "vmax"}, {.sub_group_bytes = 16 * kib});
  const std::size_t keys[] = {0, 1};
  const std::size_t t = state.add_tensor("p", 3000, keys);
  EXPECT_EQ(state.chunk_elements(t), 2048u);
  EXPECT_FALSE(state.has_key(t, 2));
  const streamed_state::pass_item missing{t, {{0, access::write}, {2, access::read}}};
  bool called = false;
  EXPECT_THROW(state.stream({&missing, 1}, [&](const streamed_chunk&) { called = true; }), user_error);
  EXPECT_FALSE(called);
  EXPECT_EQ(store->telemetry().acquires, 0u);
  EXPECT_TRUE(state.chunk_fresh(t, 0, 0));

  state.add_key(t, 2);
  EXPECT_TRUE(state.has_key(t, 2));
  EXPECT_TRUE(state.chunk_fresh(t, 2, 1));
  EXPECT_EQ(state.chunk_count(t), 2u);

  const streamed_state::pass_item fill{t, {{2, access::overwrite}}};
  state.stream({&fill, 1}, [](const streamed_chunk& c) { std::fill(c.buffers[0].begin(), c.buffers[0].end(), 1.0f); });
  EXPECT_TRUE(state.any_written(t, 2));
  EXPECT_EQ(state.fresh_chunks(t, 2), (std::vector<bool>{false, false}));
  state.forget(t, 2);
  EXPECT_FALSE(state.any_written(t, 2));
  state.set_fresh_chunks(t, 2, {true, false});
  EXPECT_TRUE(state.any_written(t, 2));
  EXPECT_TRUE(state.chunk_fresh(t, 2, 0));
  EXPECT_THROW(state.set_fresh_chunks(t, 2, {true}), user_error);

  const std::size_t empty = state.add_tensor("empty", 0, keys);
  EXPECT_EQ(state.chunk_count(empty), 0u);
  const streamed_state::pass_item none{empty, {{0, access::read}}};
  state.stream({&none, 1}, [&](const streamed_chunk&) { called = true; });
  EXPECT_FALSE(called);
}

TEST(StreamedState, ASubGroupTooSmallForAPagePerKeyIsAUserError) {
  testing::temp_dir dir;
  auto store = small_store(dir.path(), 64 * kib);
  EXPECT_THROW(streamed_state(*store, {"m"}, {.sub_group_bytes = 1000}), user_error);
  streamed_state state(*store, {"m", "v", "vmax"}, {.sub_group_bytes = 8 * kib});
  const std::size_t three[] = {0, 1, 2};
  EXPECT_THROW(state.add_tensor("p", 10, three), user_error);
  const std::size_t twice[] = {0, 0};
  EXPECT_THROW(state.add_tensor("q", 10, twice), user_error);
  EXPECT_EQ(state.tensor_count(), 0u);
}

}  // namespace
}  // namespace tierflow
