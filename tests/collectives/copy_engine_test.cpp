// The copy-engine collectives: the per-call choice of path (ce_policy, pure
// logic: every topology, crossover and fallback given explicitly, each
// decision's counter checked), the crossover found from a sweep's timings,
// and — on a GPU — peer copies across device buffers of one process, run as
// copies to self on one device (members may share a device), checked
// element by element. Without a GPU those are skips.

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dtype_values.hpp"
#include "tierflow/collectives/copy_engine.hpp"
#include "tierflow/core/error.hpp"

#if TIERFLOW_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace tf = tierflow;
namespace tc = tierflow::collectives;

namespace {

using tierflow::collectives::testing::decode16;
using tierflow::collectives::testing::encode;
using tierflow::collectives::testing::encode16;

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;

tc::ce_topology nvlink_node(int ranks, bool one_process) {
  return {.ranks = ranks, .one_node = true, .one_process = one_process, .links = tc::link_kind::nvlink};
}

tc::ce_capabilities nccl_ce_ready() {
  return {.nccl_version = 22809, .nccl_zero_cta = true, .window_registered = true};
}

tc::ce_crossover crossover(std::size_t alone, std::size_t overlapped) {
  return {.bytes = alone, .overlapped_bytes = overlapped, .measured = false};
}

// ---- the choice ---------------------------------------------------------------------------------

TEST(CePolicy, ReductionsAlwaysRunOnNcclsKernels) {
  const tc::ce_policy policy(nvlink_node(8, false), crossover(0, 0), nccl_ce_ready());
  for (const tc::collective op : {tc::collective::reduce_scatter, tc::collective::all_reduce})
    for (const tc::compute_overlap overlap : {tc::compute_overlap::no, tc::compute_overlap::yes})
      EXPECT_EQ(policy.choose(op, 1024 * MiB, overlap), tc::ce_path::nccl_sm) << tc::name(op);
  const auto c = policy.telemetry().snapshot();
  EXPECT_EQ(c.nccl_sm, 4u);
  EXPECT_EQ(c.reduction, 4u);
  EXPECT_EQ(c.nccl_copy_engine + c.peer_copy + c.below_crossover, 0u);
}

TEST(CePolicy, AllGatherAndBroadcastTakeTheCopyEnginesFromTheCrossoverOn) {
  const tc::ce_policy policy(nvlink_node(8, false), crossover(1 * MiB, 1 * MiB), nccl_ce_ready());
  EXPECT_EQ(policy.choose(tc::collective::all_gather, 1 * MiB - 1, tc::compute_overlap::no), tc::ce_path::nccl_sm);
  EXPECT_EQ(policy.choose(tc::collective::all_gather, 1 * MiB, tc::compute_overlap::no),
            tc::ce_path::nccl_copy_engine);
  EXPECT_EQ(policy.choose(tc::collective::broadcast, 64 * MiB, tc::compute_overlap::no),
            tc::ce_path::nccl_copy_engine);
  EXPECT_EQ(policy.choose(tc::collective::broadcast, 4 * KiB, tc::compute_overlap::yes), tc::ce_path::nccl_sm);
  const auto c = policy.telemetry().snapshot();
  EXPECT_EQ(c.nccl_copy_engine, 2u);
  EXPECT_EQ(c.nccl_sm, 2u);
  EXPECT_EQ(c.below_crossover, 2u);
}

TEST(CePolicy, OverlappingComputeLowersTheCrossover) {
  const tc::ce_policy policy(nvlink_node(4, false), crossover(16 * MiB, 2 * MiB), nccl_ce_ready());
  EXPECT_EQ(policy.choose(tc::collective::all_gather, 4 * MiB, tc::compute_overlap::no), tc::ce_path::nccl_sm);
  EXPECT_EQ(policy.choose(tc::collective::all_gather, 4 * MiB, tc::compute_overlap::yes),
            tc::ce_path::nccl_copy_engine);
  EXPECT_EQ(policy.choose(tc::collective::all_gather, 1 * MiB, tc::compute_overlap::yes), tc::ce_path::nccl_sm);
  // An overlapped crossover above the alone one is no crossover of its own:
  // overlap never makes the copy engines less wanted.
  const tc::ce_policy odd(nvlink_node(4, false), crossover(1 * MiB, 8 * MiB), nccl_ce_ready());
  EXPECT_EQ(odd.choose(tc::collective::all_gather, 2 * MiB, tc::compute_overlap::yes), tc::ce_path::nccl_copy_engine);
}

TEST(CePolicy, AnUnmeasuredCrossoverWantsTheCopyEnginesOnlyBesideCompute) {
  const tc::ce_policy policy(nvlink_node(2, false), tc::ce_crossover{}, nccl_ce_ready());
  EXPECT_EQ(policy.choose(tc::collective::all_gather, 1024 * MiB, tc::compute_overlap::no), tc::ce_path::nccl_sm);
  EXPECT_EQ(policy.choose(tc::collective::all_gather, 1, tc::compute_overlap::yes), tc::ce_path::nccl_copy_engine);
  EXPECT_EQ(policy.telemetry().snapshot().below_crossover, 1u);
}

TEST(CePolicy, OneProcessTakesPeerCopiesOnNvlinkOrOnOneGpu) {
  const tc::ce_policy nvlink(nvlink_node(4, true), crossover(1 * MiB, 0), tc::ce_capabilities{});
  EXPECT_EQ(nvlink.choose(tc::collective::all_gather, 8 * MiB, tc::compute_overlap::no), tc::ce_path::peer_copy);
  const tc::ce_policy self({.ranks = 1, .one_node = true, .one_process = true, .links = tc::link_kind::self},
                           crossover(1 * MiB, 0), tc::ce_capabilities{});
  EXPECT_EQ(self.choose(tc::collective::broadcast, 8 * MiB, tc::compute_overlap::no), tc::ce_path::peer_copy);
  EXPECT_EQ(self.choose(tc::collective::reduce_scatter, 8 * MiB, tc::compute_overlap::no), tc::ce_path::nccl_sm);
  EXPECT_EQ(self.telemetry().snapshot().peer_copy, 1u);
}

TEST(CePolicy, EveryFallbackIsCountedWhereACopyEngineWasWanted) {
  auto telemetry = std::make_shared<tc::ce_telemetry>();
  const auto sm_for = [&](tc::ce_topology topology, tc::ce_capabilities capabilities) {
    const tc::ce_policy policy(topology, crossover(1 * MiB, 0), capabilities, telemetry);
    return policy.choose(tc::collective::all_gather, 4 * MiB, tc::compute_overlap::no);
  };
  tc::ce_topology two_nodes = nvlink_node(16, false);
  two_nodes.one_node = false;
  EXPECT_EQ(sm_for(two_nodes, nccl_ce_ready()), tc::ce_path::nccl_sm);
  tc::ce_topology pcie = nvlink_node(4, true);  // (even within one process)
  pcie.links = tc::link_kind::pcie;
  EXPECT_EQ(sm_for(pcie, nccl_ce_ready()), tc::ce_path::nccl_sm);
  tc::ce_capabilities old = nccl_ce_ready();
  old.nccl_version = 22802;  // 2.28.2: one patch short
  EXPECT_EQ(sm_for(nvlink_node(4, false), old), tc::ce_path::nccl_sm);
  tc::ce_capabilities default_policy = nccl_ce_ready();
  default_policy.nccl_zero_cta = false;
  EXPECT_EQ(sm_for(nvlink_node(4, false), default_policy), tc::ce_path::nccl_sm);
  tc::ce_capabilities no_window = nccl_ce_ready();
  no_window.window_registered = false;
  EXPECT_EQ(sm_for(nvlink_node(4, false), no_window), tc::ce_path::nccl_sm);
  EXPECT_EQ(sm_for(nvlink_node(4, false), nccl_ce_ready()), tc::ce_path::nccl_copy_engine);
  const auto c = telemetry->snapshot();
  EXPECT_EQ(c.not_one_node, 1u);
  EXPECT_EQ(c.not_nvlink, 1u);
  EXPECT_EQ(c.nccl_too_old, 1u);
  EXPECT_EQ(c.no_zero_cta, 1u);
  EXPECT_EQ(c.no_window, 1u);
  EXPECT_EQ(c.nccl_sm, 5u);
  EXPECT_EQ(c.nccl_copy_engine, 1u);
  EXPECT_EQ(c.below_crossover + c.reduction + c.peer_copy, 0u);
}

TEST(CePolicy, CountsFromManyThreadsAddUp) {
  const tc::ce_policy policy(nvlink_node(2, false), crossover(1 * MiB, 1 * MiB), nccl_ce_ready());
  constexpr int threads = 4, calls = 20000;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&policy, t] {
      for (int i = 0; i < calls; ++i)
        policy.choose(tc::collective::all_gather, (i + t) % 2 == 0 ? 2 * MiB : 2 * KiB, tc::compute_overlap::no);
    });
  for (auto& th : pool) th.join();
  const auto c = policy.telemetry().snapshot();
  EXPECT_EQ(c.nccl_copy_engine, std::uint64_t{threads} * calls / 2);
  EXPECT_EQ(c.nccl_sm, std::uint64_t{threads} * calls / 2);
  EXPECT_EQ(c.below_crossover, c.nccl_sm);
}

