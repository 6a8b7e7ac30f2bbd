// The Gloo communicator between real processes: each test forks 2 or 3
// ranks that meet in a fresh rendezvous directory over 127.0.0.1 and checks
// every collective and dtype exactly (small integers, which fp32, bf16 and
// fp16 all hold exactly), uneven and empty shards, bad arguments, and a rank
// that dies: the others fail within the timeout, never hang.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <string>
#include <vector>

#include "dtype_values.hpp"
#include "tierflow/collectives/gloo.hpp"
#include "tierflow/core/error.hpp"

namespace tf = tierflow;
namespace tc = tierflow::collectives;
using namespace std::chrono_literals;

namespace {

using tierflow::collectives::testing::decode16;
using tierflow::collectives::testing::encode;
using tierflow::collectives::testing::encode16;

// ---- values in each dtype ---------------------------------------------------------------------



// A buffer of `n` elements of `t`, read and written as floats.
struct buffer {
  tf::dtype t;
  std::vector<std::byte> bytes;
  buffer(tf::dtype type, std::size_t n) : t(type), bytes(n * tf::size_of(type)) {}
  std::size_t size() const { return bytes.size() / tf::size_of(t); }
  void* data() { return bytes.data(); }
  void set(std::size_t i, float v) {
    if (t == tf::dtype::fp32) {
      reinterpret_cast<float*>(bytes.data())[i] = v;
    } else {
      reinterpret_cast<std::uint16_t*>(bytes.data())[i] = encode16(t, v);
    }
  }
  float get(std::size_t i) const {
    if (t == tf::dtype::fp32) return reinterpret_cast<const float*>(bytes.data())[i];
    return decode16(t, reinterpret_cast<const std::uint16_t*>(bytes.data())[i]);
  }
};

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// ---- ranks in processes -------------------------------------------------------------------------

struct outcome {
  int status = -1;     // the exit status, or -1 when it did not exit (killed past the limit)
  std::string output;  // what it reported
};

// Forks `ranks` processes; each joins a Gloo communicator (timeout
// `timeout`) and runs `body(comm)`. A rank that throws reports the message
// and exits 1; every rank is killed once `limit` has passed.
std::vector<outcome> run_ranks(int ranks, const std::function<void(tc::communicator&)>& body,
                               std::chrono::milliseconds timeout = 20s, std::chrono::seconds limit = 60s) {
  char pattern[] = "/tmp/tierflow-gloo-XXXXXX";
  const char* made = ::mkdtemp(pattern);
  if (made == nullptr) throw std::runtime_error("mkdtemp");
  const std::string dir = made;
  std::vector<pid_t> pids;
  std::vector<int> pipes;
  for (int r = 0; r < ranks; ++r) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe");
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      std::string report;
      int status = 0;
      try {
        auto comm = tc::make_gloo_communicator(r, ranks, {.store_dir = dir, .timeout = timeout});
        body(*comm);
        comm.reset();
      } catch (const std::exception& e) {
        report = e.what();
        status = 1;
      }
      if (!report.empty() && ::write(fds[1], report.data(), report.size()) < 0) status = 2;
      ::_exit(status);  // (no atexit handlers, no gtest teardown in a child)
    }
    ::close(fds[1]);
    pids.push_back(pid);
    pipes.push_back(fds[0]);
  }
  std::vector<outcome> out(static_cast<std::size_t>(ranks));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (int r = 0; r < ranks; ++r) {
    int status = 0;
    while (::waitpid(pids[r], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pids[r], SIGKILL);
        ::waitpid(pids[r], &status, 0);
        status = -1;
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    out[r].status = status == -1 ? -1 : (WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
    char chunk[512];
    for (ssize_t n; (n = ::read(pipes[r], chunk, sizeof chunk)) > 0;) out[r].output.append(chunk, n);
    ::close(pipes[r]);
  }
  std::filesystem::remove_all(dir);
  return out;
}

void expect_all_passed(const std::vector<outcome>& outcomes) {
  for (std::size_t r = 0; r < outcomes.size(); ++r)
    EXPECT_EQ(outcomes[r].status, 0) << "rank " << r << ": " << outcomes[r].output;
}

const tf::dtype every_dtype[] = {tf::dtype::fp32, tf::dtype::bf16, tf::dtype::fp16};

// Each rank's value at element i of a collective's input.
float value(int rank, std::size_t i) { return static_cast<float>((rank + 1) * 10 + static_cast<int>(i % 7)); }

}  // namespace

class GlooRanks : public ::testing::TestWithParam<int> {};

