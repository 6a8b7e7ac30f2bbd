// Copy-engine ("System DMA") collectives and the choice of path per call.
//
// An all-gather or a broadcast only moves bytes: the GPU's copy engines can
// run it and leave every SM to the compute it overlaps, where NCCL's
// kernels would take some. Three paths, chosen per call by `ce_policy`:
//
//   nccl_sm           NCCL's kernels: every collective, every topology.
//   nccl_copy_engine  NCCL's own copy-engine mode (a communicator made with
//                     cta_policy::zero, NCCL >= 2.28.3, the receive buffer
//                     registered as a symmetric window): see nccl.hpp.
//   peer_copy         copies between the device buffers of one process, on
//                     copy-engine streams (peer_copy_group, below).
//
// Reductions (reduce_scatter, all_reduce) always take nccl_sm: the copy
// engines do not add. The others take a copy-engine path when every rank is
// on this node with every pair on NVLink, and either the shard is at least
// the crossover (the size from which the copy engines are faster, measured
// at start-up on the real GPUs: measure_ce_crossover in nccl.hpp) or compute
// overlaps and the shard is at least the (smaller) overlapped crossover.
//
// Every decision and every fallback (a copy engine wanted but not to be had)
// is counted in a `ce_telemetry` the caller reads.
//
// ce_policy, find_crossover and time_paths are plain C++ (built and tested
// everywhere); peer_copy_group and probe_ce_topology need CUDA and a device,
// and throw tierflow::error without them.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "tierflow/collectives/communicator.hpp"
#include "tierflow/core/dtype.hpp"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace tierflow::collectives {

enum class collective : unsigned char { all_gather, reduce_scatter, all_reduce, broadcast };
// "all_gather", "reduce_scatter", "all_reduce", "broadcast".
std::string_view name(collective c) noexcept;

enum class ce_path : unsigned char { nccl_sm, nccl_copy_engine, peer_copy };
// "nccl_sm", "nccl_copy_engine", "peer_copy".
std::string_view name(ce_path p) noexcept;

// Whether compute runs beside the collective (and would lose SMs to it).
enum class compute_overlap : unsigned char { no, yes };

// The slowest link between any two of the group's GPUs.
enum class link_kind : unsigned char {
  self,    // one GPU: the copies are to itself
  nvlink,  // every pair on NVLink (or NVSwitch)
  pcie,    // some pair only over PCIe (or not peer-capable at all)
};
std::string_view name(link_kind k) noexcept;

// Where the group's GPUs are.
struct ce_topology {
  int ranks = 1;
  bool one_node = true;      // every rank on this node
  bool one_process = false;  // every rank's buffer in this process (peer copies possible)
  link_kind links = link_kind::self;
};

// What this communicator can do, found when it was made.
struct ce_capabilities {
  int nccl_version = 0;            // the runtime NCCL's NCCL_VERSION_CODE, 0 without
  bool nccl_zero_cta = false;      // the NCCL communicator runs with cta_policy::zero
  bool window_registered = false;  // the receive buffer is a symmetric window
};

// NCCL's first version with copy-engine collectives (2.28.3).
inline constexpr int nccl_copy_engine_version = 22803;

// The shard size from which the copy engines beat NCCL's kernels.
struct ce_crossover {
  static constexpr std::size_t never = std::numeric_limits<std::size_t>::max();
  // Alone: at and above it the copy engines are faster with nothing beside.
  std::size_t bytes = never;
  // With compute overlapping: NCCL's kernels also slow the compute, so the
  // copy engines pay from a smaller size on (by default from any).
  std::size_t overlapped_bytes = 0;
  bool measured = false;  // from a sweep on this machine's GPUs, not given
};

// The counters: decisions by path, and why a copy engine was not taken.
// Atomic (relaxed: each is a count, read as a whole by snapshot()), so one
// telemetry serves every thread's policy and communicator.
struct ce_telemetry {
  std::atomic<std::uint64_t> nccl_sm{0};
  std::atomic<std::uint64_t> nccl_copy_engine{0};
  std::atomic<std::uint64_t> peer_copy{0};
  // Why nccl_sm: a reduction, or a shard below the crossover (no copy engine wanted).
  std::atomic<std::uint64_t> reduction{0};
  std::atomic<std::uint64_t> below_crossover{0};
  // Fallbacks: a copy engine wanted, nccl_sm taken because...
  std::atomic<std::uint64_t> not_one_node{0};    // some rank on another node
  std::atomic<std::uint64_t> not_nvlink{0};      // some pair only over PCIe
  std::atomic<std::uint64_t> nccl_too_old{0};    // the runtime NCCL is older than 2.28.3
  std::atomic<std::uint64_t> no_zero_cta{0};     // the communicator was not made with cta_policy::zero
  std::atomic<std::uint64_t> no_window{0};       // the receive buffer is no symmetric window
  // Fallbacks inside the backends.
  std::atomic<std::uint64_t> zero_cta_unsupported{0};        // cta_policy::zero asked, NCCL too old: made with the default
  std::atomic<std::uint64_t> window_registration_failed{0};  // ncclCommWindowRegister refused
  std::atomic<std::uint64_t> batch_copy_unsupported{0};      // cudaMemcpyBatchAsync missing: one copy per call