TEST(CePolicy, BadTopologyIsAUserError) {
  EXPECT_THROW(tc::ce_policy({.ranks = 0}, tc::ce_crossover{}, tc::ce_capabilities{}), tf::user_error);
}

// ---- the crossover ------------------------------------------------------------------------------

TEST(CeCrossover, IsTheSmallestSizeFromWhichTheCopyEnginesStayFaster) {
  const std::vector<tc::ce_timing> timings = {
      {64 * KiB, 1.0, 2.0}, {256 * KiB, 1.0, 0.5},  // (faster here, but not at the next)
      {1 * MiB, 1.0, 1.5},  {4 * MiB, 2.0, 1.0},  {16 * MiB, 8.0, 3.0}};
  const tc::ce_crossover found = tc::find_crossover(timings);
  EXPECT_TRUE(found.measured);
  EXPECT_EQ(found.bytes, 4 * MiB);
  EXPECT_EQ(found.overlapped_bytes, 0u);

  const std::vector<tc::ce_timing> never = {{64 * KiB, 1.0, 0.5}, {256 * KiB, 1.0, 1.0}};  // (a tie is no win)
  EXPECT_EQ(tc::find_crossover(never).bytes, tc::ce_crossover::never);
  const std::vector<tc::ce_timing> always = {{64 * KiB, 1.0, 0.5}, {256 * KiB, 2.0, 1.0}};
  EXPECT_EQ(tc::find_crossover(always).bytes, 64 * KiB);
  EXPECT_EQ(tc::find_crossover({}).bytes, tc::ce_crossover::never);
}

