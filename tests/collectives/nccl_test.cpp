// The NCCL communicator on real GPUs: one rank on device 0 runs every
// collective and dtype exactly (into buffers pre-filled with garbage, so a
// collective that does nothing fails), on its own stream and on a given one,
// and in NCCL's copy-engine mode with a symmetric window; a rank whose peer
// never comes fails its init within the timeout (NCCL aborted, not hung).
// With two GPUs, two processes run the uneven all-gather and reduce-scatter
// (per-rank broadcasts and reduces in one group) and a rank that falls
// silent: the other's collective fails within the timeout and breaks it,
// also when only a stream waits for it (the watchdog ends it). One rank
// makes a stream wait for a collective on the GPU, the host going on.
//
// Ranks that need a process of their own (NCCL within a process that
// already used CUDA cannot be forked) are this binary run again with
// TIERFLOW_NCCL_WORKER set: a static initializer runs the worker and exits
// before GoogleTest starts. Without a GPU (or NCCL) every test here skips.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dtype_values.hpp"
#include "tierflow/collectives/nccl.hpp"
#include "tierflow/core/error.hpp"

#if TIERFLOW_WITH_NCCL
#include <cuda_runtime.h>
#endif

namespace tf = tierflow;
namespace tc = tierflow::collectives;
using namespace std::chrono_literals;

