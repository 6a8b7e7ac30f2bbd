// Who holds the leases: a store whose leases are all held by the thread that
// waits (lease_holder::waiting_thread) fails a wait only a release could end,
// at once, with EDEADLK naming what holds the tier; one that a transfer or an
// eviction will end is granted; an any_thread store waits for the release.
//
// The tier under test is a 16 KiB device stand-in (four pages) over a host
// home; gates on the movers hold transfers in flight for as long as a test
// needs, so "a write-back is in flight while the holder waits" is a fact, not
// a race.
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace tierflow::test {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t page = 4096;

// Holds the transfers that reach it while closed.
class gate {
 public:
  void close() {
    std::lock_guard lock(mutex_);
    closed_ = true;
  }
  void open() {
    {
      std::lock_guard lock(mutex_);
      closed_ = false;
    }
    cv_.notify_all();
  }
  void pass() {
    std::unique_lock lock(mutex_);
    ++held_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return !closed_; });
    --held_;
  }
  // Waits until `n` transfers are held.
  void await_held(int n) {
    std::unique_lock lock(mutex_);
    ASSERT_TRUE(cv_.wait_for(lock, 10s, [&] { return held_ >= n; })) << "no transfer reached the gate";
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool closed_ = false;
  int held_ = 0;
};

// The tiers' own mover, behind a gate.
class gated_mover final : public mover {
 public:
  gated_mover(std::unique_ptr<mover> inner, std::shared_ptr<gate> g)
      : inner_(std::move(inner)), gate_(std::move(g)) {}
  void move(const transfer& t) override {
    gate_->pass();
    inner_->move(t);
  }
  std::string engine() const override { return inner_->engine(); }

 private:
  std::unique_ptr<mover> inner_;
  std::shared_ptr<gate> gate_;
};

struct gated_store {
  std::shared_ptr<gate> loads = std::make_shared<gate>();       // host -> device
  std::shared_ptr<gate> writebacks = std::make_shared<gate>();  // device -> host
  std::unique_ptr<block_store> store;
};

// A 16 KiB device stand-in and a 1 MiB host tier, where every block is homed.
gated_store make_gated_store(lease_holder holder) {
  gated_store s;
  auto device = tiers::make_device_tier({.budget = 4 * page, .backend = tiers::device_backend::stand_in});
  auto host = tiers::make_host_tier({.budget = 1u << 20, .pin = tiers::pinning::none, .touch_threads = 1});
  std::vector<link_spec> links;
  links.push_back({.from = tier_kind::host, .to = tier_kind::device,
                   .engine = std::make_unique<gated_mover>(tiers::make_mover(*host, *device), s.loads)});
  links.push_back({.from = tier_kind::device, .to = tier_kind::host,
                   .engine = std::make_unique<gated_mover>(tiers::make_mover(*device, *host), s.writebacks)});
  std::vector<std::unique_ptr<tier>> tiers;
  tiers.push_back(std::move(device));
  tiers.push_back(std::move(host));
  s.store = std::make_unique<block_store>(std::move(tiers), std::move(links),
                                          store_options{.trace = false, .holder = holder});
  return s;
}

block_id make(block_store& s, const std::string& name, std::uint64_t bytes) {
  return s.create_block(block_desc{.name = name, .size_bytes = bytes, .home = tier_kind::host});
}

lease granted(block_store& s, block_id id, access mode = access::read) {
  lease l = s.acquire(id, tier_kind::device, mode);
  l.wait();
  return l;
}

// Leases a, b, c (a page each) on the device, at 0, 4 and 8 KiB, and releases
// b: its copy stays cached between the other two.
struct fragmented {
  block_id a, b, c, d;
  lease la, lc;
};

