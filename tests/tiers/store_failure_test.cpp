// Every failure path of the block store, through the fault seam on real
// files: write-backs failing once or for good (EIO, ENOSPC) on eviction, on
// flush, to make room and at close; loads and prefetches failing; short I/O;
// corrupt bytes on NVMe; tiers with no room. Each must end in a clear
// tierflow::error — never a hang, never a lost byte — and leave the store
// usable once the fault is gone.
//
// A store that loops would hang the test, so every call that could loop runs
// through returns_within(), which fails the test instead.
#include <fcntl.h>
#include <sys/resource.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "store_fixture.hpp"
#include "tierflow/io/fault.hpp"

namespace tierflow::test {
namespace {

using namespace std::chrono_literals;

constexpr auto patience = 10s;  // far beyond any bounded retry on a scratch file

// Runs `call` on its own thread and returns what it threw (null if nothing).
// A call still running after `limit` is a store stuck for good: nothing it
// uses can be destroyed safely any more, so the test binary reports `what`
// and exits failing, rather than hang.
std::exception_ptr returns_within(std::chrono::seconds limit, const std::string& what,
                                  std::function<void()> call) {
  auto done = std::make_shared<std::promise<std::exception_ptr>>();
  std::future<std::exception_ptr> result = done->get_future();
  std::thread runner([done, call = std::move(call)] {
    try {
      call();
      done->set_value(nullptr);
    } catch (...) {
      done->set_value(std::current_exception());
    }
  });
  if (result.wait_for(limit) != std::future_status::ready) {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    std::fprintf(stderr, "[  FAILED  ] %s.%s: %s did not return within %lld s\n",
                 test->test_suite_name(), test->name(), what.c_str(),
                 static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(1);
  }
  runner.join();
  return result.get();
}

// The errno and the block a tierflow::error carries; fails the test for anything else.
void expect_error(const std::exception_ptr& e, int errnum, const std::string& block) {
  ASSERT_TRUE(e) << "no error";
  try {
    std::rethrow_exception(e);
  } catch (const tierflow::error& x) {
    EXPECT_EQ(x.errnum(), errnum) << x.what();
    EXPECT_NE(std::string(x.what()).find("\"" + block + "\""), std::string::npos) << x.what();
  } catch (const std::exception& x) {
    ADD_FAILURE() << "not a tierflow::error: " << x.what();
  }
}

// A store whose NVMe engine consults `faults`; one io chunk per 64 KiB.
struct faulty_store {
  explicit faulty_store(small_store_sizes sizes = {}, store_options options = {}) {
    auto config = small_store_config(dir, sizes);
    config.nvme->io.faults = faults;
    config.store = options;
    store = tiers::make_store(std::move(config));
  }
  scratch_dir dir;
  std::shared_ptr<io::fault_injector> faults = std::make_shared<io::fault_injector>();
  std::unique_ptr<block_store> store;
};

io::fault_rule failing_writes(int errnum, std::uint64_t times = 1u << 30) {
  return io::fault_rule{.match = {.kind = io::op_kind::write},
                        .nth = 1,
                        .times = times,
                        .action = {.errnum = errnum}};
}

io::fault_rule failing_reads(int errnum, std::uint64_t times = 1u << 30) {
  return io::fault_rule{
      .match = {.kind = io::op_kind::read}, .nth = 1, .times = times, .action = {.errnum = errnum}};
}

// ---- write-back failing for good -------------------------------------------------

class persistent_writeback_failure : public ::testing::TestWithParam<int> {};

// An evicted dirty copy whose write-back always fails: flush() returns with
// the error, the copy stays dirty and readable where it is, and once the
// fault is gone the next flush brings it home.
TEST_P(persistent_writeback_failure, on_evict_flush_returns_the_error_and_keeps_the_copy) {
  const int errnum = GetParam();
  faulty_store f;
  block_store& s = *f.store;
  const block_id b = make(s, "layers.2.exp_avg", 64u << 10, tier_kind::nvme);
  write(s, b, tier_kind::host, 21);
  f.faults->add(failing_writes(errnum));
  s.evict(b, tier_kind::host);
  const std::exception_ptr flushed = returns_within(
      patience, "flush() (the failing write-back resubmitted for ever?)", [&] { s.flush(); });
  expect_error(flushed, errnum, "layers.2.exp_avg");
  EXPECT_EQ(s.state(b, tier_kind::host), copy_state::dirty);
  EXPECT_EQ(s.state(b, tier_kind::nvme), copy_state::absent);
  EXPECT_TRUE(reads(s, b, tier_kind::host, 21));
  EXPECT_TRUE(reads(s, b, tier_kind::device, 21));  // loaded from the dirty copy
  s.check_invariants();

  f.faults->clear();
  s.flush();
  EXPECT_EQ(s.state(b, tier_kind::nvme), copy_state::valid);
  s.evict(b, tier_kind::host);
  s.evict(b, tier_kind::device);
  s.flush();
  EXPECT_EQ(s.state(b, tier_kind::host), copy_state::absent);
  EXPECT_TRUE(reads(s, b, tier_kind::host, 21));  // from NVMe
  s.check_invariants();
}

// The destructor with such a write-back pending returns.
TEST_P(persistent_writeback_failure, the_destructor_returns) {
  faulty_store f;
  const block_id b = make(*f.store, "layers.3.w", 64u << 10, tier_kind::nvme);
  write(*f.store, b, tier_kind::host, 3);
  f.faults->add(failing_writes(GetParam()));
  f.store->evict(b, tier_kind::host);
  const std::exception_ptr destroyed =
      returns_within(patience, "the destructor", [&] { f.store.reset(); });
  EXPECT_FALSE(destroyed);
}

// Each request (here a flush) costs exactly writeback_attempts writes of the
// block, then stops: the attempts are bounded, and a second flush tries again.
TEST_P(persistent_writeback_failure, costs_exactly_the_attempts_per_request) {
  for (unsigned attempts : {1u, 3u, 5u}) {
    SCOPED_TRACE("writeback_attempts " + std::to_string(attempts));
    faulty_store f({}, store_options{.writeback_attempts = attempts});
    block_store& s = *f.store;
    const block_id b = make(s, "w", 64u << 10, tier_kind::nvme);  // one io request per write
    write(s, b, tier_kind::host, 5);
    f.faults->add(failing_writes(GetParam()));
    const std::exception_ptr first = returns_within(patience, "flush()", [&] { s.flush(); });
    expect_error(first, GetParam(), "w");
    EXPECT_EQ(f.faults->fired(), attempts);
    EXPECT_EQ(s.telemetry().failed_transfers, attempts);
    try {
      s.flush();
      ADD_FAILURE() << "the second flush did not report the failure";
    } catch (const tierflow::error& e) {
      EXPECT_EQ(e.errnum(), GetParam()) << e.what();
      const std::string what = e.what();
      EXPECT_NE(what.find("write-back to the nvme tier (" + std::to_string(attempts)),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("offset "), std::string::npos) << what;
      EXPECT_NE(what.find("tier nvme"), std::string::npos) << what;
      EXPECT_EQ(e.context().block, "w");
      EXPECT_FALSE(e.context().path.empty()) << what;
    }
    EXPECT_EQ(f.faults->fired(), 2 * attempts);
    EXPECT_TRUE(reads(s, b, tier_kind::host, 5));
    s.check_invariants();
  }
}

// A lease on the stale home copy waits for the write-back: it gets the error,
// and a later acquire tries again.
TEST_P(persistent_writeback_failure, a_lease_on_the_home_copy_gets_the_error) {
  faulty_store f;
  block_store& s = *f.store;
  const block_id b = make(s, "layers.4.w", 64u << 10, tier_kind::nvme);
  write(s, b, tier_kind::device, 4);
  f.faults->add(failing_writes(GetParam()));
  lease home = s.acquire(b, tier_kind::nvme);
  const std::exception_ptr waited =
      returns_within(patience, "wait() on the home copy", [&] { home.wait(); });
  expect_error(waited, GetParam(), "layers.4.w");
  home = lease();
  EXPECT_EQ(s.state(b, tier_kind::device), copy_state::dirty);
  EXPECT_TRUE(reads(s, b, tier_kind::device, 4));
  EXPECT_THROW(s.flush(), tierflow::error);
  f.faults->clear();
  lease again = s.acquire(b, tier_kind::nvme);
  again.wait();
  again = lease();
  EXPECT_EQ(s.state(b, tier_kind::nvme), copy_state::valid);
  s.evict(b, tier_kind::device);
  s.flush();
  EXPECT_TRUE(reads(s, b, tier_kind::host, 4));  // NVMe -> host: the bytes made it home
  s.check_invariants();
}

// A tier full of dirty copies that cannot be written back: a lease that needs
// room gets the error instead of waiting for ever; the copies stay, the
// budget stays right, and once the disk works a new acquire makes the room.
TEST_P(persistent_writeback_failure, a_lease_that_needs_room_gets_the_error) {
  faulty_store f;
  block_store& s = *f.store;
  std::vector<block_id> full;
  for (int i = 0; i < 4; ++i) {  // 4 x 256 KiB: the host tier's whole budget
    full.push_back(make(s, "full" + std::to_string(i), 256u << 10, tier_kind::nvme));
    write(s, full.back(), tier_kind::host, 40 + i);
  }
  const block_id extra = make(s, "extra", 256u << 10, tier_kind::nvme);
  f.faults->add(failing_writes(GetParam()));
  lease l = s.acquire(extra, tier_kind::host);
  const std::exception_ptr waited =
      returns_within(patience, "wait() for room the failing write-backs hold", [&] { l.wait(); });
  expect_error(waited, GetParam(), "extra");
  l = lease();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(s.state(full[i], tier_kind::host), copy_state::dirty) << i;
    EXPECT_TRUE(reads(s, full[i], tier_kind::host, 40 + i)) << i;
  }
  EXPECT_EQ(s.tier_of(tier_kind::host).used(), 4u * (256u << 10));
  s.check_invariants();
  EXPECT_THROW(s.flush(), tierflow::error);

  f.faults->clear();
  lease later = s.acquire(extra, tier_kind::host, access::overwrite);
  const std::exception_ptr granted = returns_within(patience, "wait() for the room, the disk back",
                                                    [&] { fill(later.wait(), 50); });
  EXPECT_FALSE(granted);
  s.release(std::move(later), dirty::yes);
  s.flush();
  s.check_invariants();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(reads(s, full[i], tier_kind::device, 40 + i)) << i;
  EXPECT_TRUE(reads(s, extra, tier_kind::device, 50));
}

// Creating a block whose home is full of such copies is the same error, not a wait.
TEST_P(persistent_writeback_failure, create_block_in_a_tier_held_by_them_is_an_error) {
  faulty_store f;
  block_store& s = *f.store;
  for (int i = 0; i < 4; ++i)
    write(s, make(s, "cached" + std::to_string(i), 256u << 10, tier_kind::nvme), tier_kind::host,
          i);
  f.faults->add(failing_writes(GetParam()));
  std::optional<block_id> made;
  const std::exception_ptr created = returns_within(patience, "create_block()", [&] {
    made = make(s, "host.bias", 256u << 10, tier_kind::host);
  });
  expect_error(created, GetParam(), "host.bias");
  EXPECT_FALSE(made);
  EXPECT_FALSE(s.find("host.bias"));
  for (int i = 0; i < 4; ++i)
    EXPECT_TRUE(reads(s, block_id{std::uint32_t(i)}, tier_kind::host, i)) << i;
  s.check_invariants();
  EXPECT_THROW(s.flush(), tierflow::error);
  f.faults->clear();
  const block_id bias = make(s, "host.bias", 256u << 10, tier_kind::host);
  write(s, bias, tier_kind::host, 9);
  s.flush();
  EXPECT_TRUE(reads(s, bias, tier_kind::host, 9));
  s.check_invariants();
}

// close() returns the error and leaves the store open with the copy in
// place; once the disk works, close() succeeds.
TEST_P(persistent_writeback_failure, close_returns_the_error_and_stays_open) {
  faulty_store f;
  block_store& s = *f.store;
  const block_id b = make(s, "opt.state", 64u << 10, tier_kind::nvme);
  write(s, b, tier_kind::host, 8);
  f.faults->add(failing_writes(GetParam()));
  const std::exception_ptr closed = returns_within(patience, "close()", [&] { s.close(); });
  expect_error(closed, GetParam(), "opt.state");
  EXPECT_TRUE(reads(s, b, tier_kind::host, 8));  // still open, nothing lost
  f.faults->clear();
  s.close();
  EXPECT_EQ(s.state(b, tier_kind::nvme), copy_state::valid);
  EXPECT_THROW((void)s.acquire(b, tier_kind::host), user_error);
  s.close();  // again: nothing to do
}

INSTANTIATE_TEST_SUITE_P(store_failure, persistent_writeback_failure,
                         ::testing::Values(EIO, ENOSPC),
                         [](const auto& p) { return p.param == EIO ? "EIO" : "ENOSPC"; });

// ---- write-back failing once ------------------------------------------------------

// Fewer failures than attempts: the write-back succeeds, nobody sees an
// error, the bytes are home. On the host->NVMe and the staged device->NVMe path.
TEST(store_failure, a_transient_writeback_failure_is_retried_and_not_reported) {
  for (const int errnum : {EIO, ENOSPC}) {
    for (const tier_kind from : {tier_kind::host, tier_kind::device}) {
      SCOPED_TRACE(std::string(std::strerror(errnum)) + " from " + std::string(name(from)));
      faulty_store f;
      block_store& s = *f.store;
      const block_id b = make(s, "t", 64u << 10, tier_kind::nvme);
      write(s, b, from, 6);
      f.faults->add(failing_writes(errnum, 2));  // attempts 1 and 2 fail, 3 succeeds
      s.evict(b, from);
      const std::exception_ptr flushed = returns_within(patience, "flush()", [&] { s.flush(); });
      EXPECT_FALSE(flushed);
      EXPECT_EQ(f.faults->fired(), 2u);
      EXPECT_EQ(s.telemetry().failed_transfers, 2u);
      EXPECT_EQ(s.state(b, from), copy_state::absent);  // the eviction went through
      EXPECT_EQ(s.state(b, tier_kind::nvme), copy_state::valid);
      EXPECT_TRUE(reads(s, b, tier_kind::host, 6));
      s.check_invariants();
    }
  }
}

TEST(store_failure, writeback_attempts_zero_is_a_user_error) {
  scratch_dir dir;
  auto config = small_store_config(dir);
  config.store.writeback_attempts = 0;
  try {
    (void)tiers::make_store(std::move(config));
    FAIL() << "no error";
  } catch (const user_error& e) {
    EXPECT_NE(std::string(e.what()).find("writeback_attempts"), std::string::npos) << e.what();
  }
}

// ---- loads ------------------------------------------------------------------------

// A failing read on every load path: the lease gets the error naming the
// block, the copy stays absent (its storage given back), and a later acquire
// loads it once the disk reads again.
TEST(store_failure, a_failed_load_fails_its_waiters_and_a_later_acquire_retries) {
  for (const tier_kind to : {tier_kind::host, tier_kind::device}) {
    SCOPED_TRACE("into " + std::string(name(to)));
    faulty_store f;
    block_store& s = *f.store;
    const block_id b = make(s, "l.w", 192u << 10, tier_kind::nvme);
    write(s, b, tier_kind::host, 2);
    s.evict(b, tier_kind::host);
    s.flush();
    f.faults->add(failing_reads(EIO));
    lease first = s.acquire(b, to);
    lease second = s.acquire(b, to);
    for (lease* l : {&first, &second}) {
      const std::exception_ptr waited =
          returns_within(patience, "wait() on a failed load", [&] { l->wait(); });
      expect_error(waited, EIO, "l.w");
    }
    first = lease();
    second = lease();
    EXPECT_EQ(s.state(b, to), copy_state::absent);
    EXPECT_EQ(s.tier_of(to).used(), 0u);
    EXPECT_THROW(s.flush(), tierflow::error);
    f.faults->clear();
    EXPECT_TRUE(reads(s, b, to, 2));
    s.check_invariants();
  }
}

// A prefetch that fails: nothing waits for it, so flush() reports it; the
// copy stays absent and a later acquire loads it.
TEST(store_failure, a_failed_prefetch_is_reported_by_flush) {
  faulty_store f;
  block_store& s = *f.store;
  const block_id b = make(s, "p.w", 64u << 10, tier_kind::nvme);
  write(s, b, tier_kind::host, 3);
  s.evict(b, tier_kind::host);
  s.flush();
  f.faults->add(failing_reads(EIO));
  s.prefetch(b, tier_kind::host);
  const std::exception_ptr flushed = returns_within(patience, "flush()", [&] { s.flush(); });
  expect_error(flushed, EIO, "p.w");
  EXPECT_EQ(s.state(b, tier_kind::host), copy_state::absent);
  f.faults->clear();
  EXPECT_TRUE(reads(s, b, tier_kind::host, 3));
  s.check_invariants();
}

// ---- short I/O and corrupt files --------------------------------------------------

// Requests completing short are finished, not failed and not truncated: on
// the write-back and the load, host<->NVMe and staged device<->NVMe.
TEST(store_failure, short_reads_and_writes_still_move_every_byte) {
  for (const tier_kind t : {tier_kind::host, tier_kind::device}) {
    SCOPED_TRACE(std::string(name(t)));
    faulty_store f;
    block_store& s = *f.store;
    const block_id b = make(s, "s.w", 300u << 10, tier_kind::nvme);
    write(s, b, t, 12);
    f.faults->add({.match = {.kind = io::op_kind::write},
                   .nth = 1,
                   .times = 40,
                   .action = {.short_by = 5000}});
    f.faults->add({.match = {.kind = io::op_kind::read},
                   .nth = 1,
                   .times = 40,
                   .action = {.short_by = 4097}});
    s.evict(b, t);
    s.flush();
    EXPECT_EQ(s.state(b, tier_kind::nvme), copy_state::valid);
    EXPECT_TRUE(reads(s, b, t, 12));
    EXPECT_GT(f.faults->fired(), 0u);
    EXPECT_EQ(s.telemetry().failed_transfers, 0u);
    s.check_invariants();
  }
}

// Bytes changed on disk behind the store: every read of that block fails with
// EBADMSG naming it (never the wrong bytes), on both load paths, again on every
// try; other blocks are unharmed, and writing the block anew heals it.
TEST(store_failure, a_corrupt_block_fails_every_read_until_rewritten) {
  faulty_store f;
  block_store& s = *f.store;
  const block_id bad = make(s, "w.corrupt", 64u << 10, tier_kind::nvme);
  const block_id good = make(s, "w.good", 64u << 10, tier_kind::nvme);
  write(s, bad, tier_kind::host, 9);
  write(s, good, tier_kind::host, 10);
  for (block_id b : {bad, good}) s.evict(b, tier_kind::host);
  s.flush();
  // The bad block's extent was allocated first: it starts at offset 0 of the first file.
  bool corrupted = false;
  for (const auto& entry : std::filesystem::directory_iterator(f.dir.sub("nvme"))) {
    const int fd = ::open(entry.path().c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const char junk[16] = "not the bytes!!";
    corrupted = ::pwrite(fd, junk, sizeof junk, 100) == ssize_t(sizeof junk) || corrupted;
    ::fsync(fd);
    ::close(fd);
  }
  ASSERT_TRUE(corrupted);
  for (int round = 0; round < 2; ++round) {
    for (const tier_kind to : {tier_kind::host, tier_kind::device}) {
      lease l = s.acquire(bad, to);
      const std::exception_ptr waited =
          returns_within(patience, "wait() on a corrupt block", [&] { l.wait(); });
      expect_error(waited, EBADMSG, "w.corrupt");
      l = lease();
      EXPECT_EQ(s.state(bad, to), copy_state::absent);
    }
  }
  EXPECT_THROW(s.flush(), tierflow::error);
  EXPECT_TRUE(reads(s, good, tier_kind::host, 10));
  EXPECT_TRUE(reads(s, good, tier_kind::device, 10));
  lease rewrite = s.acquire(bad, tier_kind::host, access::overwrite);
  fill(rewrite.wait(), 11);
  s.release(std::move(rewrite), dirty::yes);
  s.evict(bad, tier_kind::host);
  s.flush();
  EXPECT_TRUE(reads(s, bad, tier_kind::device, 11));
  s.check_invariants();
}

// ---- a disk that cannot grow -----------------------------------------------------

// Lowers this process's file-size limit (RLIMIT_FSIZE) for its life, so that
// preallocating one more NVMe file fails as on a full disk (EFBIG; SIGXFSZ
// ignored), and restores it after.
class file_size_limit {
 public:
  explicit file_size_limit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit lowered = saved_;
    lowered.rlim_cur = bytes;
    ok_ = ::setrlimit(RLIMIT_FSIZE, &lowered) == 0;
  }
  ~file_size_limit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, old_handler_);
  }
  file_size_limit(const file_size_limit&) = delete;
  file_size_limit& operator=(const file_size_limit&) = delete;
  bool ok() const { return ok_; }