namespace {

using tierflow::collectives::testing::decode16;
using tierflow::collectives::testing::encode;
using tierflow::collectives::testing::encode16;

#if TIERFLOW_WITH_NCCL

// ---- values and device buffers ----------------------------------------------------------------

const tf::dtype every_dtype[] = {tf::dtype::fp32, tf::dtype::bf16, tf::dtype::fp16};
const tc::reduce_op every_op[] = {tc::reduce_op::sum, tc::reduce_op::max, tc::reduce_op::min};



void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

void check_cuda(cudaError_t rc, const char* what) {
  require(rc == cudaSuccess, std::string(what) + ": " + cudaGetErrorString(rc));
}

// Device memory of the test, pre-filled with 0xff bytes (NaN in every dtype).
struct device_buffer {
  void* data = nullptr;
  std::size_t bytes;
  explicit device_buffer(std::size_t n) : bytes(n) {
    check_cuda(cudaMalloc(&data, n == 0 ? 1 : n), "cudaMalloc");
    check_cuda(cudaMemset(data, 0xff, n == 0 ? 1 : n), "cudaMemset");
  }
  ~device_buffer() { cudaFree(data); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  void upload(const std::vector<std::byte>& from) const {
    check_cuda(cudaMemcpy(data, from.data(), from.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  std::vector<std::byte> download(std::size_t n) const {
    std::vector<std::byte> out(n);
    check_cuda(cudaMemcpy(out.data(), data, n, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return out;
  }
};

int gpu_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  (void)cudaGetLastError();
  return count;
}

// Rank `rank`'s value at element i of a collective's input: small integers,
// which fp32, bf16 and fp16 all hold exactly, as do their sums over 2 ranks.
float value(int rank, std::size_t i) { return static_cast<float>((rank + 1) * 10 + static_cast<int>(i % 7)); }

float reduced(tc::reduce_op op, int ranks, std::size_t i) {
  float out = value(0, i);
  for (int r = 1; r < ranks; ++r) {
    const float v = value(r, i);
    out = op == tc::reduce_op::sum ? out + v : op == tc::reduce_op::max ? std::max(out, v) : std::min(out, v);
  }
  return out;
}

// ---- stores -----------------------------------------------------------------------------------

// The rendezvous of ranks that are threads of one process (or one rank alone).
class memory_store final : public tc::rendezvous_store {
 public:
  void set(const std::string& key, const std::vector<char>& value) override {
    {
      std::lock_guard lock(mutex_);
      values_[key] = value;
    }
    cv_.notify_all();
  }
  std::vector<char> get(const std::string& key) override {
    std::unique_lock lock(mutex_);
    if (!cv_.wait_for(lock, 30s, [&] { return values_.count(key) != 0; }))
      throw std::runtime_error("memory_store: no key '" + key + "' after 30 s");
    return values_[key];
  }
  std::size_t size() {
    std::lock_guard lock(mutex_);
    return values_.size();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<char>> values_;
};

// The rendezvous of ranks in processes: one file per key in a directory,
// written whole (renamed into place) and polled for.
class file_store final : public tc::rendezvous_store {
 public:
  explicit file_store(std::string dir) : dir_(std::move(dir)) {}
  void set(const std::string& key, const std::vector<char>& value) override {
    const std::string path = dir_ + "/" + name(key);
    {
      std::ofstream out(path + ".tmp", std::ios::binary);
      out.write(value.data(), static_cast<std::streamsize>(value.size()));
    }
    std::filesystem::rename(path + ".tmp", path);
  }
  std::vector<char> get(const std::string& key) override {
    const std::string path = dir_ + "/" + name(key);
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (!std::filesystem::exists(path)) {
      if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("file_store: no " + path);
      std::this_thread::sleep_for(5ms);
    }
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

 private:
  static std::string name(std::string key) {
    for (char& c : key)
      if (c == '/') c = '_';
    return key;
  }
  std::string dir_;
};

// ---- one rank -----------------------------------------------------------------------------------

std::unique_ptr<tc::nccl_communicator> one_rank(tc::nccl_options options = {}) {
  options.rank = 0;
  options.size = 1;
  options.device = 0;
  options.timeout = 30s;
  return tc::make_nccl_communicator(options);
}

// Every collective and dtype on `comm` (a group of one), checked exactly.
void every_collective_on_one_rank(tc::communicator& comm) {
  const std::size_t counts[1] = {37};
  const std::size_t n = counts[0];
  std::vector<float> in_values;
  for (std::size_t i = 0; i < n; ++i) in_values.push_back(value(0, i));
  for (const tf::dtype t : every_dtype) {
    const std::size_t bytes = n * tf::size_of(t);
    const std::vector<std::byte> expected = encode(t, in_values);
    device_buffer in(bytes), out(bytes);
    in.upload(expected);

    comm.all_gather(in.data, out.data, counts, t)->wait();
    EXPECT_EQ(out.download(bytes), expected) << "all_gather " << tf::name(t);
    device_buffer same(bytes);
    same.upload(expected);
    comm.all_gather(same.data, same.data, counts, t)->wait();  // in place
    EXPECT_EQ(same.download(bytes), expected) << "all_gather in place " << tf::name(t);

    for (const tc::reduce_op op : every_op) {
      device_buffer scattered(bytes), reduced_in_place(bytes);
      comm.reduce_scatter(in.data, scattered.data, counts, t, op)->wait();
      EXPECT_EQ(scattered.download(bytes), expected) << "reduce_scatter " << tc::name(op) << " " << tf::name(t);
      reduced_in_place.upload(expected);
      const tc::work_ptr w = comm.all_reduce(reduced_in_place.data, n, t, op);
      w->wait();
      EXPECT_TRUE(w->done());
      EXPECT_EQ(reduced_in_place.download(bytes), expected) << "all_reduce " << tc::name(op) << " " << tf::name(t);
    }
    device_buffer root(bytes);
    root.upload(expected);
    comm.broadcast(root.data, n, t, 0)->wait();
    EXPECT_EQ(root.download(bytes), expected) << "broadcast " << tf::name(t);
    // Strided: one rank's piece lands at the output's start, at any stride.
    device_buffer strided(2 * bytes);
    strided.upload(std::vector<std::byte>(2 * bytes, std::byte{0x5a}));
    comm.all_gather_strided(nullptr, in.data, strided.data, n, 2 * n, t)->wait();
    std::vector<std::byte> want = expected;
    want.resize(2 * bytes, std::byte{0x5a});
    EXPECT_EQ(strided.download(2 * bytes), want) << "all_gather_strided " << tf::name(t);
  }
  const std::size_t none[1] = {0};
  EXPECT_TRUE(comm.all_gather(nullptr, nullptr, none, tf::dtype::fp32)->done());
}

TEST(Nccl, WithoutADeviceMakingOneIsAnEnvironmentErrorNotAUserError) {
  if (gpu_count() != 0) GTEST_SKIP() << "a CUDA device is here: the other tests run on it";
  EXPECT_GT(tc::nccl_version(), 0);  // (the library loads and answers without a device)
  try {
    tc::make_nccl_communicator({});
    FAIL() << "made an NCCL communicator without a device";
  } catch (const tf::user_error& e) {
    FAIL() << "no device is an environment failure, not a user error: " << e.what();
  } catch (const tf::error& e) {
    EXPECT_NE(std::string(e.what()).find("cudaGetDeviceCount"), std::string::npos) << e.what();
  }
}

TEST(Nccl, OneRankRunsEveryCollectiveAndDtypeExactly) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device here: NCCL runs on a GPU";
  auto store = std::make_shared<memory_store>();
  tc::nccl_options options;
  options.store = store;
  options.prefix = "one-rank";
  const auto comm = one_rank(options);
  EXPECT_EQ(comm->backend(), "nccl");
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->policy(), tc::cta_policy::standard);
  EXPECT_NE(comm->stream(), nullptr);
  EXPECT_EQ(store->size(), 1u);  // rank 0 set the group's id
  EXPECT_EQ(store->get("one-rank/nccl_unique_id").size(), 128u);
  every_collective_on_one_rank(*comm);
}

TEST(Nccl, CollectivesRunOnAGivenStreamAndInIssueOrder) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device here: NCCL runs on a GPU";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    tc::nccl_options options;
    options.stream = stream;
    const auto comm = one_rank(options);
    EXPECT_EQ(comm->stream(), stream);
    every_collective_on_one_rank(*comm);
    // Issued together, waited for last-first: the stream orders them.
    const std::size_t n = 1 << 20;
    device_buffer a(n * 4), b(n * 4), c(n * 4);
    std::vector<float> ones(n, 1.0f);
    a.upload(encode(tf::dtype::fp32, ones));
    const std::size_t counts[1] = {n};
    const tc::work_ptr first = comm->all_gather(a.data, b.data, counts, tf::dtype::fp32);
    const tc::work_ptr second = comm->all_gather(b.data, c.data, counts, tf::dtype::fp32);
    second->wait();
    EXPECT_TRUE(first->done());
    EXPECT_EQ(c.download(n * 4), encode(tf::dtype::fp32, ones));
  }
  cudaStreamDestroy(stream);
}

TEST(Nccl, AStreamWaitsForACollectiveOnTheGpu) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device here: NCCL runs on a GPU";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t waiter = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&waiter, cudaStreamNonBlocking), cudaSuccess);
  {
    const auto comm = one_rank();
    const std::size_t n = 1 << 20;
    device_buffer a(n * 4), b(n * 4), c(n * 4);
    std::vector<float> values(n);
    for (std::size_t i = 0; i < n; ++i) values[i] = value(0, i);
    a.upload(encode(tf::dtype::fp32, values));
    const std::size_t counts[1] = {n};
    const tc::work_ptr w = comm->all_gather(a.data, b.data, counts, tf::dtype::fp32);
    comm->stream_wait(w, waiter);
    // Queued on the waiting stream behind the gather: its output, copied on.
    ASSERT_EQ(cudaMemcpyAsync(c.data, b.data, n * 4, cudaMemcpyDeviceToDevice, waiter), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(waiter), cudaSuccess);
    EXPECT_EQ(c.download(n * 4), encode(tf::dtype::fp32, values));
    EXPECT_TRUE(w->done());
    EXPECT_NO_THROW(comm->stream_wait(w, waiter));  // done: nothing left to wait for
    EXPECT_THROW(comm->stream_wait(std::make_shared<tc::signalled_work>(), waiter), tf::user_error);
    w->wait();
  }
  cudaStreamDestroy(waiter);
}

TEST(Nccl, CopyEngineModeRunsOnASymmetricWindowOrSaysWhyNot) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device here: NCCL runs on a GPU";
  const std::size_t n = 1 << 18;  // 1 MiB of fp32
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  // (made before the communicator: freed after it deregistered the window)
  tc::nccl_memory window = tc::nccl_memory::allocate(n * 4);
  auto telemetry = std::make_shared<tc::ce_telemetry>();
  tc::nccl_options options;
  options.policy = tc::cta_policy::zero;
  options.telemetry = telemetry;
  const auto comm = one_rank(options);
  const bool has_ce = tc::nccl_version() >= tc::nccl_copy_engine_version;
  EXPECT_EQ(comm->policy(), has_ce ? tc::cta_policy::zero : tc::cta_policy::standard);
  EXPECT_EQ(telemetry->snapshot().zero_cta_unsupported, has_ce ? 0u : 1u);

  EXPECT_THROW(comm->register_window(static_cast<std::byte*>(window.get()) + 4, 4096), tf::user_error);
  const bool registered = comm->register_window(window.get(), window.size());
  EXPECT_EQ(telemetry->snapshot().window_registration_failed, registered ? 0u : 1u);
  // What the policy makes of this communicator, for ranks on NVLink in other processes.
  const tc::ce_policy policy({.ranks = 2, .one_node = true, .one_process = false, .links = tc::link_kind::nvlink},
                             {.bytes = 0, .overlapped_bytes = 0}, tc::capabilities(*comm, registered), telemetry);
  EXPECT_EQ(policy.choose(tc::collective::all_gather, n * 4, tc::compute_overlap::no),
            has_ce && registered ? tc::ce_path::nccl_copy_engine : tc::ce_path::nccl_sm);
  std::vector<float> values(n);
  for (std::size_t i = 0; i < n; ++i) values[i] = value(0, i);
  device_buffer in(n * 4);
  in.upload(encode(tf::dtype::fp32, values));
  const std::size_t counts[1] = {n};
  const auto gathered_into_window = [&](tc::communicator& c) {
    ASSERT_EQ(cudaMemset(window.get(), 0xff, n * 4), cudaSuccess);
    c.all_gather(in.data, window.get(), counts, tf::dtype::fp32)->wait();
    std::vector<std::byte> got(n * 4);
    ASSERT_EQ(cudaMemcpy(got.data(), window.get(), n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, encode(tf::dtype::fp32, values));
  };
  if (registered) {
    gathered_into_window(*comm);
    return;
  }
  // Refused: NCCL's refusal may have left the communicator in error, which
  // breaks it (naming register_window); a new one gathers into the same
  // memory on SMs.
  try {
    gathered_into_window(*comm);
  } catch (const tf::error& e) {
    EXPECT_NE(std::string(e.what()).find("register_window"), std::string::npos) << e.what();
    const auto fresh = one_rank(options);
    gathered_into_window(*fresh);
  }
}

TEST(Nccl, BadArgumentsAreUserErrors) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device here: NCCL runs on a GPU";
  EXPECT_THROW(tc::make_nccl_communicator({.rank = 2, .size = 2}), tf::user_error);
  EXPECT_THROW(tc::make_nccl_communicator({.rank = 0, .size = 0}), tf::user_error);
  EXPECT_THROW(tc::make_nccl_communicator({.rank = 0, .size = 2}), tf::user_error);  // no store
  EXPECT_THROW(tc::make_nccl_communicator({.device = 1 << 20}), tf::user_error);
  EXPECT_THROW(tc::make_nccl_communicator({.timeout = 0ms}), tf::user_error);
  const auto comm = one_rank();
  const std::size_t two[2] = {1, 1};
  EXPECT_THROW(comm->all_gather(nullptr, nullptr, two, tf::dtype::fp32), tf::user_error);
  EXPECT_THROW(comm->broadcast(nullptr, 1, tf::dtype::fp32, 1), tf::user_error);
}

TEST(Nccl, TheCrossoverIsMeasuredOnTheGpu) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device here: the crossover is timed on a GPU";
  const tc::ce_crossover found =
      tc::measure_ce_crossover(0, {.min_bytes = 64 << 10, .max_bytes = 4 << 20, .repeats = 3, .warmups = 1});
  EXPECT_TRUE(found.measured);
  // One of the sweep's sizes, or never.
  const std::size_t sizes[] = {64 << 10, 256 << 10, 1 << 20, 4 << 20, tc::ce_crossover::never};
  EXPECT_NE(std::find(std::begin(sizes), std::end(sizes), found.bytes), std::end(sizes)) << found.bytes;
}

// ---- ranks in processes -----------------------------------------------------------------------

// What a worker was asked, from its environment.
struct worker_job {
  std::string mode, dir;
  int rank = 0, size = 0;
};

// Joins the job's group as its rank, on the GPU of its number (the test's
// buffers are made there too), within `timeout`.
std::unique_ptr<tc::nccl_communicator> join(const worker_job& job, std::chrono::milliseconds timeout) {
  check_cuda(cudaSetDevice(job.rank), "cudaSetDevice");
  tc::nccl_options options;
  options.rank = job.rank;
  options.size = job.size;
  options.device = job.rank;
  options.store = std::make_shared<file_store>(job.dir);
  options.timeout = timeout;
  return tc::make_nccl_communicator(options);
}

void worker_collectives(const worker_job& job) {
  const auto comm = join(job, 30s);
  const std::vector<std::vector<std::size_t>> shapes = {{3, 5}, {4, 4}, {0, 6}};  // uneven, even, one empty
  for (const auto& counts : shapes) {
    std::size_t total = 0, offset = 0;
    for (int r = 0; r < job.size; ++r) {
      if (r < job.rank) offset += counts[r];
      total += counts[r];
    }
    for (const tf::dtype t : every_dtype) {
      const std::size_t e = tf::size_of(t);
      // all_gather: rank r's shard holds value(r, i).
      std::vector<float> shard, gathered;
      for (std::size_t i = 0; i < counts[job.rank]; ++i) shard.push_back(value(job.rank, i));
      for (int r = 0; r < job.size; ++r)
        for (std::size_t i = 0; i < counts[r]; ++i) gathered.push_back(value(r, i));
      device_buffer in(counts[job.rank] * e), out(total * e);
      in.upload(encode(t, shard));
      comm->all_gather(in.data, out.data, counts, t)->wait();
      require(out.download(total * e) == encode(t, gathered), "all_gather " + std::string(tf::name(t)));
      // reduce_scatter: every rank's whole input holds value(r, i).
      for (const tc::reduce_op op : every_op) {
        std::vector<float> whole, mine;
        for (std::size_t i = 0; i < total; ++i) whole.push_back(value(job.rank, i));
        for (std::size_t i = 0; i < counts[job.rank]; ++i) mine.push_back(reduced(op, job.size, offset + i));
        device_buffer rin(total * e), rout(counts[job.rank] * e);
        rin.upload(encode(t, whole));
        comm->reduce_scatter(rin.data, rout.data, counts, t, op)->wait();
        require(rout.download(counts[job.rank] * e) == encode(t, mine),
                "reduce_scatter " + std::string(tc::name(op)) + " " + std::string(tf::name(t)));
      }
    }
  }
  std::vector<float> mine(9), all(9);
  for (std::size_t i = 0; i < 9; ++i) {
    mine[i] = value(job.rank, i);
    all[i] = reduced(tc::reduce_op::sum, job.size, i);
  }
  device_buffer inout(9 * 2);
  inout.upload(encode(tf::dtype::bf16, mine));
  comm->all_reduce(inout.data, 9, tf::dtype::bf16, tc::reduce_op::sum)->wait();
  require(inout.download(18) == encode(tf::dtype::bf16, all), "all_reduce");
  std::vector<float> root(9);
  for (std::size_t i = 0; i < 9; ++i) root[i] = value(1, i);
  inout.upload(encode(tf::dtype::bf16, mine));
  comm->broadcast(inout.data, 9, tf::dtype::bf16, 1)->wait();
  require(inout.download(18) == encode(tf::dtype::bf16, root), "broadcast");
}

// Rank 1 joins and exits; rank 0's all_reduce must fail within the
// timeout, and break the communicator for what follows.
void worker_silent_peer(const worker_job& job) {
  const auto comm = join(job, 3s);
  if (job.rank == 1) std::_Exit(0);  // (no goodbye: as a crash)
  device_buffer buffer(4 << 20);
  const auto start = std::chrono::steady_clock::now();
  const tc::work_ptr w = comm->all_reduce(buffer.data, 1 << 20, tf::dtype::fp32, tc::reduce_op::sum);
  std::string first;
  try {
    w->wait();
    require(false, "the all_reduce with a dead peer succeeded");
  } catch (const tf::error& e) {
    first = e.what();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  require(took < 20s, "the failure took " + std::to_string(std::chrono::duration<double>(took).count()) + " s");
  require(first.find("nccl communicator (rank 0 of 2") != std::string::npos && first.find("all_reduce") != std::string::npos,
          "the error names neither the backend nor the collective: " + first);
  require(w->done(), "a failed work is not done");
  try {
    comm->broadcast(buffer.data, 8, tf::dtype::fp32, 0)->wait();
    require(false, "a collective after the break succeeded");
  } catch (const tf::error& e) {
    require(std::string(e.what()) == first, "a later collective fails differently: " + std::string(e.what()));
  }
}

// Rank 1 joins and exits; rank 0's all_reduce, which only a stream waits
// for (nobody waits on the host), must still fail within the timeout: the
// watchdog aborts NCCL, the waiting stream goes on instead of hanging, and
// the work and what follows fail.
void worker_silent_peer_stream(const worker_job& job) {
  const auto comm = join(job, 3s);
  if (job.rank == 1) std::_Exit(0);
  device_buffer buffer(4 << 20);
  cudaStream_t waiter = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&waiter, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  const auto start = std::chrono::steady_clock::now();
  const tc::work_ptr w = comm->all_reduce(buffer.data, 1 << 20, tf::dtype::fp32, tc::reduce_op::sum);
  comm->stream_wait(w, waiter);
  (void)cudaStreamSynchronize(waiter);  // hangs unless the watchdog ended the collective
  (void)cudaGetLastError();
  const auto took = std::chrono::steady_clock::now() - start;
  require(took < 20s, "the stream waited " + std::to_string(std::chrono::duration<double>(took).count()) + " s");
  require(w->done(), "the watchdog left the work unfinished");
  try {
    w->wait();
    require(false, "the all_reduce with a dead peer succeeded");
  } catch (const tf::error& e) {
    const std::string what = e.what();
    require(what.find("nccl communicator (rank 0 of 2") != std::string::npos && what.find("all_reduce") != std::string::npos,
            "the error names neither the backend nor the collective: " + what);
  }
  try {
    comm->stream_wait(comm->broadcast(buffer.data, 8, tf::dtype::fp32, 0), waiter);
    require(false, "a stream wait after the break succeeded");
  } catch (const tf::error&) {
  }
  cudaStreamDestroy(waiter);
}

// Rank 0 of 2 alone: its init must fail within the timeout.
void worker_alone(const worker_job& job) {
  tc::nccl_options options;
  options.rank = 0;
  options.size = 2;
  options.store = std::make_shared<file_store>(job.dir);
  options.timeout = 2s;
  const auto start = std::chrono::steady_clock::now();
  try {
    tc::make_nccl_communicator(options);
    require(false, "rank 0 of 2 was made without rank 1");
  } catch (const tf::user_error& e) {
    require(false, std::string("not a user error: ") + e.what());
  } catch (const tf::error& e) {
    const std::string what = e.what();
    require(what.find("rank 0 of 2") != std::string::npos && what.find("timeout") != std::string::npos,
            "the error says neither the rank nor the timeout: " + what);
  }
  const auto took = std::chrono::steady_clock::now() - start;
  require(took < 15s, "the init's failure took " + std::to_string(std::chrono::duration<double>(took).count()) + " s");
}

// Runs the worker this process was started as, if it was, and exits.
bool run_worker_if_asked() {
  const char* mode = std::getenv("TIERFLOW_NCCL_WORKER");
  if (mode == nullptr) return false;
  worker_job job{mode, std::getenv("TIERFLOW_NCCL_DIR"), std::atoi(std::getenv("TIERFLOW_NCCL_RANK")),
                 std::atoi(std::getenv("TIERFLOW_NCCL_SIZE"))};
  int status = 0;
  std::string report;
  try {
    if (job.mode == "collectives") worker_collectives(job);
    else if (job.mode == "silent") worker_silent_peer(job);
    else if (job.mode == "silent_stream") worker_silent_peer_stream(job);
    else if (job.mode == "alone") worker_alone(job);
    else throw std::runtime_error("unknown worker " + job.mode);
  } catch (const std::exception& e) {
    report = e.what();
    status = 1;
  }
  std::ofstream(job.dir + "/report." + std::to_string(job.rank)) << report;
  std::fflush(nullptr);
  std::_Exit(status);
}

[[maybe_unused]] const bool worker_ran = run_worker_if_asked();

struct outcome {
  int status = -1;  // the exit status, -1 when killed past the limit
  std::string output;
};

// Runs `ranks` workers of `mode` (this binary again), each killed once
// `limit` has passed.
std::vector<outcome> run_workers(const std::string& mode, int ranks, std::chrono::seconds limit = 120s) {
  char pattern[] = "/tmp/tierflow-nccl-XXXXXX";
  const char* made = ::mkdtemp(pattern);
  if (made == nullptr) throw std::runtime_error("mkdtemp");
  const std::string dir = made;
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    // The environment made before the fork: the child (of a process with
    // CUDA's and NCCL's threads) only calls execve.
    std::vector<std::string> env = {"TIERFLOW_NCCL_WORKER=" + mode, "TIERFLOW_NCCL_DIR=" + dir,
                                    "TIERFLOW_NCCL_RANK=" + std::to_string(r),
                                    "TIERFLOW_NCCL_SIZE=" + std::to_string(ranks)};
    for (char** e = environ; *e != nullptr; ++e)
      if (std::strncmp(*e, "TIERFLOW_NCCL_", 14) != 0) env.emplace_back(*e);
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    char name[] = "collectives_test";
    char* argv[] = {name, nullptr};
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::execve("/proc/self/exe", argv, envp.data());
      ::_exit(127);
    }
    pids.push_back(pid);
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
    std::ifstream report(dir + "/report." + std::to_string(r));
    out[r].output.assign(std::istreambuf_iterator<char>(report), std::istreambuf_iterator<char>());
  }
  std::filesystem::remove_all(dir);
  return out;
}

