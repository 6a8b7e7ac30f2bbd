// The block store on real tiers: bytes through every path, budgets, eviction
// with write-back, leases pinning copies, hints, failures naming the block,
// telemetry and the trace.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "store_fixture.hpp"
#include "tierflow/io/fault.hpp"

namespace tierflow::test {
namespace {

using namespace std::chrono_literals;

// Drops every cached copy (writing dirty ones home) and waits for it.
void evict_all(block_store& s, block_id id) {
  s.evict(id, tier_kind::device);
  s.evict(id, tier_kind::host);
  s.evict(id, tier_kind::nvme);
  s.flush();
}

TEST(store, bytes_survive_every_path) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  const block_id b = make(*store, "l0.w", 200 * 1024 + 17, tier_kind::nvme);

  // host -> nvme (write-back) -> host
  write(*store, b, tier_kind::host, 1);
  EXPECT_EQ(store->state(b, tier_kind::host), copy_state::dirty);
  EXPECT_EQ(store->state(b, tier_kind::nvme), copy_state::absent);  // stale home
  evict_all(*store, b);
  EXPECT_EQ(store->state(b, tier_kind::host), copy_state::absent);
  EXPECT_EQ(store->state(b, tier_kind::nvme), copy_state::valid);
  EXPECT_TRUE(reads(*store, b, tier_kind::host, 1));

  // host -> device (copy engine path), and nvme -> device (staged path)
  EXPECT_TRUE(reads(*store, b, tier_kind::device, 1));
  evict_all(*store, b);
  EXPECT_TRUE(reads(*store, b, tier_kind::device, 1));
  EXPECT_EQ(store->state(b, tier_kind::host), copy_state::absent);

  // device -> nvme (staged write-back) -> host
  write(*store, b, tier_kind::device, 2);
  evict_all(*store, b);
  EXPECT_EQ(store->state(b, tier_kind::device), copy_state::absent);
  EXPECT_TRUE(reads(*store, b, tier_kind::host, 2));

  // A copy loaded from a dirty copy is dirty too; both reach home intact.
  evict_all(*store, b);
  write(*store, b, tier_kind::device, 3);
  EXPECT_TRUE(reads(*store, b, tier_kind::host, 3));  // device -> host
  EXPECT_EQ(store->state(b, tier_kind::host), copy_state::dirty);
  store->flush();
  EXPECT_EQ(store->state(b, tier_kind::host), copy_state::valid);
  EXPECT_EQ(store->state(b, tier_kind::device), copy_state::valid);
  evict_all(*store, b);
  EXPECT_TRUE(reads(*store, b, tier_kind::device, 3));

  // A block homed on the host: device -> host write-back.
  const block_id h = make(*store, "l0.bias", 4096 * 3, tier_kind::host);
  write(*store, h, tier_kind::device, 4);
  EXPECT_EQ(store->state(h, tier_kind::host), copy_state::absent);
  evict_all(*store, h);
  EXPECT_EQ(store->state(h, tier_kind::host), copy_state::valid);
  EXPECT_TRUE(reads(*store, h, tier_kind::host, 4));
  store->check_invariants();
}

// copy_out reads a leased copy into the caller's memory: NVMe straight into
// it (no host copy made), the device stand-in by memcpy; a writer asked for
// meanwhile waits until the copy is done; bad requests are user errors.
TEST(store, copy_out_reads_a_leased_copy_into_the_callers_memory) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  const std::uint64_t size = 3 * 4096;
  const block_id b = make(*store, "shard", size, tier_kind::nvme);
  write(*store, b, tier_kind::host, 7);
  evict_all(*store, b);
  auto memory = std::unique_ptr<std::byte, decltype(&std::free)>(
      static_cast<std::byte*>(std::aligned_alloc(block_alignment, 2 * size)), &std::free);
  const std::span<std::byte> into(memory.get(), size);

  lease home = store->acquire(b, tier_kind::nvme);
  home.wait();
  std::promise<std::exception_ptr> read;
  store->copy_out(home, into, traffic_class::prefetch, [&](std::exception_ptr e) { read.set_value(e); });
  lease writer = store->acquire(b, tier_kind::host, access::write);  // waits for the lease, and the copy
  EXPECT_FALSE(read.get_future().get());
  EXPECT_TRUE(holds(into, 7));
  EXPECT_FALSE(writer.ready());
  store->release(std::move(home), dirty::no);
  writer.wait();
  store->release(std::move(writer), dirty::no);
  store->check_invariants();