 private:
  rlimit saved_{};
  void (*old_handler_)(int) = SIG_DFL;
  bool ok_ = false;
};

// The NVMe tier cannot preallocate another file: creating a block there, and
// loading a copy into it, are errors naming the block and the tier; what is
// stored is untouched, and once the disk can grow both succeed.
TEST(store_failure, an_nvme_tier_that_cannot_grow_fails_the_request_not_the_store) {
  scratch_dir dir;
  auto config = small_store_config(dir);
  config.nvme->file_size = 1u << 20;  // a second file is needed past 1 MiB
  auto store = tiers::make_store(std::move(config));
  block_store& s = *store;
  const block_id a = make(s, "a", 512u << 10, tier_kind::nvme);
  const block_id b = make(s, "b", 512u << 10, tier_kind::nvme);  // file 0 is full
  const block_id h = make(s, "h", 64u << 10, tier_kind::host);
  write(s, a, tier_kind::host, 1);
  write(s, b, tier_kind::host, 2);
  write(s, h, tier_kind::host, 3);
  s.evict(a, tier_kind::host);
  s.evict(b, tier_kind::host);
  s.flush();
  {
    file_size_limit limit(256u << 10);
    if (!limit.ok()) GTEST_SKIP() << "setrlimit(RLIMIT_FSIZE) refused here";
    try {
      make(s, "c", 512u << 10, tier_kind::nvme);
      ADD_FAILURE() << "no error";
    } catch (const user_error& e) {
      ADD_FAILURE() << "a user error for a disk that cannot grow: " << e.what();
    } catch (const tierflow::error& e) {
      EXPECT_EQ(e.context().block, "c") << e.what();
      EXPECT_EQ(e.context().tier, "nvme") << e.what();
      EXPECT_EQ(e.errnum(), EFBIG) << e.what();
    }
    EXPECT_FALSE(s.find("c"));
    lease into_nvme = s.acquire(h, tier_kind::nvme);  // a load host -> nvme needs an extent
    const std::exception_ptr waited =
        returns_within(patience, "wait() for a copy the tier has no room for",
                       [&] { into_nvme.wait(); });
    expect_error(waited, EFBIG, "h");
    into_nvme = lease();
    EXPECT_EQ(s.state(h, tier_kind::nvme), copy_state::absent);
    s.check_invariants();
  }
  const block_id c = make(s, "c", 512u << 10, tier_kind::nvme);
  write(s, c, tier_kind::host, 4);
  s.evict(c, tier_kind::host);
  s.flush();
  EXPECT_TRUE(reads(s, a, tier_kind::host, 1));
  EXPECT_TRUE(reads(s, b, tier_kind::device, 2));
  EXPECT_TRUE(reads(s, c, tier_kind::host, 4));
  lease copy = s.acquire(h, tier_kind::nvme);
  copy.wait();
  copy = lease();
  EXPECT_EQ(s.state(h, tier_kind::nvme), copy_state::valid);
  s.check_invariants();
}