fragmented fragment(block_store& s) {
  fragmented f;
  f.a = make(s, "a", page);
  f.b = make(s, "b", page);
  f.c = make(s, "c", page);
  f.d = make(s, "d", 2 * page);
  f.la = granted(s, f.a);
  lease lb = granted(s, f.b);
  f.lc = granted(s, f.c);
  s.release(std::move(lb), dirty::no);
  return f;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(store, a_single_holder_waiting_for_room_only_its_leases_hold_fails_at_once) {
  auto s = make_gated_store(lease_holder::waiting_thread);
  fragmented f = fragment(*s.store);
  // 8 KiB are free after b's copy is dropped, in two pieces of 4 KiB: d fits neither.
  lease d = s.store->acquire(f.d, tier_kind::device);
  const auto start = std::chrono::steady_clock::now();
  try {
    d.wait();
    FAIL() << "the wait was granted";
  } catch (const tierflow::error& e) {
    EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
    EXPECT_EQ(e.errnum(), EDEADLK);
    EXPECT_EQ(e.context().tier, "device");
    EXPECT_EQ(e.context().block, "d");
    const std::string what = e.what();
    EXPECT_TRUE(contains(what, "block \"d\" (8.00 KiB)")) << what;
    EXPECT_TRUE(contains(what, "tier device")) << what;
    EXPECT_TRUE(contains(what, "budget 16.00 KiB, 8.00 KiB in use")) << what;
    EXPECT_TRUE(contains(what, "largest free piece 4.00 KiB")) << what;
    EXPECT_TRUE(contains(what, "held by the leases of \"a\" (4.00 KiB), \"c\" (4.00 KiB);")) << what;
    EXPECT_FALSE(contains(what, "\"b\"")) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  EXPECT_EQ(s.store->state(f.b, tier_kind::device), copy_state::absent);  // dropped trying
  s.store->check_invariants();
  // The failure is the request's, not the store's: once a lease ends, d fits.
  d = lease();
  s.store->release(std::move(f.lc), dirty::no);
  lease again = s.store->acquire(f.d, tier_kind::device);
  EXPECT_EQ(again.wait().size(), 2 * page);
  s.store->release(std::move(again), dirty::no);
  s.store->release(std::move(f.la), dirty::no);
  s.store->check_invariants();
}

TEST(store, a_single_holder_may_release_between_acquire_and_wait) {
  auto s = make_gated_store(lease_holder::waiting_thread);
  fragmented f = fragment(*s.store);
  lease d = s.store->acquire(f.d, tier_kind::device);  // parked: not waited on yet
  EXPECT_FALSE(d.ready());
  s.store->release(std::move(f.lc), dirty::no);  // frees 8..12 KiB: with 12..16, room for d
  EXPECT_EQ(d.wait().size(), 2 * page);
  s.store->release(std::move(d), dirty::no);
  s.store->release(std::move(f.la), dirty::no);
  s.store->check_invariants();
}

TEST(store, waiting_for_room_leases_hold_ends_with_another_threads_release) {
  auto s = make_gated_store(lease_holder::any_thread);
  fragmented f = fragment(*s.store);
  lease d = s.store->acquire(f.d, tier_kind::device);
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(d.ready());
  std::thread releaser([&] {
    std::this_thread::sleep_for(50ms);
    s.store->release(std::move(f.lc), dirty::no);
  });
  EXPECT_EQ(d.wait().size(), 2 * page);  // waits for the release rather than failing
  releaser.join();
  s.store->release(std::move(d), dirty::no);
  s.store->release(std::move(f.la), dirty::no);
  s.store->check_invariants();
}

// A single-holder store whose device tier (four pages) holds the leases of
// a and b (a page each); c (a page) and d (two) are made, not resident.
struct two_held {
  gated_store s;
  block_id a, b, c, d;
  lease la, lb;
};

two_held make_two_held() {
  gated_store s = make_gated_store(lease_holder::waiting_thread);
  const block_id a = make(*s.store, "a", page), b = make(*s.store, "b", page);
  const block_id c = make(*s.store, "c", page), d = make(*s.store, "d", 2 * page);
  lease la = granted(*s.store, a), lb = granted(*s.store, b);
  return {std::move(s), a, b, c, d, std::move(la), std::move(lb)};
}

TEST(store, a_single_holder_gets_room_an_evictable_copy_holds) {
  two_held t = make_two_held();
  gated_store& s = t.s;
  const block_id c = t.c, d = t.d;
  lease &la = t.la, &lb = t.lb;
  s.store->release(granted(*s.store, c), dirty::no);  // cached at 8 KiB, unleased
  lease ld = s.store->acquire(d, tier_kind::device);
  EXPECT_EQ(ld.wait().size(), 2 * page);
  EXPECT_EQ(s.store->state(c, tier_kind::device), copy_state::absent);
  for (lease* l : {&la, &lb, &ld}) s.store->release(std::move(*l), dirty::no);
  s.store->check_invariants();
}

TEST(store, a_single_holder_waits_for_room_a_writeback_in_flight_makes) {
  two_held t = make_two_held();
  gated_store& s = t.s;
  const block_id c = t.c, d = t.d;
  lease &la = t.la, &lb = t.lb;
  s.store->release(granted(*s.store, c, access::write), dirty::yes);  // dirty on the device
  s.writebacks->close();
  lease ld = s.store->acquire(d, tier_kind::device);  // writes c back to make room
  s.writebacks->await_held(1);
  EXPECT_EQ(s.store->state(c, tier_kind::device), copy_state::writing_back);
  std::thread opener([&] {
    std::this_thread::sleep_for(50ms);
    s.writebacks->open();
  });
  EXPECT_EQ(ld.wait().size(), 2 * page);  // waited while the write-back was in flight
  opener.join();
  EXPECT_EQ(s.store->state(c, tier_kind::device), copy_state::absent);
  EXPECT_EQ(s.store->state(c, tier_kind::host), copy_state::valid);
  for (lease* l : {&la, &lb, &ld}) s.store->release(std::move(*l), dirty::no);
  s.store->check_invariants();
}

TEST(store, a_single_holder_waits_for_room_a_prefetch_in_flight_will_leave) {
  two_held t = make_two_held();
  gated_store& s = t.s;
  const block_id c = t.c, d = t.d;
  lease &la = t.la, &lb = t.lb;
  s.loads->close();
  s.store->prefetch(c, tier_kind::device);  // loading at 8 KiB, held at the gate
  s.loads->await_held(1);
  lease ld = s.store->acquire(d, tier_kind::device);
  std::thread opener([&] {
    std::this_thread::sleep_for(50ms);
    s.loads->open();
  });
  // Once loaded, c is an unleased copy: dropped for d, which then loads.
  EXPECT_EQ(ld.wait().size(), 2 * page);
  opener.join();
  for (lease* l : {&la, &lb, &ld}) s.store->release(std::move(*l), dirty::no);
  s.store->check_invariants();
}

TEST(store, a_single_holder_fails_at_once_when_its_leases_leave_too_little_budget) {
  auto s = make_gated_store(lease_holder::waiting_thread);
  const block_id a = make(*s.store, "a", page), b = make(*s.store, "b", page);
  const block_id c = make(*s.store, "c", page), d = make(*s.store, "d", 3 * page);
  lease la = granted(*s.store, a), lb = granted(*s.store, b);
  s.loads->close();
  s.store->prefetch(c, tier_kind::device);  // in flight, but whatever it leaves, a and b stay
  s.loads->await_held(1);
  lease ld = s.store->acquire(d, tier_kind::device);
  try {
    ld.wait();
    FAIL() << "the wait was granted";
  } catch (const tierflow::error& e) {
    EXPECT_EQ(e.errnum(), EDEADLK);
    const std::string what = e.what();
    EXPECT_TRUE(contains(what, "block \"d\" (12.00 KiB)")) << what;
    EXPECT_TRUE(contains(what, "8.00 KiB held by the leases of \"a\" (4.00 KiB), \"b\" (4.00 KiB)"))
        << what;
    EXPECT_TRUE(contains(what, "the budget less those is too small")) << what;
  }
  s.loads->open();
  ld = lease();
  for (lease* l : {&la, &lb}) s.store->release(std::move(*l), dirty::no);
  s.store->flush();
  EXPECT_EQ(s.store->state(c, tier_kind::device), copy_state::valid);  // the hint was not failed
  s.store->check_invariants();
}

TEST(store, a_single_holder_overwrite_waiting_for_room_its_leases_hold_fails) {
  auto s = make_gated_store(lease_holder::waiting_thread);
  fragmented f = fragment(*s.store);
  // An overwrite needs storage, not bytes: the blank-copy path.
  lease d = s.store->acquire(f.d, tier_kind::device, access::overwrite);
  try {
    d.wait();
    FAIL() << "the wait was granted";
  } catch (const tierflow::error& e) {
    EXPECT_EQ(e.errnum(), EDEADLK);
    EXPECT_TRUE(contains(e.what(), "largest free piece 4.00 KiB")) << e.what();
  }
  d = lease();
  s.store->release(std::move(f.la), dirty::no);
  s.store->release(std::move(f.lc), dirty::no);
  s.store->check_invariants();
}

TEST(store, a_single_holder_is_failed_when_the_transfer_it_waited_for_leaves_only_leases) {
  two_held t = make_two_held();
  gated_store& s = t.s;
  const block_id c = t.c, d = t.d;
  lease &la = t.la, &lb = t.lb;
  s.loads->close();
  lease lc = s.store->acquire(c, tier_kind::device);  // loading at 8 KiB for a lease
  s.loads->await_held(1);
  lease ld = s.store->acquire(d, tier_kind::device);
  std::thread opener([&] {
    std::this_thread::sleep_for(50ms);
    s.loads->open();
  });
  // c's load completes into a granted lease: what is left is 4 KiB, and only
  // a release frees more. The wait, begun while the load was in flight, ends.
  EXPECT_THROW(
      {
        try {
          ld.wait();
        } catch (const tierflow::error& e) {
          EXPECT_EQ(e.errnum(), EDEADLK);
          EXPECT_TRUE(contains(e.what(), "\"c\" (4.00 KiB)")) << e.what();
          throw;
        }
      },
      tierflow::error);
  opener.join();
  EXPECT_TRUE(lc.ready());
  ld = lease();
  for (lease* l : {&la, &lb, &lc}) s.store->release(std::move(*l), dirty::no);
  s.store->check_invariants();
}

}  // namespace
}  // namespace tierflow::test