  struct counts {
    std::uint64_t nccl_sm, nccl_copy_engine, peer_copy, reduction, below_crossover, not_one_node, not_nvlink,
        nccl_too_old, no_zero_cta, no_window, zero_cta_unsupported, window_registration_failed,
        batch_copy_unsupported;
  };
  counts snapshot() const noexcept;
};

// The per-call choice. Immutable once made, but for the counters: choose()
// may be called from any thread.
class ce_policy {
 public:
  ce_policy(ce_topology topology, ce_crossover crossover, ce_capabilities capabilities,
            std::shared_ptr<ce_telemetry> telemetry = std::make_shared<ce_telemetry>());

  // The path for `op` with shards of `shard_bytes` (all_gather: one rank's
  // shard; broadcast: the buffer), counted in telemetry().
  ce_path choose(collective op, std::size_t shard_bytes, compute_overlap overlap) const noexcept;

  const ce_topology& topology() const noexcept { return topology_; }
  const ce_crossover& crossover() const noexcept { return crossover_; }
  const ce_telemetry& telemetry() const noexcept { return *telemetry_; }

 private:
  ce_topology topology_;
  ce_crossover crossover_;
  ce_capabilities capabilities_;
  std::shared_ptr<ce_telemetry> telemetry_;
};

// ---- the crossover --------------------------------------------------------------------------

// Which sizes to time, and how often.
struct crossover_sweep {
  std::size_t min_bytes = std::size_t{64} << 10;  // 64 KiB
  std::size_t max_bytes = std::size_t{64} << 20;  // 64 MiB
  unsigned factor = 4;                            // each size is the last times this
  int repeats = 5;                                // each path's time is the best of these
  int warmups = 2;                                // runs before, not timed
};

// One shard size's times, the best of the repeats, in seconds.
struct ce_timing {
  std::size_t shard_bytes = 0;
  double sm_seconds = 0;
  double ce_seconds = 0;
};

// The smallest size of `timings` (in increasing size) from which the copy
// engines were faster at it and at every larger size; `never` when they
// were not faster at the largest. measured = true; overlapped_bytes 0.
ce_crossover find_crossover(std::span<const ce_timing> timings);

// Runs `sm` and `ce` (each runs one collective of a shard of that many bytes
// and waits for it) over the sweep's sizes, alternating them, and times
// each with the steady clock. Throws user_error for a bad sweep.
std::vector<ce_timing> time_paths(const std::function<void(std::size_t)>& sm,
                                  const std::function<void(std::size_t)>& ce, const crossover_sweep& sweep);

// ---- peer copies within a process (CUDA) ------------------------------------------------------

// The topology of `devices` (this process's, one per rank, a device may
// repeat): one node, one process; self when every entry is one device,
// nvlink when every pair has peer access with native atomics (which CUDA
// reports for NVLink, not for PCIe, on the H100/H200 systems this targets),
// else pcie. Throws tierflow::error without CUDA or a device.
ce_topology probe_ce_topology(std::span<const int> devices);

// All-gather and broadcast across the device buffers of one process, one
// buffer per member, as copies on one copy-engine stream per member: a
// member's copies are the ones into its buffer, on its stream (its device's
// copy engines pull them). cudaMemcpyBatchAsync (CUDA 12.8+) submits each
// member's copies as one batch; without it (an older runtime or driver),
// one cudaMemcpyPeerAsync per copy, counted in batch_copy_unsupported.
//
// Ordering: the copies run after the work already on each member's
// stream, so a caller that writes the inputs on another stream makes the
// member streams wait for it (or passes its own streams). The buffers stay
// untouched until the work is done. A failed copy fails the work with a
// tierflow::error naming "copy engine", the collective and CUDA's words.
class peer_copy_group {
 public:
  // devices[i]: member i's device. streams: none (one non-blocking stream
  // of its own per member) or one per member, which must outlive the group.
  explicit peer_copy_group(std::vector<int> devices, std::vector<CUstream_st*> streams = {},
                           std::shared_ptr<ce_telemetry> telemetry = {});
  ~peer_copy_group();
  peer_copy_group(const peer_copy_group&) = delete;
  peer_copy_group& operator=(const peer_copy_group&) = delete;

  int size() const noexcept;
  CUstream_st* stream(int member) const noexcept;
  // Whether cudaMemcpyBatchAsync is used.
  bool batched() const noexcept;

  // Each `out[i]` (sum(counts) elements, on member i's device) becomes every
  // `in[j]` (counts[j] elements) in member order. A member's own slot is
  // not copied when `in[i]` is it (in place).
  work_ptr all_gather(std::span<const void* const> in, std::span<void* const> out,
                      std::span<const std::size_t> counts, dtype t);
  // Every `buffers[i]` (`count` elements) becomes `buffers[root]`.
  work_ptr broadcast(std::span<void* const> buffers, std::size_t count, dtype t, int root);

 private:
  struct state;
  std::unique_ptr<state> state_;
};

}  // namespace tierflow::collectives