// ---- many threads on a failing disk ----------------------------------------------

std::uint64_t seed_of(std::size_t block, std::uint64_t version) {
  return (std::uint64_t(block) << 32) ^ (version * 0x9e3779b97f4a7c15ull);
}

// Threads reading, writing, evicting and prefetching at random while every
// write to NVMe fails: each call returns (with the bytes or with an error),
// no lease ever sees old bytes, and once the disk works every block's newest
// bytes are all there. The version counters are plain integers guarded by
// the write leases, as in the stress test: TSan reports a write lease that
// failed to exclude the others.
TEST(store_failure, many_threads_on_a_failing_disk_never_hang_and_lose_nothing) {
  faulty_store f;
  block_store& s = *f.store;
  constexpr int blocks = 12;
  std::vector<block_id> ids;
  std::vector<std::uint64_t> version(blocks, 0);
  for (int i = 0; i < blocks; ++i) {
    const tier_kind home = i % 4 == 0 ? tier_kind::host : tier_kind::nvme;
    ids.push_back(make(s, std::string("m").append(std::to_string(i)), (64u << 10) * (1 + i % 3), home));
    write(s, ids.back(), tier_kind::host, seed_of(i, 0));
  }
  s.flush();
  f.faults->add(failing_writes(EIO));

  std::atomic<int> wrong{0}, errors{0};
  auto worker = [&](int thread) {
    std::mt19937_64 rng(77 + thread);
    const tier_kind memory[] = {tier_kind::device, tier_kind::host};
    const tier_kind any[] = {tier_kind::device, tier_kind::host, tier_kind::nvme};
    for (int op = 0; op < 150; ++op) {
      const std::size_t b = rng() % ids.size();
      const unsigned dice = unsigned(rng() % 100);
      try {
        if (dice < 40) {
          lease l = s.acquire(ids[b], any[rng() % 3]);
          const auto bytes = l.wait();
          if (l.tier() != tier_kind::nvme && !holds(bytes, seed_of(b, version[b]))) ++wrong;
        } else if (dice < 65) {
          lease l = s.acquire(ids[b], memory[rng() % 2], access::write);
          const auto bytes = l.wait();
          if (!holds(bytes, seed_of(b, version[b]))) ++wrong;
          ++version[b];
          fill(bytes, seed_of(b, version[b]));
          s.release(std::move(l), dirty::yes);
        } else if (dice < 80) {
          s.prefetch(ids[b], any[rng() % 3]);
        } else {
          s.evict(ids[b], any[rng() % 3]);
        }
      } catch (const tierflow::error&) {
        ++errors;  // a load or a room the failing disk could not give
      }
    }
  };
  const std::exception_ptr ran = returns_within(60s, "the threads on the failing disk", [&] {
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t);
    for (auto& t : threads) t.join();
  });
  EXPECT_FALSE(ran);
  EXPECT_EQ(wrong.load(), 0);
  s.check_invariants();
  const std::exception_ptr failing_flush = returns_within(patience, "flush()", [&] { s.flush(); });
  EXPECT_TRUE(failing_flush) << "every write fails, yet flush() reported nothing";

  f.faults->clear();
  s.flush();
  s.check_invariants();
  for (int i = 0; i < blocks; ++i) {
    for (const tier_kind t : {tier_kind::host, tier_kind::device}) s.evict(ids[i], t);
  }
  s.flush();
  for (int i = 0; i < blocks; ++i)
    EXPECT_TRUE(reads(s, ids[i], tier_kind::host, seed_of(i, version[i]))) << "block " << i;
}