  evict_all(*store, b);
  EXPECT_TRUE(reads(*store, b, tier_kind::device, 7));
  lease device = store->acquire(b, tier_kind::device);
  device.wait();
  std::fill(into.begin(), into.end(), std::byte{0});
  std::promise<std::exception_ptr> copied;
  store->copy_out(device, into, traffic_class::demand, [&](std::exception_ptr e) { copied.set_value(e); });
  EXPECT_FALSE(copied.get_future().get());
  EXPECT_TRUE(holds(into, 7));
  EXPECT_THROW(store->copy_out(device, into.first(size - 4096), traffic_class::demand, [](std::exception_ptr) {}),
               user_error);
  EXPECT_THROW(store->copy_out(device, std::span(memory.get() + 1, size), traffic_class::demand,
                               [](std::exception_ptr) {}),
               user_error);
  store->release(std::move(device), dirty::no);
  lease host = store->acquire(b, tier_kind::host);
  host.wait();
  EXPECT_THROW(store->copy_out(host, into, traffic_class::demand, [](std::exception_ptr) {}), user_error);
  store->release(std::move(host), dirty::no);
  store->check_invariants();
}

// The same paths on a real GPU: H2D and D2H copy engines, device<->NVMe staged
// through pinned bounce buffers. The bytes are only ever touched on the host.
TEST(store, bytes_survive_every_path_on_a_cuda_device) {
  if (!tiers::cuda_device_present()) GTEST_SKIP() << "no CUDA device here: the stand-in test covers these paths";
  scratch_dir dir;
  auto config = small_store_config(dir);
  config.device->backend = tiers::device_backend::cuda;
  auto store = tiers::make_store(std::move(config));
  ASSERT_EQ(store->tier_of(tier_kind::device).memory(), memory_kind::device);
  const block_id b = make(*store, "cuda.w", 300 * 1024 + 5, tier_kind::nvme);
  write(*store, b, tier_kind::host, 11);
  lease d = store->acquire(b, tier_kind::device);  // host -> device (H2D)
  d.wait();
  store->release(std::move(d), dirty::no);
  store->evict(b, tier_kind::host);
  store->flush();
  EXPECT_EQ(store->state(b, tier_kind::host), copy_state::absent);
  EXPECT_TRUE(reads(*store, b, tier_kind::host, 11));  // device -> host (D2H)
  evict_all(*store, b);
  d = store->acquire(b, tier_kind::device);  // nvme -> device (staged)
  d.wait();
  store->release(std::move(d), dirty::no);
  EXPECT_TRUE(reads(*store, b, tier_kind::host, 11));  // device -> host
  // device -> nvme (staged write-back): a dirty device copy, written home.
  store->evict(b, tier_kind::host);
  lease w = store->acquire(b, tier_kind::device, access::write);
  w.wait();
  store->release(std::move(w), dirty::yes);
  evict_all(*store, b);
  EXPECT_EQ(store->state(b, tier_kind::device), copy_state::absent);
  EXPECT_TRUE(reads(*store, b, tier_kind::host, 11));  // nvme -> host
  store->check_invariants();
}

TEST(store, over_budget_is_an_error_naming_tier_request_and_budget) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  const block_id big = make(*store, "embedding", 2u << 20, tier_kind::nvme);
  try {
    (void)store->acquire(big, tier_kind::host);
    FAIL() << "no error";
  } catch (const budget_exceeded& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("tier host"), std::string::npos) << what;
    EXPECT_NE(what.find("\"embedding\""), std::string::npos) << what;
    EXPECT_NE(what.find("2.00 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("budget 1.00 MiB"), std::string::npos) << what;
  }
  // The home tier is a budget too.
  EXPECT_THROW(make(*store, "huge", 128u << 20, tier_kind::nvme), budget_exceeded);
  EXPECT_THROW(make(*store, "host-huge", 2u << 20, tier_kind::host), budget_exceeded);
}

TEST(store, full_tier_evicts_least_recently_used_writing_dirty_copies_back) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  std::vector<block_id> blocks;
  for (int i = 0; i < 12; ++i)
    blocks.push_back(make(*store, "b" + std::to_string(i), 256u << 10, tier_kind::nvme));
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < 12; ++i) write(*store, blocks[i], tier_kind::host, 100 * round + i);
    store->check_invariants();
  }
  for (int i = 0; i < 12; ++i) EXPECT_TRUE(reads(*store, blocks[i], tier_kind::host, 100 + i)) << i;
  for (int i = 11; i >= 0; --i) EXPECT_TRUE(reads(*store, blocks[i], tier_kind::device, 100 + i)) << i;
  const store_telemetry t = store->telemetry();
  for (const tier_telemetry& x : t.tiers) EXPECT_LE(x.high_water, x.budget) << x.name;
  EXPECT_GT(t.writebacks, 0u);
  store->check_invariants();
}