TEST(CeCrossover, TheSweepRunsBothPathsAlternatelyAtEverySize) {
  std::vector<std::pair<char, std::size_t>> calls;
  const auto sm = [&](std::size_t bytes) { calls.emplace_back('s', bytes); };
  const auto ce = [&](std::size_t bytes) { calls.emplace_back('c', bytes); };
  const tc::crossover_sweep sweep{.min_bytes = 64 * KiB, .max_bytes = 1 * MiB, .factor = 4, .repeats = 3, .warmups = 1};
  const std::vector<tc::ce_timing> timings = tc::time_paths(sm, ce, sweep);
  ASSERT_EQ(timings.size(), 3u);
  EXPECT_EQ(timings[0].shard_bytes, 64 * KiB);
  EXPECT_EQ(timings[1].shard_bytes, 256 * KiB);
  EXPECT_EQ(timings[2].shard_bytes, 1 * MiB);
  ASSERT_EQ(calls.size(), 3u * 2 * (1 + 3));
  for (std::size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].first, i % 2 == 0 ? 's' : 'c') << i;
    EXPECT_EQ(calls[i].second, timings[i / 8].shard_bytes) << i;
  }
  for (const auto& t : timings) {
    EXPECT_GE(t.sm_seconds, 0.0);
    EXPECT_GE(t.ce_seconds, 0.0);
  }
  // A max not on the ladder: the sweep stops at the last size below it.
  EXPECT_EQ(tc::time_paths(sm, ce, {.min_bytes = 64 * KiB, .max_bytes = 1 * MiB - 1, .repeats = 1, .warmups = 0})
                .back()
                .shard_bytes,
            256 * KiB);
}

