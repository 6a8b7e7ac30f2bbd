// Randomized stress of the residency state machine: many threads acquiring,
// releasing, prefetching and evicting at random on small tiers (so eviction
// and write-back never stop), checked against a simple model — the newest
// version written to each block — and against the store's own invariants.
//
// The model's version counters are plain integers on purpose: a write lease
// must exclude every other lease of the block, and TSan reports any overlap
// the store lets through as a data race on them.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "store_fixture.hpp"

namespace tierflow::test {
namespace {

std::uint64_t seed_of(std::size_t block, std::uint64_t version) {
  return (std::uint64_t(block) << 32) ^ (version * 0x9e3779b97f4a7c15ull);
}

struct stress_params {
  int threads = 8;
  int ops_per_thread = 400;
  int blocks = 24;
};

void run_stress(const stress_params& p, std::uint64_t seed) {
  scratch_dir dir;
  small_store_sizes sizes;
  sizes.device = 1u << 20;
  sizes.host = 3u << 19;  // 1.5 MiB
  sizes.nvme = 64u << 20;
  auto store = tiers::make_store(small_store_config(dir, sizes));

  std::mt19937_64 setup(seed);
  std::vector<block_id> ids;
  std::vector<std::uint64_t> version(p.blocks, 0);  // guarded by the blocks' write leases
  for (int i = 0; i < p.blocks; ++i) {
    const std::uint64_t bytes = 16384 + setup() % (176u << 10);  // 16 KiB .. 192 KiB
    const tier_kind home = i % 4 == 0 ? tier_kind::host : tier_kind::nvme;
    ids.push_back(store->create_block({.name = "blk" + std::to_string(i), .size_bytes = bytes, .home = home}));
    lease l = store->acquire(ids.back(), tier_kind::host, access::write);
    fill(l.wait(), seed_of(i, 0));
    store->release(std::move(l), dirty::yes);
  }

  std::atomic<int> failures{0};
  std::atomic<std::uint64_t> reads{0}, writes{0};
  auto worker = [&](int thread) {
    std::mt19937_64 rng(seed * 1000 + thread);
    const tier_kind memory_tiers[] = {tier_kind::device, tier_kind::host};
    const tier_kind any_tier[] = {tier_kind::device, tier_kind::host, tier_kind::nvme};
    for (int op = 0; op < p.ops_per_thread; ++op) {
      const std::size_t b = rng() % ids.size();
      const unsigned dice = unsigned(rng() % 100);
      if (dice < 40) {  // read somewhere
        const tier_kind t = any_tier[rng() % 3];
        lease l = store->acquire(ids[b], t);
        const auto bytes = l.wait();
        const copy_state s = store->state(ids[b], t);
        if (!holds_data(s)) ++failures;
        if (t != tier_kind::nvme && !holds(bytes, seed_of(b, version[b]))) ++failures;
        ++reads;
        store->release(std::move(l), dirty::no);
      } else if (dice < 60) {  // write in a memory tier
        const tier_kind t = memory_tiers[rng() % 2];
        lease l = store->acquire(ids[b], t, access::write);
        const auto bytes = l.wait();
        if (!holds(bytes, seed_of(b, version[b]))) ++failures;
        const bool change = rng() % 4 != 0;
        if (change) {
          ++version[b];
          fill(bytes, seed_of(b, version[b]));
        }
        ++writes;
        store->release(std::move(l), change ? dirty::yes : dirty::no);
      } else if (dice < 68) {  // overwrite: no load, every byte replaced
        const tier_kind t = memory_tiers[rng() % 2];
        lease l = store->acquire(ids[b], t, access::overwrite);
        const auto bytes = l.wait();
        if (rng() % 5 == 0) {
          store->release(std::move(l), dirty::no);  // wrote nothing
        } else {
          ++version[b];
          fill(bytes, seed_of(b, version[b]));
          ++writes;
          store->release(std::move(l), dirty::yes);
        }
      } else if (dice < 80) {
        store->prefetch(ids[b], any_tier[rng() % 3]);
      } else if (dice < 96) {  // evict
        store->evict(ids[b], any_tier[rng() % 3]);
      } else if (dice < 98) {
        store->check_invariants();
      } else {
        lease l = store->acquire(ids[b], tier_kind::host);  // dropped without release or wait
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < p.threads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();

  EXPECT_EQ(failures.load(), 0);
  store->flush();
  store->check_invariants();
  for (int i = 0; i < p.blocks; ++i) {
    for (tier_kind t : {tier_kind::host, tier_kind::device}) {
      lease l = store->acquire(ids[i], t);
      EXPECT_TRUE(holds(l.wait(), seed_of(i, version[i]))) << "block " << i << " in " << name(t);
    }
  }
  const store_telemetry tel = store->telemetry();
  for (const tier_telemetry& x : tel.tiers) EXPECT_LE(x.high_water, x.budget) << x.name;
  EXPECT_GT(tel.writebacks, 0u);
  EXPECT_GT(reads.load(), 0u);
  EXPECT_GT(writes.load(), 0u);
}

TEST(store_stress, random_operations_from_many_threads_match_the_model) {
  for (std::uint64_t seed : {1, 2, 3}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    run_stress({}, seed);
  }
}

}  // namespace
}  // namespace tierflow::test