TEST_P(GlooRanks, AllGatherOfUnevenAndEmptyShardsIsExactInEveryDtype) {
  const int n = GetParam();
  expect_all_passed(run_ranks(n, [n](tc::communicator& comm) {
    std::vector<std::size_t> counts(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) counts[r] = r == 1 ? 0 : static_cast<std::size_t>(3 + 2 * r);  // rank 1: empty
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    for (tf::dtype t : every_dtype) {
      buffer in(t, counts[comm.rank()]), out(t, total);
      for (std::size_t i = 0; i < in.size(); ++i) in.set(i, value(comm.rank(), i));
      comm.all_gather(in.data(), out.data(), counts, t)->wait();
      std::size_t at = 0;
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < counts[r]; ++i, ++at)
          require(out.get(at) == value(r, i), std::string(tf::name(t)) + ": element " + std::to_string(at));
    }
  }));
}

TEST_P(GlooRanks, ReduceScatterAndAllReduceAreExactForEveryOpAndDtype) {
  const int n = GetParam();
  expect_all_passed(run_ranks(n, [n](tc::communicator& comm) {
    std::vector<std::size_t> counts(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) counts[r] = r == n - 1 ? 0 : static_cast<std::size_t>(5 + r);  // the last: empty
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    const std::size_t offset = std::accumulate(counts.begin(), counts.begin() + comm.rank(), std::size_t{0});
    for (tf::dtype t : every_dtype) {
      for (tc::reduce_op op : {tc::reduce_op::sum, tc::reduce_op::max, tc::reduce_op::min}) {
        auto expected = [&](std::size_t i) {
          float acc = value(0, i);
          for (int r = 1; r < n; ++r) {
            const float v = value(r, i);
            acc = op == tc::reduce_op::sum ? acc + v : op == tc::reduce_op::max ? std::max(acc, v) : std::min(acc, v);
          }
          return acc;
        };
        const std::string what = std::string(tf::name(t)) + " " + std::string(tc::name(op));
        buffer in(t, total), mine(t, counts[comm.rank()]);
        for (std::size_t i = 0; i < total; ++i) in.set(i, value(comm.rank(), i));
        comm.reduce_scatter(in.data(), mine.data(), counts, t, op)->wait();
        for (std::size_t i = 0; i < mine.size(); ++i)
          require(mine.get(i) == expected(offset + i), "reduce_scatter " + what + ": element " + std::to_string(i));
        comm.all_reduce(in.data(), total, t, op)->wait();
        for (std::size_t i = 0; i < total; ++i)
          require(in.get(i) == expected(i), "all_reduce " + what + ": element " + std::to_string(i));
      }
    }
  }));
}

TEST_P(GlooRanks, BroadcastGivesEveryRankTheRootsBuffer) {
  const int n = GetParam();
  expect_all_passed(run_ranks(n, [n](tc::communicator& comm) {
    for (tf::dtype t : every_dtype) {
      buffer b(t, 1000);
      for (std::size_t i = 0; i < b.size(); ++i) b.set(i, value(comm.rank(), i));
      comm.broadcast(b.data(), b.size(), t, n - 1)->wait();
      for (std::size_t i = 0; i < b.size(); ++i)
        require(b.get(i) == value(n - 1, i), std::string(tf::name(t)) + ": element " + std::to_string(i));
    }
  }));
}

TEST_P(GlooRanks, AllGatherStridedPutsEachRanksChunkInItsPlaceAndLeavesTheRestAlone) {
  const int n = GetParam();
  expect_all_passed(run_ranks(n, [n](tc::communicator& comm) {
    constexpr std::size_t shard = 10, chunk = 4;  // chunks of 4, 4 and 2 of every rank's shard of 10
    constexpr float untouched = -1.0f;
    for (tf::dtype t : every_dtype) {
      const std::string what(tf::name(t));
      buffer full(t, n * shard);
      for (std::size_t i = 0; i < full.size(); ++i) full.set(i, untouched);
      const std::size_t mine = comm.rank() * shard;
      for (std::size_t i = 0; i < shard; ++i) full.set(mine + i, value(comm.rank(), i));
      auto* base = static_cast<std::byte*>(full.data());
      const std::size_t element = tf::size_of(t);
      // The middle chunk first, in place: every rank's lands, the others' places stay as they were.
      comm.all_gather_strided(nullptr, base + (mine + chunk) * element, base + chunk * element, chunk, shard, t)
          ->wait();
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < shard; ++i) {
          const bool gathered = r == comm.rank() || (i >= chunk && i < 2 * chunk);
          require(full.get(r * shard + i) == (gathered ? value(r, i) : untouched),
                  what + ": after the middle chunk, rank " + std::to_string(r) + "'s element " + std::to_string(i));
        }
      // The first from a buffer of its own (not in place), the last (shorter) in place, issued together.
      buffer first(t, chunk);
      for (std::size_t i = 0; i < chunk; ++i) first.set(i, value(comm.rank(), i));
      auto a = comm.all_gather_strided(nullptr, first.data(), base, chunk, shard, t);
      auto b = comm.all_gather_strided(nullptr, base + (mine + 2 * chunk) * element, base + 2 * chunk * element,
                                       shard - 2 * chunk, shard, t);
      a->wait();
      b->wait();
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < shard; ++i)
          require(full.get(r * shard + i) == value(r, i), what + ": rank " + std::to_string(r) + "'s element " +
                                                              std::to_string(i));
    }
    comm.all_gather_strided(nullptr, nullptr, nullptr, 0, 0, tf::dtype::fp32)->wait();  // nothing: done
    bool refused = false;
    try {
      std::vector<float> out(2 * n);
      comm.all_gather_strided(nullptr, out.data(), out.data(), 3, 2, tf::dtype::fp32);
    } catch (const tf::user_error& e) {
      refused = std::string(e.what()).find("overlap at a stride of 2") != std::string::npos;
    }
    require(refused, "pieces that overlap are a user_error naming the stride");
  }));
}

