// The prefetch scheduler and the pipelined optimizer stream over a real store:
// pinned host memory and NVMe extents on a real filesystem, real io threads.
#include "tierflow/core/scheduler.hpp"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include "../cli/temp_dir.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/optimizer_stream.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace tierflow {
namespace {

constexpr std::uint64_t mib = 1ull << 20;

std::unique_ptr<block_store> make_test_store(const std::string& dir, std::uint64_t host_budget,
                                             lease_holder holder = lease_holder::any_thread) {
  tiers::store_config c;
  c.store.holder = holder;
  c.host = tiers::host_tier_options{.budget = host_budget, .pin = tiers::pinning::none, .touch_threads = 1};
  c.nvme = tiers::nvme_tier_options{.directory = dir + "/nvme", .budget = 256 * mib, .file_size = 64 * mib};
  return tiers::make_store(std::move(c));
}

// Creates `count` blocks of `bytes` at home on NVMe, block k filled with float k.
std::vector<block_id> make_blocks(block_store& store, std::size_t count, std::uint64_t bytes,
                                  const std::string& prefix) {
  std::vector<block_id> ids;
  for (std::size_t k = 0; k < count; ++k) {
    const block_id id = store.create_block(
        {.name = prefix + std::to_string(k), .size_bytes = bytes, .home = tier_kind::nvme});
    lease l = store.acquire(id, tier_kind::host, access::write);
    auto data = l.wait();
    const float value = static_cast<float>(k);
    float* f = reinterpret_cast<float*>(data.data());
    std::fill(f, f + bytes / sizeof(float), value);
    store.release(std::move(l), dirty::yes);
    store.evict(id, tier_kind::host);
    ids.push_back(id);
  }
  store.flush();
  return ids;
}

bool all_equal(std::span<const std::byte> data, float value) {
  const float* f = reinterpret_cast<const float*>(data.data());
  for (std::size_t i = 0; i < data.size() / sizeof(float); ++i) {
    if (f[i] != value) return false;
  }
  return true;
}

void run_iteration(prefetch_scheduler& s, const std::vector<block_id>& order, std::chrono::milliseconds compute) {
  s.begin_iteration();
  for (const block_id id : order) {
    lease l = s.acquire(id, tier_kind::host);
    EXPECT_TRUE(all_equal(l.data(), static_cast<float>(id.value))) << "block " << id.value;
    std::this_thread::sleep_for(compute);  // the compute that uses the block
    s.release(std::move(l), dirty::no);
  }
  s.end_iteration();
}

TEST(Scheduler, RecordsTheFirstIterationThenPrefetchesAhead) {
  testing::temp_dir dir;
  // Room for 6 of the 16 blocks: the schedule cannot be held, it must stream.
  auto store = make_test_store(dir.path(), 6 * mib);
  const auto ids = make_blocks(*store, 16, mib, "layer");
  auto host_loads = [&] {
    for (const auto& tier : store->telemetry().tiers) {
      if (tier.kind == tier_kind::host) return tier.loads;
    }
    return std::uint64_t{0};
  };
  const std::uint64_t loads_before = host_loads();
  prefetch_scheduler sched(*store);
  run_iteration(sched, ids, std::chrono::milliseconds(4));
  // The recorded iteration is served on demand: every block is loaded as it
  // is asked for and nothing ahead of it. (How many of those loads a caller
  // waits on is timing: a load from the page cache can finish before the
  // caller looks, so the count of stalls is not what this checks.)
  EXPECT_EQ(sched.schedule().size(), ids.size());
  EXPECT_EQ(store->telemetry().prefetches, 0u);
  EXPECT_EQ(host_loads() - loads_before, ids.size());
  const auto recording_stalls = sched.stats().stalled_accesses;

  constexpr int steady_iterations = 3;
  for (int i = 0; i < steady_iterations; ++i) run_iteration(sched, ids, std::chrono::milliseconds(4));
  const auto steady_stalls = sched.stats().stalled_accesses - recording_stalls;
  const auto t = store->telemetry();
  // Every block the host tier cannot keep is loaded ahead of its use.
  EXPECT_GE(t.prefetches, steady_iterations * (ids.size() - 6));
  // Prefetching hides most loads (a load of 1 MiB takes well under the 4 ms of
  // compute between accesses): most accesses find their block ready.
  EXPECT_LT(steady_stalls, steady_iterations * ids.size() / 2) << "prefetch did not hide the loads";
  EXPECT_LE(sched.stats().lookahead, 64u);
  for (const auto& tier : t.tiers) EXPECT_LE(tier.high_water, tier.budget) << tier.name;
  EXPECT_EQ(sched.stats().rerecords, 0u);
  EXPECT_EQ(sched.stats().per_access_stall.size(), ids.size());
}

// A store with a (stand-in) device tier above host memory and NVMe.
std::unique_ptr<block_store> make_device_store(const std::string& dir, std::uint64_t device_budget,
                                               std::uint64_t host_budget) {
  tiers::store_config c;
  c.device = tiers::device_tier_options{.budget = device_budget, .backend = tiers::device_backend::stand_in};
  c.host = tiers::host_tier_options{.budget = host_budget, .pin = tiers::pinning::none, .touch_threads = 1};
  c.nvme = tiers::nvme_tier_options{.directory = dir + "/nvme", .budget = 256 * mib, .file_size = 64 * mib};
  return tiers::make_store(std::move(c));
}

std::uint64_t link_bytes(const block_store& store, const std::string& name) {
  for (const auto& l : store.telemetry().links) {
    if (l.name == name) return l.bytes;
  }
  ADD_FAILURE() << "no link " << name;
  return 0;
}

// A reuse distance longer than the host tier can hold (DeepSpeed's
// stage3_max_reuse_distance, given to a ZeRO-3 run whose shards stream from
// NVMe through host memory): a released copy is evicted all the same, so that
// the prefetches have their room, and every block is read once an iteration —
// not twice, as when kept copies and prefetches evicted each other.
TEST(Scheduler, ReadsEachBlockOnceAnIterationWhateverTheReuseDistance) {
  testing::temp_dir dir;
  auto store = make_test_store(dir.path(), 4 * mib);  // 4 of the 16 blocks
  const auto ids = make_blocks(*store, 16, mib, "shard");
  prefetch_scheduler sched(*store, {.evict_distance = 1000});
  run_iteration(sched, ids, std::chrono::milliseconds(1));  // recorded
  // Each steady iteration's end prefetches the next one's first blocks, as
  // many as its window (at most 3 of the 4 blocks' room, budget_share 0.75),
  // and the window follows the measured times: counted from the end of one
  // iteration, the reads are whole iterations' within one window's blocks.
  run_iteration(sched, ids, std::chrono::milliseconds(1));
  const std::uint64_t before = link_bytes(*store, "nvme->host");
  constexpr std::uint64_t steady_iterations = 3, window = 3;
  for (std::uint64_t i = 0; i < steady_iterations; ++i) run_iteration(sched, ids, std::chrono::milliseconds(1));
  const std::uint64_t read = link_bytes(*store, "nvme->host") - before;
  EXPECT_LE(read, (steady_iterations * ids.size() + window) * mib);
  EXPECT_GE(read, (steady_iterations * ids.size() - window) * mib);
  EXPECT_GT(store->telemetry().prefetches, 0u);
  for (const auto& tier : store->telemetry().tiers) EXPECT_LE(tier.high_water, tier.budget) << tier.name;
}

void run_on_device(prefetch_scheduler& s, const std::vector<block_id>& order) {
  s.begin_iteration();
  for (const block_id id : order) {
    lease l = s.acquire(id, tier_kind::device);
    EXPECT_TRUE(all_equal(l.data(), static_cast<float>(id.value))) << "block " << id.value;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    s.release(std::move(l), dirty::no);
  }
  s.end_iteration();
}

// With prefetch into the device off (DeepSpeed's stage3_prefetch_bucket_size
// 0), staging still reads the NVMe blocks into host memory ahead of their
// use, within its share of the host tier beside the blocks homed there;
// without staging every block comes from NVMe when it is asked for.
TEST(Scheduler, StagesNvmeBlocksInHostMemoryWhenDevicePrefetchIsOff) {
  struct result {
    std::uint64_t staged = 0, direct = 0, from_host = 0, prefetches = 0;
  };
  std::vector<result> results;
  for (const double staging : {0.0, 0.75}) {
    testing::temp_dir dir;
    // Room on the device for two of the 1 MiB blocks; the host tier has 8 MiB,
    // 2 of them taken by blocks homed there: 6 MiB of room, 4.5 to stage in.
    auto store = make_device_store(dir.path(), 2 * mib, 8 * mib);
    const auto ids = make_blocks(*store, 12, mib, "layer");
    for (int k = 0; k < 2; ++k)
      store->create_block({.name = "homed" + std::to_string(k), .size_bytes = mib, .home = tier_kind::host});
    // A forward and a backward: each block is used twice, far apart.
    std::vector<block_id> order(ids);
    order.insert(order.end(), ids.rbegin(), ids.rend());
    prefetch_scheduler sched(*store, {.budget_share = 0, .staging_share = staging});
    const std::uint64_t made = link_bytes(*store, "nvme->host");  // make_blocks' writes load the blocks
    run_on_device(sched, order);  // recorded: on demand
    EXPECT_EQ(link_bytes(*store, "nvme->host"), made) << "the recorded iteration staged";
    const std::uint64_t direct_before = link_bytes(*store, "nvme->device");
    for (int i = 0; i < 3; ++i) run_on_device(sched, order);
    const auto t = store->telemetry();
    results.push_back({.staged = link_bytes(*store, "nvme->host") - made,
                       .direct = link_bytes(*store, "nvme->device") - direct_before,
                       .from_host = link_bytes(*store, "host->device"),
                       .prefetches = t.prefetches});
    for (const auto& tier : t.tiers) EXPECT_LE(tier.high_water, tier.budget) << tier.name;
    EXPECT_EQ(sched.stats().rerecords, 0u);
  }
  const result& off = results[0];
  const result& on = results[1];
  EXPECT_EQ(off.prefetches, 0u);
  EXPECT_EQ(off.staged, 0u);
  EXPECT_EQ(off.from_host, 0u);
  EXPECT_GT(off.direct, 0u);
  // Staged: the device's loads come from host memory, and NVMe is read no
  // more than on demand (a staged copy used again soon stays; a stage that
  // a busy machine delays past its use is read directly too, so "most").
  EXPECT_GT(on.prefetches, 0u);
  EXPECT_GE(on.from_host, (off.direct + off.from_host) / 2);
  EXPECT_LE(on.staged + on.direct, off.direct + off.direct / 4);
}

// An optimizer's pass after the backward overwrites every block's host copy
// (last layer first, as ZenFlow writes its masters back). Staging then must
// not read a block ahead of its overwrite (those bytes would be discarded),
// and the copies written last, which the next forward reads first, stay in
// host memory for it instead of going to NVMe and coming back.
TEST(Scheduler, StagesNothingAnOverwriteDiscardsAndKeepsWrittenCopiesUsedNext) {
  testing::temp_dir dir;
  // Two 1 MiB blocks of device room; 4 MiB of host memory, 3 to stage in.
  auto store = make_device_store(dir.path(), 2 * mib, 4 * mib);
  const auto ids = make_blocks(*store, 8, mib, "layer");
  prefetch_scheduler sched(*store, {.budget_share = 0, .staging_share = 0.75});
  std::vector<float> value(ids.size());
  for (std::size_t k = 0; k < ids.size(); ++k) value[k] = static_cast<float>(k);
  auto read_on_device = [&](std::size_t k) {
    lease l = sched.acquire(ids[k], tier_kind::device);
    EXPECT_TRUE(all_equal(l.data(), value[k])) << "layer " << k;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    sched.release(std::move(l), dirty::no);
  };
  for (int iteration = 0; iteration < 4; ++iteration) {
    SCOPED_TRACE("iteration " + std::to_string(iteration));
    sched.begin_iteration();
    for (std::size_t k = 0; k < ids.size(); ++k) read_on_device(k);
    for (std::size_t k = ids.size(); k-- > 0;) read_on_device(k);
    if (iteration > 0) {  // the recorded iteration stages nothing at all
      // Every block is overwritten before the next forward reads it: none is staged for it.
      for (std::size_t k = 0; k < ids.size(); ++k)
        EXPECT_FALSE(store->present_in(ids[k], tier_kind::host)) << "layer " << k << " staged before its overwrite";
    }
    for (std::size_t k = ids.size(); k-- > 0;) {
      lease l = sched.acquire(ids[k], tier_kind::host, access::overwrite);
      value[k] = static_cast<float>(100 * (iteration + 1) + k);
      const auto data = l.wait();
      std::fill(reinterpret_cast<float*>(data.data()), reinterpret_cast<float*>(data.data() + data.size()),
                value[k]);
      sched.release(std::move(l), dirty::yes);
    }
    sched.end_iteration();
    // The next forward's first block stays, not even written back yet.
    if (iteration > 0) {
      EXPECT_EQ(store->state(ids[0], tier_kind::host), copy_state::dirty);
    }
  }
  EXPECT_EQ(sched.stats().rerecords, 0u);
  for (const auto& tier : store->telemetry().tiers) EXPECT_LE(tier.high_water, tier.budget) << tier.name;
  // Every value written reached its home.
  store->flush();
  for (std::size_t k = 0; k < ids.size(); ++k) {
    store->evict(ids[k], tier_kind::host);
    store->evict(ids[k], tier_kind::device);
  }
  store->flush();
  for (std::size_t k = 0; k < ids.size(); ++k) {
    lease l = store->acquire(ids[k], tier_kind::host);
    EXPECT_TRUE(all_equal(l.wait(), value[k])) << "layer " << k;
    store->release(std::move(l), dirty::no);
  }
}

TEST(Scheduler, ReRecordsWhenTheOrderChanges) {
  testing::temp_dir dir;
  auto store = make_test_store(dir.path(), 8 * mib);
  const auto ids = make_blocks(*store, 6, mib, "b");
  prefetch_scheduler sched(*store);
  run_iteration(sched, ids, std::chrono::milliseconds(0));
  run_iteration(sched, ids, std::chrono::milliseconds(0));
  std::vector<block_id> reversed(ids.rbegin(), ids.rend());
  run_iteration(sched, reversed, std::chrono::milliseconds(0));
  EXPECT_EQ(sched.stats().rerecords, 1u);
  ASSERT_EQ(sched.schedule().size(), reversed.size());
  for (std::size_t i = 0; i < reversed.size(); ++i) EXPECT_EQ(sched.schedule()[i].block, reversed[i]);
  run_iteration(sched, reversed, std::chrono::milliseconds(0));
  EXPECT_EQ(sched.stats().rerecords, 1u);
}

// An iteration that asks for nothing (every block read past the scheduler,
// as the ZeRO-3 engine's gathers read NVMe into their buffers) departs from
// the schedule: the next iterations prefetch nothing, where the stale
// schedule would load each iteration host copies no one reads.
TEST(Scheduler, AnIterationWithoutAccessesLeavesNothingToPrefetch) {
  testing::temp_dir dir;
  auto store = make_test_store(dir.path(), 8 * mib);
  const auto ids = make_blocks(*store, 6, mib, "b");
  prefetch_scheduler sched(*store);
  run_iteration(sched, ids, std::chrono::milliseconds(0));
  run_iteration(sched, ids, std::chrono::milliseconds(0));
  // The first iteration without accesses still begins on the old schedule
  // (it cannot know), and departs from it.
  run_iteration(sched, {}, std::chrono::milliseconds(0));
  EXPECT_TRUE(sched.schedule().empty());
  EXPECT_EQ(sched.stats().rerecords, 1u);
  store->flush();  // (its prefetches done)
  for (const block_id id : ids) store->evict(id, tier_kind::host);
  const auto prefetches = store->telemetry().prefetches;
  const auto loaded = link_bytes(*store, "nvme->host");
  run_iteration(sched, {}, std::chrono::milliseconds(0));
  run_iteration(sched, {}, std::chrono::milliseconds(0));
  store->flush();
  EXPECT_EQ(store->telemetry().prefetches, prefetches);
  EXPECT_EQ(link_bytes(*store, "nvme->host"), loaded);
  // The next iteration that asks is recorded afresh, and the one after it prefetches.
  run_iteration(sched, ids, std::chrono::milliseconds(0));
  EXPECT_EQ(sched.schedule().size(), ids.size());
  EXPECT_EQ(sched.stats().rerecords, 1u);
}

// A gradient buffer that each iteration overwrites before anything reads it:
// the scheduler must not load its stale bytes ahead of the overwrite.
TEST(Scheduler, DoesNotPrefetchWhatIsOverwritten) {
  testing::temp_dir dir;
  auto store = make_test_store(dir.path(), 8 * mib);
  const auto ids = make_blocks(*store, 4, mib, "grad");
  auto host_loads = [&] {
    for (const auto& tier : store->telemetry().tiers) {
      if (tier.kind == tier_kind::host) return tier.loads;
    }
    return std::uint64_t{0};
  };
  const std::uint64_t loads_before = host_loads();
  prefetch_scheduler sched(*store);
  for (int i = 0; i < 3; ++i) {
    sched.begin_iteration();
    for (const block_id id : ids) {
      lease l = sched.acquire(id, tier_kind::host, access::overwrite);
      std::memset(l.wait().data(), 0, mib);
      sched.release(std::move(l), dirty::yes);
      store->evict(id, tier_kind::host);
    }
    sched.end_iteration();
    store->flush();
  }
  EXPECT_EQ(store->telemetry().prefetches, 0u);
  EXPECT_EQ(host_loads(), loads_before) << "an overwritten block was loaded";
}

// One thread holds every lease and asks for a block whose room only the
// release of its own leases could make (they fragment the 16 KiB tier): the
// acquire fails at once with EDEADLK naming them, the prefetch hint for that
// block along the way is dropped rather than failed, and once a lease ends
// the same access is served and the iteration goes on.
TEST(Scheduler, ASingleHolderWhoseOwnLeasesHoldTheRoomFailsAtOnce) {
  testing::temp_dir dir;
  constexpr std::uint64_t page = 4096;
  auto store = make_test_store(dir.path(), 4 * page, lease_holder::waiting_thread);
  const auto pages = make_blocks(*store, 3, page, "p");
  const block_id wide = make_blocks(*store, 1, 2 * page, "wide")[0];
  prefetch_scheduler sched(*store);
  sched.set_schedule({{pages[0]}, {pages[1]}, {pages[2]}, {wide}});
  sched.begin_iteration();
  lease a = sched.acquire(pages[0], tier_kind::host);
  lease b = sched.acquire(pages[1], tier_kind::host);
  lease c = sched.acquire(pages[2], tier_kind::host);  // hints `wide`: no room, dropped
  EXPECT_GE(store->telemetry().prefetches_dropped, 1u);
  sched.release(std::move(b), dirty::no);  // its copy stays cached between or beside the others
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)sched.acquire(wide, tier_kind::host);
    FAIL() << "the acquire was granted";
  } catch (const error& e) {
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
    EXPECT_EQ(e.errnum(), EDEADLK);
    const std::string what = e.what();
    EXPECT_NE(what.find("block \"wide0\" (8.00 KiB)"), std::string::npos) << what;
    EXPECT_NE(what.find("largest free piece 4.00 KiB"), std::string::npos) << what;
    EXPECT_NE(what.find("\"p0\" (4.00 KiB)"), std::string::npos) << what;
    EXPECT_NE(what.find("\"p2\" (4.00 KiB)"), std::string::npos) << what;
  }
  sched.release(std::move(c), dirty::no);
  lease w = sched.acquire(wide, tier_kind::host);
  EXPECT_EQ(w.data().size(), 2 * page);
  sched.release(std::move(w), dirty::no);
  sched.release(std::move(a), dirty::no);
  sched.end_iteration();
  store->check_invariants();
}