TEST(store, leased_copies_are_never_evicted) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  std::vector<block_id> blocks;
  for (int i = 0; i < 5; ++i) {
    blocks.push_back(make(*store, "p" + std::to_string(i), 256u << 10, tier_kind::nvme));
    write(*store, blocks[i], tier_kind::host, i);
    evict_all(*store, blocks[i]);
  }
  std::vector<lease> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(store->acquire(blocks[i], tier_kind::host));
    held.back().wait();
  }
  lease fifth = store->acquire(blocks[4], tier_kind::host);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(fifth.ready()) << "a leased copy was evicted to make room";
  store->release(std::move(held[1]), dirty::no);
  EXPECT_TRUE(holds(fifth.wait(), 4));
  EXPECT_EQ(store->state(blocks[1], tier_kind::host), copy_state::absent);
  for (int i : {0, 2, 3}) EXPECT_TRUE(holds(held[i].data(), i));
  held.clear();  // a lease ending unreleased releases clean
  fifth = lease();
  store->check_invariants();
}

TEST(store, writers_are_exclusive_and_readers_wait_for_them) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  const block_id b = make(*store, "x", 64u << 10, tier_kind::host);
  write(*store, b, tier_kind::host, 1);
  lease w = store->acquire(b, tier_kind::host, access::write);
  fill(w.wait(), 2);
  lease r_host = store->acquire(b, tier_kind::host);
  lease r_device = store->acquire(b, tier_kind::device);
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(r_host.ready());
  EXPECT_FALSE(r_device.ready());
  store->release(std::move(w), dirty::yes);
  EXPECT_TRUE(holds(r_host.wait(), 2));
  EXPECT_TRUE(holds(r_device.wait(), 2));
}

TEST(store, an_overwrite_lease_skips_the_load) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  const block_id b = make(*store, "grad", 256u << 10, tier_kind::nvme);
  write(*store, b, tier_kind::host, 1);
  evict_all(*store, b);
  const std::uint64_t loads = store->telemetry().tiers[1].loads;
  lease l = store->acquire(b, tier_kind::host, access::overwrite);
  EXPECT_EQ(store->state(b, tier_kind::host), copy_state::loading);
  fill(l.wait(), 2);
  store->release(std::move(l), dirty::yes);
  EXPECT_EQ(store->telemetry().tiers[1].loads, loads);
  EXPECT_EQ(store->state(b, tier_kind::host), copy_state::dirty);
  evict_all(*store, b);
  EXPECT_TRUE(reads(*store, b, tier_kind::device, 2));
  // Released clean, a blank copy is discarded; the old bytes stay.
  lease blank = store->acquire(b, tier_kind::host, access::overwrite);
  blank.wait();
  store->release(std::move(blank), dirty::no);
  EXPECT_EQ(store->state(b, tier_kind::host), copy_state::absent);
  EXPECT_TRUE(reads(*store, b, tier_kind::host, 2));
  store->check_invariants();
}

TEST(store, prefetch_loads_ahead_and_is_dropped_when_there_is_no_room) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  std::vector<block_id> blocks;
  for (int i = 0; i < 5; ++i) {
    blocks.push_back(make(*store, "q" + std::to_string(i), 256u << 10, tier_kind::nvme));
    write(*store, blocks[i], tier_kind::host, i);
  }
  for (block_id b : blocks) evict_all(*store, b);
  store->prefetch(blocks[0], tier_kind::host);
  store->flush();  // waits for the load
  EXPECT_EQ(store->state(blocks[0], tier_kind::host), copy_state::valid);
  std::vector<lease> held;
  for (int i = 0; i < 4; ++i) held.push_back(store->acquire(blocks[i], tier_kind::host));
  for (lease& l : held) l.wait();
  store->prefetch(blocks[4], tier_kind::host);  // host full of leased copies
  EXPECT_EQ(store->state(blocks[4], tier_kind::host), copy_state::absent);
  const store_telemetry t = store->telemetry();
  EXPECT_EQ(t.prefetches, 2u);
  EXPECT_EQ(t.prefetches_dropped, 1u);
  held.clear();
}