TEST(Nccl, ARankWhosePeerNeverComesFailsItsInitWithinTheTimeout) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device here: NCCL runs on a GPU";
  const std::vector<outcome> out = run_workers("alone", 1, 60s);
  EXPECT_EQ(out[0].status, 0) << (out[0].status == -1 ? "hung: killed after 60 s" : out[0].output);
}

TEST(NcclTwoRanks, UnevenAllGatherAndReduceScatterAreExact) {
  if (gpu_count() < 2) GTEST_SKIP() << "fewer than 2 CUDA devices here: two NCCL ranks need one each";
  const std::vector<outcome> out = run_workers("collectives", 2);
  for (std::size_t r = 0; r < out.size(); ++r) EXPECT_EQ(out[r].status, 0) << "rank " << r << ": " << out[r].output;
}

TEST(NcclTwoRanks, ASilentPeerFailsTheOthersCollectiveWithinTheTimeoutAndBreaksIt) {
  if (gpu_count() < 2) GTEST_SKIP() << "fewer than 2 CUDA devices here: two NCCL ranks need one each";
  const std::vector<outcome> out = run_workers("silent", 2);
  EXPECT_EQ(out[0].status, 0) << (out[0].status == -1 ? "hung: killed after 120 s" : out[0].output);
}

TEST(NcclTwoRanks, ASilentPeerFailsACollectiveOnlyAStreamWaitsForWithinTheTimeout) {
  if (gpu_count() < 2) GTEST_SKIP() << "fewer than 2 CUDA devices here: two NCCL ranks need one each";
  const std::vector<outcome> out = run_workers("silent_stream", 2);
  EXPECT_EQ(out[0].status, 0) << (out[0].status == -1 ? "hung: killed after 120 s" : out[0].output);
}

#else

TEST(Nccl, WithoutNcclItSaysSo) {
  EXPECT_EQ(tc::nccl_version(), 0);
  try {
    tc::make_nccl_communicator({});
    FAIL() << "made an NCCL communicator without NCCL";
  } catch (const tf::user_error& e) {
    FAIL() << "no NCCL is an environment failure, not a user error: " << e.what();
  } catch (const tf::error& e) {
    EXPECT_NE(std::string(e.what()).find("without NCCL"), std::string::npos) << e.what();
  }
}

#endif

}  // namespace