TEST(Scheduler, GivenScheduleIsCheckedAgainstTheStore) {
  testing::temp_dir dir;
  auto store = make_test_store(dir.path(), 4 * mib);
  prefetch_scheduler sched(*store);
  EXPECT_THROW(sched.set_schedule({{block_id{42}, tier_kind::host}}), user_error);
  const auto ids = make_blocks(*store, 1, mib, "x");
  EXPECT_THROW(sched.set_schedule({{ids[0], tier_kind::device}}), user_error);  // no device tier
  EXPECT_NO_THROW(sched.set_schedule({{ids[0], tier_kind::host}}));
}

// The pipelined optimizer step: 8 sub-groups of 3 blocks streamed through a
// host tier that holds 3 of them; every byte comes back updated.
TEST(OptimizerStream, StreamsSubGroupsThroughABoundedHostTier) {
  testing::temp_dir dir;
  constexpr std::uint64_t block = 256 * 1024;
  auto store = make_test_store(dir.path(), 9 * block + 4096);
  const auto ids = make_blocks(*store, 24, block, "state");
  std::vector<sub_group> groups(8);
  for (std::size_t g = 0; g < 8; ++g) groups[g].blocks = {ids[3 * g], ids[3 * g + 1], ids[3 * g + 2]};

  std::vector<std::size_t> order;
  const auto update = [&](std::size_t index, std::span<const std::span<std::byte>> buffers) {
    order.push_back(index);
    ASSERT_EQ(buffers.size(), 3u);
    for (const auto& b : buffers) {
      float* f = reinterpret_cast<float*>(b.data());
      for (std::size_t i = 0; i < b.size() / sizeof(float); ++i) f[i] += 100.0f;
    }
  };
  for (int step = 0; step < 3; ++step) {
    const auto stats = run_optimizer_stream(*store, groups, update);
    EXPECT_EQ(stats.bytes, 24 * block);
  }
  EXPECT_EQ(order.size(), 24u);
  for (std::size_t k = 0; k < ids.size(); ++k) {
    lease l = store->acquire(ids[k], tier_kind::host);
    EXPECT_TRUE(all_equal(l.wait(), static_cast<float>(k) + 300.0f)) << "block " << k;
    store->release(std::move(l), dirty::no);
  }
  for (const auto& tier : store->telemetry().tiers) EXPECT_LE(tier.high_water, tier.budget) << tier.name;
}