TEST(Gloo, AllGatherStridedAfterAReadStartsOnceTheReadHasFilledTheSlot) {
  expect_all_passed(run_ranks(2, [](tc::communicator& comm) {
    constexpr std::size_t shard = 8, chunk = 8;
    std::vector<float> full(2 * shard, -1.0f);
    auto read = std::make_shared<tc::signalled_work>();
    float* slot = full.data() + comm.rank() * shard;
    // The "read" fills the slot later, on a thread of its own; the gather is issued now.
    std::thread filler([&] {
      std::this_thread::sleep_for(50ms);
      for (std::size_t i = 0; i < chunk; ++i) slot[i] = value(comm.rank(), i);
      read->finish(nullptr);
    });
    auto gathered = comm.all_gather_strided(read, slot, full.data(), chunk, shard, tf::dtype::fp32);
    gathered->wait();
    filler.join();
    for (int r = 0; r < 2; ++r)
      for (std::size_t i = 0; i < chunk; ++i)
        require(full[r * shard + i] == value(r, i), "rank " + std::to_string(r) + "'s element " + std::to_string(i));
  }));
}

INSTANTIATE_TEST_SUITE_P(TwoAndThree, GlooRanks, ::testing::Values(2, 3));

TEST(Gloo, CollectivesIssuedTogetherCompleteInOrderAndAllEmptyIsDone) {
  expect_all_passed(run_ranks(2, [](tc::communicator& comm) {
    constexpr std::size_t n = 1 << 18;  // 1 MiB of fp32: Gloo's ring runs it in segments
    std::vector<buffer> buffers;
    std::vector<tc::work_ptr> handles;
    for (int k = 0; k < 4; ++k) {
      buffers.emplace_back(tf::dtype::fp32, n);
      for (std::size_t i = 0; i < n; ++i) buffers.back().set(i, static_cast<float>(k + comm.rank()));
    }
    for (auto& b : buffers) handles.push_back(comm.all_reduce(b.data(), n, tf::dtype::fp32, tc::reduce_op::sum));
    for (int k = 0; k < 4; ++k) {
      handles[k]->wait();
      require(handles[k]->done(), "done() after wait()");
      require(buffers[k].get(0) == static_cast<float>(2 * k + 1) && buffers[k].get(n - 1) == static_cast<float>(2 * k + 1),
              "all_reduce " + std::to_string(k));
    }
    const std::vector<std::size_t> none{0, 0};
    auto empty = comm.all_gather(nullptr, nullptr, none, tf::dtype::bf16);
    empty->wait();
    comm.reduce_scatter(nullptr, nullptr, none, tf::dtype::fp16, tc::reduce_op::sum)->wait();
  }));
}