// ---- close ------------------------------------------------------------------------

// close() with a lease held or waited for is a user error naming the block,
// and changes nothing; the store closes once the leases end.
TEST(store_failure, close_with_a_lease_outstanding_is_refused_and_changes_nothing) {
  faulty_store f;
  block_store& s = *f.store;
  const block_id b = make(s, "held", 64u << 10, tier_kind::nvme);
  write(s, b, tier_kind::host, 1);
  lease held = s.acquire(b, tier_kind::host, access::write);
  held.wait();
  try {
    s.close();
    FAIL() << "no error";
  } catch (const user_error& e) {
    EXPECT_NE(std::string(e.what()).find("\"held\""), std::string::npos) << e.what();
  }
  EXPECT_EQ(s.state(b, tier_kind::host), copy_state::dirty);  // not written back meanwhile
  // A read lease on another block: close() refuses before writing anything back.
  const block_id other = make(s, "other", 64u << 10, tier_kind::nvme);
  write(s, other, tier_kind::host, 3);
  s.release(std::move(held), dirty::no);
  lease reader = s.acquire(b, tier_kind::host);
  reader.wait();
  EXPECT_THROW(s.close(), user_error);
  EXPECT_EQ(s.state(other, tier_kind::host), copy_state::dirty);
  EXPECT_EQ(s.state(other, tier_kind::nvme), copy_state::absent);
  s.release(std::move(reader), dirty::no);
  held = s.acquire(b, tier_kind::host, access::write);
  held.wait();
  lease waiting = s.acquire(b, tier_kind::device);            // waits for the writer
  fill(held.data(), 2);
  EXPECT_THROW(s.close(), user_error);
  s.release(std::move(held), dirty::yes);
  EXPECT_TRUE(holds(waiting.wait(), 2));
  EXPECT_THROW(s.close(), user_error);
  s.release(std::move(waiting), dirty::no);
  s.close();
  EXPECT_EQ(s.state(b, tier_kind::nvme), copy_state::valid);
  EXPECT_THROW((void)s.acquire(b, tier_kind::host), user_error);
  EXPECT_THROW(make(s, "late", 4096, tier_kind::host), user_error);
  s.prefetch(b, tier_kind::host);  // a hint: dropped
  EXPECT_EQ(s.state(b, tier_kind::host), copy_state::valid);
  EXPECT_EQ(s.telemetry().prefetches_dropped, 1u);
}

}  // namespace
}  // namespace tierflow::test