TEST(store, a_failed_transfer_names_the_block_and_leaves_the_data_intact) {
  scratch_dir dir;
  auto faults = std::make_shared<io::fault_injector>();
  auto config = small_store_config(dir);
  config.nvme->io.faults = faults;
  auto store = tiers::make_store(std::move(config));
  const block_id b = make(*store, "layers.7.exp_avg", 128u << 10, tier_kind::nvme);
  write(*store, b, tier_kind::host, 7);
  evict_all(*store, b);
  faults->add(io::fault_rule{.match = {.kind = io::op_kind::read}, .nth = 1, .times = 1000,
                             .action = {.errnum = EIO}});
  lease l = store->acquire(b, tier_kind::host);
  try {
    l.wait();
    FAIL() << "no error";
  } catch (const tierflow::error& e) {
    EXPECT_EQ(e.context().block, "layers.7.exp_avg") << e.what();
    EXPECT_NE(std::string(e.what()).find("layers.7.exp_avg"), std::string::npos) << e.what();
  }
  l = lease();
  EXPECT_EQ(store->state(b, tier_kind::host), copy_state::absent);
  EXPECT_THROW(store->flush(), tierflow::error);  // reports the failure once
  faults->clear();
  EXPECT_TRUE(reads(*store, b, tier_kind::host, 7));
  store->check_invariants();
}

TEST(store, corrupt_bytes_on_nvme_are_caught_by_the_checksum) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  const block_id b = make(*store, "w.corrupt", 64u << 10, tier_kind::nvme);
  write(*store, b, tier_kind::host, 9);
  evict_all(*store, b);
  for (const auto& entry : std::filesystem::directory_iterator(dir.sub("nvme"))) {
    const int fd = ::open(entry.path().c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const char junk[16] = "not the bytes!!";
    ASSERT_EQ(::pwrite(fd, junk, sizeof junk, 100), ssize_t(sizeof junk));
    ::fsync(fd);
    ::close(fd);
  }
  // O_DIRECT reads bypass the page cache; drop it anyway for buffered files.
  lease l = store->acquire(b, tier_kind::host);
  EXPECT_THROW(l.wait(), tierflow::error);
}

TEST(store, telemetry_and_trace_are_json) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  const block_id b = make(*store, "t", 128u << 10, tier_kind::nvme);
  write(*store, b, tier_kind::host, 1);
  evict_all(*store, b);
  EXPECT_TRUE(reads(*store, b, tier_kind::device, 1));  // nvme -> device: waits
  const auto t = nlohmann::json::parse(store->telemetry_json());
  EXPECT_EQ(t["tiers"].size(), 3u);
  EXPECT_EQ(t["links"].size(), 6u);
  EXPECT_GE(t["stalls"].get<int>() + t["ready_at_wait"].get<int>(), 1);
  for (const auto& x : t["tiers"]) EXPECT_LE(x["high_water_bytes"], x["budget_bytes"]);
  std::uint64_t demand = 0;
  for (const auto& l : t["links"]) demand += l["classes"]["demand"]["transfers"].get<std::uint64_t>();
  EXPECT_GE(demand, 2u);

  std::ostringstream trace;
  store->write_trace(trace);
  const auto doc = nlohmann::json::parse(trace.str());
  bool transfer = false;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "X" && e["cat"] == "transfer") {
      transfer = true;
      EXPECT_TRUE(e.contains("ts") && e.contains("dur") && e["args"].contains("bytes"));
    }
  }
  EXPECT_TRUE(transfer);
}

TEST(store, bad_requests_are_user_errors) {
  scratch_dir dir;
  auto store = tiers::make_store(small_store_config(dir));
  EXPECT_THROW(store->create_block({.name = "", .size_bytes = 8}), user_error);
  EXPECT_THROW(store->create_block({.name = "z", .size_bytes = 0}), user_error);
  EXPECT_THROW(store->create_block({.name = "s", .size_bytes = 12, .type = dtype::fp32, .shape = {2, 2}}),
               user_error);
  const block_id ok = store->create_block({.name = "s", .type = dtype::bf16, .shape = {64, 32}});
  EXPECT_EQ(store->describe(ok).size_bytes, 64u * 32u * 2u);
  EXPECT_THROW(store->create_block({.name = "s", .size_bytes = 8}), user_error);
  EXPECT_THROW((void)store->acquire(block_id{99}, tier_kind::host), user_error);
  EXPECT_THROW((void)store->acquire(ok, tier_kind::nvme, access::write), user_error);
  EXPECT_EQ(store->find("s"), ok);
}

}  // namespace
}  // namespace tierflow::test
