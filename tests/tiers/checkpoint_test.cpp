// Checkpoints of the whole store: bytes back from every tier, generations,
// and refusal of corrupt, truncated or mismatched checkpoints.
#include "tierflow/tiers/checkpoint.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "store_fixture.hpp"

namespace tierflow::test {
namespace {

struct model {
  std::vector<std::pair<std::string, std::uint64_t>> blocks{
      {"embed", 300000}, {"l0.w", 65536}, {"l0.b", 100}, {"l1.w", 131072}, {"l1.exp_avg", 131072}};
};

std::vector<block_id> populate(block_store& s, std::uint64_t seed) {
  std::vector<block_id> ids;
  const model m;
  for (std::size_t i = 0; i < m.blocks.size(); ++i) {
    const tier_kind home = i % 2 == 0 ? tier_kind::nvme : tier_kind::host;
    ids.push_back(s.create_block({.name = m.blocks[i].first, .size_bytes = m.blocks[i].second, .home = home}));
  }
  // Leave the newest bytes in different tiers: dirty on the device, dirty on
  // the host, written back to NVMe.
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const tier_kind where = i % 3 == 0 ? tier_kind::device : tier_kind::host;
    lease l = s.acquire(ids[i], where, access::write);
    fill(l.wait(), seed + i);
    s.release(std::move(l), dirty::yes);
    if (i == 1) {
      s.evict(ids[i], tier_kind::host);
      s.flush();
    }
  }
  return ids;
}

void expect_contents(block_store& s, std::uint64_t seed) {
  ASSERT_EQ(s.block_count(), model{}.blocks.size());
  for (std::uint32_t i = 0; i < s.block_count(); ++i) {
    lease l = s.acquire(block_id{i}, tier_kind::host);
    EXPECT_TRUE(holds(l.wait(), seed + i)) << s.describe(block_id{i}).name;
  }
}

TEST(checkpoint, round_trip_from_every_tier_into_an_empty_and_a_matching_store) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  populate(*store, 10);
  const auto stats = tiers::write_checkpoint(*store, dir.sub("ckpt"));
  EXPECT_EQ(stats.generation, 1u);
  EXPECT_EQ(stats.blocks, 5u);

  scratch_dir other;
  auto fresh = tiers::make_store(small_store_config(other));
  tiers::restore_checkpoint(*fresh, dir.sub("ckpt"));
  expect_contents(*fresh, 10);
  fresh->flush();
  fresh->check_invariants();

  // Into a store with the same blocks but other bytes.
  for (std::uint32_t i = 0; i < fresh->block_count(); ++i) {
    lease l = fresh->acquire(block_id{i}, tier_kind::device, access::write);
    fill(l.wait(), 77 + i);
    fresh->release(std::move(l), dirty::yes);
  }
  tiers::restore_checkpoint(*fresh, dir.sub("ckpt"));
  expect_contents(*fresh, 10);
}

TEST(checkpoint, a_new_generation_replaces_the_old_one) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  auto ids = populate(*store, 1);
  tiers::write_checkpoint(*store, dir.sub("ckpt"));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    lease l = store->acquire(ids[i], tier_kind::host, access::write);
    fill(l.wait(), 50 + i);
    store->release(std::move(l), dirty::yes);
  }
  EXPECT_EQ(tiers::write_checkpoint(*store, dir.sub("ckpt")).generation, 2u);
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir.sub("ckpt")))
    names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"blocks-2.bin", "manifest.json"}));
  EXPECT_EQ(tiers::verify_checkpoint(dir.sub("ckpt")).generation, 2u);
  EXPECT_EQ(tiers::read_checkpoint_manifest(dir.sub("ckpt")).generation, 2u);
  EXPECT_EQ(tiers::read_checkpoint_manifest(dir.sub("ckpt")).blocks.size(), ids.size());
  EXPECT_THROW(tiers::read_checkpoint_manifest(dir.sub("none")), checkpoint_error);
  scratch_dir other;
  auto fresh = tiers::make_store(small_store_config(other));
  tiers::restore_checkpoint(*fresh, dir.sub("ckpt"));
  expect_contents(*fresh, 50);
}

void expect_refusal(const std::string& ckpt, const std::string& fragment) {
  scratch_dir other;
  auto fresh = tiers::make_store(small_store_config(other));
  try {
    tiers::restore_checkpoint(*fresh, ckpt);
    ADD_FAILURE() << "restored a bad checkpoint";
  } catch (const checkpoint_error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(ckpt), std::string::npos) << e.what();
  }
  EXPECT_EQ(fresh->block_count(), 0u) << "a refused restore changed the store";
}

void patch(const std::string& path, off_t offset, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), offset), ssize_t(bytes.size()));
  ::close(fd);
}

TEST(checkpoint, corrupt_truncated_missing_and_mismatched_checkpoints_are_refused) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  populate(*store, 3);
  const std::string ckpt = dir.sub("ckpt");
  tiers::write_checkpoint(*store, ckpt);
  const std::string data = ckpt + "/blocks-1.bin";
  const std::string manifest = ckpt + "/manifest.json";

  expect_refusal(dir.sub("nowhere"), "no checkpoint here");

  // A flipped byte in a block.
  patch(data, 300000 + 4096 + 10, "X");
  expect_refusal(ckpt, "\"l0.w\": checksum mismatch");
  tiers::write_checkpoint(*store, ckpt);  // generation 2, good again
  const std::string data2 = ckpt + "/blocks-2.bin";

  // Truncated data.
  std::filesystem::resize_file(data2, 4096);
  expect_refusal(ckpt, "truncated");
  tiers::write_checkpoint(*store, ckpt);

  // A changed manifest (its own checksum no longer matches).
  patch(manifest, 5, "7");
  expect_refusal(ckpt, "corrupt manifest");
  std::filesystem::remove(manifest);
  expect_refusal(ckpt, "no checkpoint here");
  tiers::write_checkpoint(*store, ckpt);

  // A store holding other blocks.
  scratch_dir other;
  auto different = tiers::make_store(small_store_config(other));
  different->create_block({.name = "embed", .size_bytes = 300000, .home = tier_kind::nvme});
  EXPECT_THROW(tiers::restore_checkpoint(*different, ckpt), checkpoint_error);
  scratch_dir third;
  auto renamed = tiers::make_store(small_store_config(third));
  const model m;
  for (std::size_t i = 0; i < m.blocks.size(); ++i)
    renamed->create_block({.name = i == 3 ? "l1.weight" : m.blocks[i].first, .size_bytes = m.blocks[i].second,
                           .home = i % 2 == 0 ? tier_kind::nvme : tier_kind::host});
  try {
    tiers::restore_checkpoint(*renamed, ckpt);
    FAIL();
  } catch (const checkpoint_error& e) {
    EXPECT_NE(std::string(e.what()).find("mismatch"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tierflow::test
