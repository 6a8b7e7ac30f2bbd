// Kill a checkpoint writer at random instants: every time, the directory must
// hold a checkpoint that restores completely, of one consistent version, never
// older than the last one seen.
//
// Its own binary: the test forks, and forks from a process without threads.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>

#include "store_fixture.hpp"
#include "tierflow/tiers/checkpoint.hpp"

namespace tierflow::test {
namespace {

constexpr int block_count = 12;
constexpr std::uint64_t block_bytes = 192u << 10;

// Block i of version v: v in its first 8 bytes, then fill(v * 1000 + i).
void write_version(std::span<std::byte> bytes, std::uint64_t v, int i) {
  std::memcpy(bytes.data(), &v, 8);
  fill(bytes.subspan(8), v * 1000 + std::uint64_t(i));
}

std::uint64_t version_of(std::span<const std::byte> bytes, int i, bool& intact) {
  std::uint64_t v = 0;
  std::memcpy(&v, bytes.data(), 8);
  intact = holds(bytes.subspan(8), v * 1000 + std::uint64_t(i));
  return v;
}

tiers::store_config config(const scratch_dir& dir) {
  small_store_sizes sizes;
  sizes.host = 4u << 20;
  return small_store_config(dir, sizes);
}

// The writer: versions start past `first` and go up, one checkpoint each.
// Its store's files go in `dir`, which the parent made and removes: the
// writer is killed, and never runs a destructor.
[[noreturn]] void run_writer(const std::string& ckpt, std::uint64_t first, const scratch_dir& dir) {
  try {
    auto store = tiers::make_store(config(dir));
    std::vector<block_id> ids;
    for (int i = 0; i < block_count; ++i)
      ids.push_back(store->create_block({.name = "b" + std::to_string(i), .size_bytes = block_bytes,
                                         .home = i % 2 ? tier_kind::nvme : tier_kind::host}));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (std::uint64_t v = first + 1; std::chrono::steady_clock::now() < deadline; ++v) {
      for (int i = 0; i < block_count; ++i) {
        lease l = store->acquire(ids[i], i % 3 ? tier_kind::host : tier_kind::device, access::write);
        write_version(l.wait(), v, i);
        store->release(std::move(l), dirty::yes);
      }
      tiers::write_checkpoint(*store, ckpt);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "writer: %s\n", e.what());
    ::_exit(2);
  }
  ::_exit(0);
}

TEST(checkpoint_crash, a_writer_killed_at_any_instant_leaves_a_usable_checkpoint) {
  scratch_dir dir;
  const std::string ckpt = dir.sub("ckpt");
  std::mt19937 rng(12345);
  std::uint64_t newest = 0;  // the newest version restored so far
  int restored = 0;
  // Kills land 2-62 ms into a writer's life; until a first checkpoint exists
  // the window moves later each round, so a loaded machine (a slow first
  // checkpoint) still gets most rounds past one instead of failing the count.
  std::uint32_t earliest_us = 2000;
  for (int round = 0; round < 24; ++round) {
    const scratch_dir writer_dir;
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) run_writer(ckpt, newest, writer_dir);
    std::this_thread::sleep_for(std::chrono::microseconds(earliest_us + rng() % 60000));
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the writer ended by itself (status " << status << ")";

    scratch_dir scratch;
    auto store = tiers::make_store(config(scratch));
    try {
      tiers::restore_checkpoint(*store, ckpt);
    } catch (const checkpoint_error& e) {
      // Only acceptable before any checkpoint was ever completed.
      ASSERT_EQ(newest, 0u) << "round " << round << ": " << e.what();
      ASSERT_NE(std::string(e.what()).find("no checkpoint here"), std::string::npos) << e.what();
      earliest_us = std::min<std::uint32_t>(earliest_us * 2, 2'000'000);
      continue;
    }
    std::uint64_t version = 0;
    for (int i = 0; i < block_count; ++i) {
      lease l = store->acquire(block_id{std::uint32_t(i)}, tier_kind::host);
      bool intact = false;
      const std::uint64_t v = version_of(l.wait(), i, intact);
      ASSERT_TRUE(intact) << "round " << round << ": block " << i << " torn";
      if (i == 0) version = v;
      ASSERT_EQ(v, version) << "round " << round << ": blocks from different versions";
    }
    ASSERT_GE(version, newest) << "round " << round << ": an older checkpoint came back";
    newest = version;
    ++restored;
  }
  EXPECT_GT(restored, 12) << "too few rounds got as far as a checkpoint";
  std::printf("restored %d of 24 killed writers; newest version %llu\n", restored,
              static_cast<unsigned long long>(newest));
}

}  // namespace
}  // namespace tierflow::test