// Overwritten blocks are written without being read (no load from NVMe) and
// reach home; blocks leased read-only come back clean (no write-back).
TEST(OptimizerStream, OverwrittenBlocksAreNotReadAndReadOnesAreNotWritten) {
  testing::temp_dir dir;
  constexpr std::uint64_t block = 64 * 1024;
  auto store = make_test_store(dir.path(), 4 * block);
  const auto ids = make_blocks(*store, 6, block, "s");
  std::vector<sub_group> groups(6);
  for (std::size_t g = 0; g < 6; ++g) groups[g] = {{ids[g]}, {access::overwrite}};
  const std::uint64_t read_before = link_bytes(*store, "nvme->host");
  run_optimizer_stream(*store, groups, [&](std::size_t index, std::span<const std::span<std::byte>> b) {
    float* f = reinterpret_cast<float*>(b[0].data());
    std::fill(f, f + b[0].size() / sizeof(float), 10.0f + static_cast<float>(index));
  });
  EXPECT_EQ(link_bytes(*store, "nvme->host"), read_before);
  EXPECT_EQ(link_bytes(*store, "host->nvme"), 6 * block + 6 * block);  // make_blocks', then these

  for (auto& g : groups) g.modes = {access::read};
  const std::uint64_t writebacks = store->telemetry().writebacks;
  std::vector<float> seen;
  run_optimizer_stream(*store, groups, [&](std::size_t, std::span<const std::span<std::byte>> b) {
    EXPECT_TRUE(all_equal(b[0], 10.0f + static_cast<float>(seen.size())));
    seen.push_back(0);
  });
  EXPECT_EQ(seen.size(), 6u);
  EXPECT_EQ(store->telemetry().writebacks, writebacks);
  EXPECT_EQ(link_bytes(*store, "nvme->host") - read_before, 6 * block);
}