TEST(CeCrossover, BadSweepsAreUserErrors) {
  const auto none = [](std::size_t) {};
  EXPECT_THROW(tc::time_paths(none, none, {.min_bytes = 0}), tf::user_error);
  EXPECT_THROW(tc::time_paths(none, none, {.min_bytes = 2 * MiB, .max_bytes = 1 * MiB}), tf::user_error);
  EXPECT_THROW(tc::time_paths(none, none, {.factor = 1}), tf::user_error);
  EXPECT_THROW(tc::time_paths(none, none, {.repeats = 0}), tf::user_error);
}

// ---- peer copies on a GPU -------------------------------------------------------------------------

#if TIERFLOW_WITH_CUDA

bool gpu_present() {
  int count = 0;
  const bool present = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  return present;
}



// Device memory of the test, freed at its end.
struct device_buffer {
  void* data = nullptr;
  explicit device_buffer(std::size_t bytes) {
    if (cudaMalloc(&data, bytes == 0 ? 1 : bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc");
  }
  ~device_buffer() { cudaFree(data); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
};

void upload(void* dst, const std::vector<std::byte>& bytes) {
  ASSERT_EQ(cudaMemcpy(dst, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
}

std::vector<std::byte> download(const void* src, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), src, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

const tf::dtype every_dtype[] = {tf::dtype::fp32, tf::dtype::bf16, tf::dtype::fp16};

TEST(PeerCopy, WithoutADeviceMakingAGroupIsAnEnvironmentErrorNotAUserError) {
  if (gpu_present()) GTEST_SKIP() << "a CUDA device is here: the other tests run on it";
  try {
    tc::peer_copy_group group({0});
    FAIL() << "made a peer_copy_group without a device";
  } catch (const tf::user_error& e) {
    FAIL() << "no device is an environment failure, not a user error: " << e.what();
  } catch (const tf::error& e) {
    EXPECT_NE(std::string(e.what()).find("cudaGetDeviceCount"), std::string::npos) << e.what();
  }
  const int devices[] = {0};
  EXPECT_THROW(tc::probe_ce_topology(devices), tf::error);
}

TEST(PeerCopy, AllGatherOfUnevenShardsToSelfIsExactInEveryDtype) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device here: the peer copies run on a GPU";
  // Three members on device 0: each one's output gets every input, by copies to self.
  const std::vector<std::size_t> counts = {3, 0, 5};
  const std::size_t total = 8;
  auto telemetry = std::make_shared<tc::ce_telemetry>();
  tc::peer_copy_group group({0, 0, 0}, {}, telemetry);
  for (const tf::dtype t : every_dtype) {
    const std::size_t e = tf::size_of(t);
    std::vector<std::unique_ptr<device_buffer>> ins, outs;
    std::vector<float> expected;
    for (int m = 0; m < 3; ++m) {
      std::vector<float> shard;
      for (std::size_t i = 0; i < counts[m]; ++i) shard.push_back(static_cast<float>((m + 1) * 10 + i));
      expected.insert(expected.end(), shard.begin(), shard.end());
      ins.push_back(std::make_unique<device_buffer>(counts[m] * e));
      if (counts[m] != 0) upload(ins.back()->data, encode(t, shard));
      outs.push_back(std::make_unique<device_buffer>(total * e));
      ASSERT_EQ(cudaMemset(outs.back()->data, 0xff, total * e), cudaSuccess);
    }
    const void* in[3] = {ins[0]->data, ins[1]->data, ins[2]->data};
    void* out[3] = {outs[0]->data, outs[1]->data, outs[2]->data};
    const tc::work_ptr w = group.all_gather(in, out, counts, t);
    w->wait();
    EXPECT_TRUE(w->done());
    for (int m = 0; m < 3; ++m) EXPECT_EQ(download(out[m], total * e), encode(t, expected)) << "member " << m;
  }
  EXPECT_EQ(telemetry->snapshot().batch_copy_unsupported, group.batched() ? 0u : 3u * 3u);
}

TEST(PeerCopy, AllGatherInPlaceLeavesEachMembersOwnSlotAndFillsTheRest) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device here: the peer copies run on a GPU";
  const std::vector<std::size_t> counts = {4, 2};
  const tf::dtype t = tf::dtype::fp32;
  tc::peer_copy_group group({0, 0});
  device_buffer a(6 * 4), b(6 * 4);
  upload(a.data, encode(t, {1, 2, 3, 4, -1, -1}));  // member 0's shard in its slot
  upload(b.data, encode(t, {-1, -1, -1, -1, 5, 6}));  // member 1's in its
  const void* in[2] = {a.data, static_cast<std::byte*>(b.data) + 4 * 4};
  void* out[2] = {a.data, b.data};
  group.all_gather(in, out, counts, t)->wait();
  EXPECT_EQ(download(a.data, 24), encode(t, {1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(download(b.data, 24), encode(t, {1, 2, 3, 4, 5, 6}));
}

TEST(PeerCopy, BroadcastGivesEveryMemberTheRootsBuffer) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device here: the peer copies run on a GPU";
  tc::peer_copy_group group({0, 0, 0});
  const tf::dtype t = tf::dtype::bf16;
  const std::vector<float> root_values = {7, 8, 9, 10, 11};
  device_buffer b0(10), b1(10), b2(10);
  upload(b0.data, encode(t, {0, 0, 0, 0, 0}));
  upload(b1.data, encode(t, root_values));
  upload(b2.data, encode(t, {1, 1, 1, 1, 1}));
  void* buffers[3] = {b0.data, b1.data, b2.data};
  group.broadcast(buffers, 5, t, 1)->wait();
  for (void* b : buffers) EXPECT_EQ(download(b, 10), encode(t, root_values));
  EXPECT_TRUE(group.broadcast(buffers, 0, t, 1)->done());  // nothing to copy
  EXPECT_THROW(group.broadcast(buffers, 5, t, 3), tf::user_error);
}

TEST(PeerCopy, BadArgumentsAreUserErrors) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device here: the peer copies run on a GPU";
  EXPECT_THROW(tc::peer_copy_group(std::vector<int>{}), tf::user_error);
  EXPECT_THROW(tc::peer_copy_group(std::vector<int>{0, 1 << 20}), tf::user_error);
  tc::peer_copy_group group({0, 0});
  const void* in[1] = {nullptr};
  void* out[1] = {nullptr};
  const std::size_t counts[1] = {0};
  EXPECT_THROW(group.all_gather(in, out, counts, tf::dtype::fp32), tf::user_error);
}

TEST(PeerCopy, OneGpuIsASelfTopology) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device here";
  const int devices[] = {0, 0};
  const tc::ce_topology topology = tc::probe_ce_topology(devices);
  EXPECT_EQ(topology.ranks, 2);
  EXPECT_TRUE(topology.one_node);
  EXPECT_TRUE(topology.one_process);
  EXPECT_EQ(topology.links, tc::link_kind::self);
}

#else

TEST(PeerCopy, WithoutCudaItSaysSo) {
  try {
    tc::peer_copy_group group({0});
    FAIL() << "made a peer_copy_group without CUDA";
  } catch (const tf::user_error& e) {
    FAIL() << "no CUDA is an environment failure, not a user error: " << e.what();
  } catch (const tf::error& e) {
    EXPECT_NE(std::string(e.what()).find("without CUDA"), std::string::npos) << e.what();
  }
}

#endif

}  // namespace