TEST(Gloo, BadArgumentsAreUserErrorsNamingThem) {
  EXPECT_THROW(tc::make_gloo_communicator(2, 2, {.store_dir = "/tmp"}), tf::user_error);
  EXPECT_THROW(tc::make_gloo_communicator(0, 0, {.store_dir = "/tmp"}), tf::user_error);
  try {
    tc::make_gloo_communicator(0, 1, {.store_dir = "/nonexistent/rendezvous"});
    FAIL() << "a missing directory was taken";
  } catch (const tf::user_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/rendezvous"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tc::make_gloo_communicator(0, 1, {.store_dir = "/tmp", .timeout = 0ms}), tf::user_error);
  expect_all_passed(run_ranks(1, [](tc::communicator& comm) {
    float x = 1;
    const std::vector<std::size_t> wrong{1, 1};
    bool threw = false;
    try {
      comm.all_gather(&x, &x, wrong, tf::dtype::fp32);
    } catch (const tf::user_error& e) {
      threw = std::string(e.what()).find("2 counts for 1 ranks") != std::string::npos;
    }
    require(threw, "counts of another size");
    threw = false;
    try {
      comm.broadcast(&x, 1, tf::dtype::fp32, 3);
    } catch (const tf::user_error&) {
      threw = true;
    }
    require(threw, "a root beyond the ranks");
    comm.all_reduce(&x, 1, tf::dtype::fp32, tc::reduce_op::sum)->wait();  // one rank: itself
    require(x == 1, "one rank's all_reduce");
  }));
}

TEST(Gloo, ARankThatDiesFailsTheOthersCollectivesWithinTheTimeoutAndBreaksTheCommunicator) {
  const auto timeout = 3s;
  const auto start = std::chrono::steady_clock::now();
  const auto outcomes = run_ranks(3, [](tc::communicator& comm) {
    std::vector<float> x(1 << 16, 1.0f);
    comm.all_reduce(x.data(), x.size(), tf::dtype::fp32, tc::reduce_op::sum)->wait();  // all three alive
    if (comm.rank() == 2) ::_exit(0);  // dies before the next one
    auto first = comm.all_reduce(x.data(), x.size(), tf::dtype::fp32, tc::reduce_op::sum);
    auto second = comm.all_reduce(x.data(), x.size(), tf::dtype::fp32, tc::reduce_op::sum);
    std::string failed;
    try {
      first->wait();
    } catch (const tf::error& e) {
      failed = e.what();
    }
    require(failed.find("all_reduce failed") != std::string::npos && failed.find("broken") != std::string::npos,
            "the first collective after the death: '" + failed + "'");
    bool second_failed = false;
    try {
      second->wait();  // pending behind it: fails with it
    } catch (const tf::error&) {
      second_failed = true;
    }
    require(second_failed, "the collective pending behind it");
    require(comm.all_gather(x.data(), x.data(), std::vector<std::size_t>{1, 1, 1}, tf::dtype::fp32)->done(),
            "a collective issued on a broken communicator is done (failed) at once");
    throw std::runtime_error("expected: " + failed);
  }, timeout);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(outcomes[2].status, 0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(outcomes[r].status, 1) << outcomes[r].output;
    EXPECT_NE(outcomes[r].output.find("expected: gloo communicator (rank " + std::to_string(r) + " of 3)"),
              std::string::npos)
        << outcomes[r].output;
  }
  EXPECT_LT(elapsed, 3 * timeout + 10s) << "the survivors took too long to give up";
}

TEST(Gloo, ARankKilledMidCollectiveOrSilentFailsTheOthersWithinTheTimeout) {
  const auto timeout = 2s;
  for (const bool killed : {true, false}) {
    const auto start = std::chrono::steady_clock::now();
    const auto outcomes = run_ranks(3, [killed, timeout](tc::communicator& comm) {
      std::vector<float> x(1 << 22, 1.0f);  // 16 MiB: long enough to be inside it when the rank goes
      comm.all_reduce(x.data(), 1, tf::dtype::fp32, tc::reduce_op::sum)->wait();
      if (comm.rank() == 2) {
        if (!killed) {  // silent: alive, never joins the collective
          std::this_thread::sleep_for(6s);  // (beyond the others' timeout)
          ::_exit(0);
        }
        std::thread([] {
          std::this_thread::sleep_for(5ms);
          ::kill(::getpid(), SIGKILL);
        }).detach();
      }
      const auto issued = std::chrono::steady_clock::now();
      try {
        comm.all_reduce(x.data(), x.size(), tf::dtype::fp32, tc::reduce_op::sum)->wait();
      } catch (const tf::error&) {
        const auto took = std::chrono::steady_clock::now() - issued;
        require(took < timeout + 2s, "gave up only after " +
                std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) + " ms");
        throw;
      }
    }, timeout);
    const auto elapsed = std::chrono::steady_clock::now() - start;
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(outcomes[r].status, 1) << (killed ? "killed: " : "silent: ") << outcomes[r].output;
      EXPECT_NE(outcomes[r].output.find("all_reduce failed"), std::string::npos) << outcomes[r].output;
    }
    EXPECT_LT(elapsed, 8s + 10s);
  }
}