// One sub-group per block, written.
std::vector<sub_group> a_group_each(const std::vector<block_id>& ids) {
  std::vector<sub_group> groups(ids.size());
  for (std::size_t g = 0; g < ids.size(); ++g) groups[g].blocks = {ids[g]};
  return groups;
}

// A paced stream: sub-group i starts no earlier than its share of the span
// (four equal sub-groups over 200 ms: at 0, 50, 100 and 150 ms), and every
// byte is still updated; hurry() from another thread ends the pacing at once.
TEST(OptimizerStream, APacedStreamSpreadsItsSubGroupsAndHurryEndsThePace) {
  using namespace std::chrono_literals;
  using clock = std::chrono::steady_clock;
  testing::temp_dir dir;
  constexpr std::uint64_t block = 64 * 1024;
  auto store = make_test_store(dir.path(), 16 * block);
  const auto ids = make_blocks(*store, 4, block, "s");
  const auto groups = a_group_each(ids);
  std::vector<clock::duration> started;
  clock::time_point t0;
  const auto update = [&](std::size_t, std::span<const std::span<std::byte>> b) {
    started.push_back(clock::now() - t0);
    float* f = reinterpret_cast<float*>(b[0].data());
    for (std::size_t i = 0; i < b[0].size() / sizeof(float); ++i) f[i] += 1.0f;
  };

  optimizer_stream_options options;
  const auto plain = run_optimizer_stream(*store, groups, update, options);
  EXPECT_EQ(plain.paced, 0ns);

  stream_pace pace(200ms);
  options.pace = &pace;
  started.clear();
  t0 = clock::now();
  const auto paced = run_optimizer_stream(*store, groups, update, options);
  ASSERT_EQ(started.size(), 4u);
  for (std::size_t i = 1; i < 4; ++i) EXPECT_GE(started[i], i * 50ms) << "sub-group " << i;
  EXPECT_GT(paced.paced, 0ns);
  EXPECT_LE(paced.paced, paced.total);
  for (std::size_t k = 0; k < 4; ++k) {
    lease l = store->acquire(ids[k], tier_kind::host);
    EXPECT_TRUE(all_equal(l.wait(), static_cast<float>(k) + 2.0f)) << "block " << k;
    store->release(std::move(l), dirty::no);
  }

  // A span of a minute, hurried after 20 ms: the stream ends long before.
  pace.reset(std::chrono::minutes(1));
  EXPECT_FALSE(pace.hurried());
  std::thread hurrier([&] {
    std::this_thread::sleep_for(20ms);
    pace.hurry();
  });
  const auto hurried = run_optimizer_stream(*store, groups, update, options);
  hurrier.join();
  EXPECT_LT(hurried.total, 30s);
  EXPECT_TRUE(pace.hurried());
  EXPECT_EQ(pace.spread_over(), 0ns);  // hurried: a stream started now is not paced
  pace.reset(10ms);
  EXPECT_EQ(pace.spread_over(), 10ms);
}

TEST(OptimizerStream, AnUpdateThatThrowsStopsTheStepAndLeavesEarlierGroupsWritten) {
  testing::temp_dir dir;
  constexpr std::uint64_t block = 64 * 1024;
  auto store = make_test_store(dir.path(), 16 * block);
  const auto ids = make_blocks(*store, 4, block, "s");
  const auto groups = a_group_each(ids);
  const auto update = [&](std::size_t index, std::span<const std::span<std::byte>> buffers) {
    if (index == 2) throw error(EIO, error_context{"update"});
    float* f = reinterpret_cast<float*>(buffers[0].data());
    for (std::size_t i = 0; i < buffers[0].size() / sizeof(float); ++i) f[i] = -1.0f;
  };
  EXPECT_THROW(run_optimizer_stream(*store, groups, update), error);
  store->flush();
  for (std::size_t k = 0; k < 4; ++k) {
    lease l = store->acquire(ids[k], tier_kind::host);
    EXPECT_TRUE(all_equal(l.wait(), k < 2 ? -1.0f : static_cast<float>(k))) << k;
    store->release(std::move(l), dirty::no);
  }
}

}  // namespace
}  // namespace tierflow
