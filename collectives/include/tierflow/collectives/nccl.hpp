// The NCCL backend: collectives over device buffers, one rank per GPU,
// between processes or nodes. Built into tierflow_collectives_nccl when
// CUDA and NCCL are found (TIERFLOW_WITH_NCCL); without them the same
// declarations link and make_nccl_communicator() throws "built without NCCL".
// The header itself needs neither CUDA's headers nor NCCL's.
//
// The ranks meet through a `rendezvous_store`: rank 0 makes the group's
// unique id and sets it under `prefix`, the others get it. The communicator
// is non-blocking (ncclConfig_t::blocking = 0): its creation and each
// collective are polled with ncclCommGetAsyncError up to `timeout` and the
// communicator aborted (ncclCommAbort) past it — a peer that never comes or
// dies fails the call within that time instead of hanging it.
//
// Each collective is enqueued on the communicator's stream at once; its
// `work` is a CUDA event recorded there after it: done() asks the event,
// wait() blocks the host, polling the event and NCCL's asynchronous error
// up to the timeout (counted from the call that issued it), and
// stream_wait() makes another stream wait for the event on the GPU, the
// host going on at once. A watchdog thread (watchdog.hpp) polls every
// collective not yet seen finished the same way, whether anyone waits for
// it or not, so a collective that only streams wait for fails at its
// timeout too, instead of hanging them. A failure breaks the communicator
// (see communicator.hpp): it is aborted, and every collective pending or
// issued later fails with the first one's error, naming "nccl", the rank,
// the collective and NCCL's words (ncclGetErrorString, ncclGetLastError).
//
// Uneven shards: NCCL has no all-gather-v or reduce-scatter-v. An all_gather
// of equal counts is ncclAllGather; of uneven ones, one ncclBroadcast per
// rank (root r, counts[r] elements, into its slot of `out`) in one NCCL
// group. Likewise reduce_scatter: ncclReduceScatter, or one ncclReduce per
// rank (root r, its slice). Reductions of bf16 and fp16 are NCCL's own
// (it adds in fp32 within a step and rounds at each hop of its ring).
//
// The copy-engine mode (NCCL 2.28.3 and later): a communicator made with
// `cta_policy::zero` asks NCCL to run the collectives it can — all-gather,
// broadcast — on the copy engines instead of SMs, for buffers registered
// as symmetric windows (register_window). Where the runtime's NCCL is older
// the communicator is made with the default policy and the fallback is
// counted in `telemetry` (copy_engine.hpp).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "tierflow/collectives/communicator.hpp"
#include "tierflow/collectives/copy_engine.hpp"
#include "tierflow/collectives/rendezvous.hpp"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace tierflow::collectives {

// NCCL's ncclConfig_t::CTAPolicy: how many SMs (CTAs) its kernels may take.
enum class cta_policy : unsigned char {
  standard,    // NCCL_CTA_POLICY_DEFAULT: as many as it finds fastest
  efficiency,  // NCCL_CTA_POLICY_EFFICIENCY: the fewest that keep it near that speed
  zero,        // NCCL_CTA_POLICY_ZERO: none where it can (copy engines), NCCL >= 2.28.3
};

struct nccl_options {
  int rank = 0;
  int size = 1;
  // The CUDA device this rank runs on.
  int device = 0;
  // Where the ranks meet; may be null for a group of one.
  std::shared_ptr<rendezvous_store> store;
  // The key's prefix in it: one per communicator made in the same store.
  std::string prefix = "tierflow";
  // The limit of the rendezvous and init, and of each collective.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  cta_policy policy = cta_policy::standard;
  // The stream the collectives run on, or null: the communicator's own
  // (non-blocking, on `device`). A given stream must outlive the communicator.
  CUstream_st* stream = nullptr;
  // Where the copy-engine fallbacks are counted; may be null.
  std::shared_ptr<ce_telemetry> telemetry;
};

class nccl_communicator : public communicator {
 public:
  int device() const noexcept { return device_; }
  // The stream every collective is enqueued on: the caller orders its
  // producers and consumers of the buffers against it (events, or by
  // running them on it).
  CUstream_st* stream() const noexcept { return stream_; }
  // The policy NCCL was given: `zero` only where it was asked for and the
  // runtime's NCCL has it.
  cta_policy policy() const noexcept { return policy_; }

  // Makes `stream` (on this communicator's device) wait on the GPU for `w`,
  // a work of this communicator, without blocking the host: what is
  // enqueued on `stream` after this call runs after the collective, as
  // after torch.distributed's NCCL Work.wait(). Where `w` fails later (NCCL's
  // error, or its timeout, seen by the watchdog), the communicator breaks
  // and NCCL is aborted, which ends its kernels: `stream` then goes on
  // behind a collective that did not complete, and the host learns of it
  // from the next wait(), stream_wait() or collective — so whoever reads
  // results on the host (a gradient stepped on, a checkpoint) wait()s
  // first. Throws `w`'s error where it has already failed; user_error for a
  // work of another communicator.
  virtual void stream_wait(const work_ptr& w, CUstream_st* stream) = 0;

  // Registers `bytes` at `buffer` (device memory from nccl_memory, NCCL's
  // allocator: symmetric windows need its kind) as a symmetric window, for
  // NCCL's copy-engine collectives. Collective: every rank calls it, in the
  // same order, with the same size. Returns false (and counts
  // window_registration_failed) where NCCL refuses it: the collectives on
  // that buffer then run on SMs — unless the refusal left NCCL's
  // communicator in error, which breaks this one as a failed collective
  // would (naming register_window). Throws user_error for an unaligned
  // buffer. The window lives as long as the communicator.
  virtual bool register_window(void* buffer, std::size_t bytes) = 0;

 protected:
  nccl_communicator(int device, CUstream_st* stream, cta_policy policy)
      : device_(device), stream_(stream), policy_(policy) {}

 private:
  int device_;
  CUstream_st* stream_;
  cta_policy policy_;
};

// Joins the group of `options.size` ranks as `options.rank` (blocks until
// every rank has joined, or throws after `timeout`). Throws user_error for a
// bad rank, size, device, timeout or a missing store; tierflow::error when
// the rendezvous or NCCL's init fails, or when built without NCCL.
std::unique_ptr<nccl_communicator> make_nccl_communicator(const nccl_options& options);

// The runtime NCCL's version as NCCL_VERSION_CODE writes it (22809 for
// 2.28.9), 0 when built without NCCL.
int nccl_version() noexcept;

// What `comm` offers ce_policy: the runtime NCCL's version and whether it
// runs with cta_policy::zero; `window_registered` as register_window said
// for the buffer the collectives receive into.
inline ce_capabilities capabilities(const nccl_communicator& comm, bool window_registered) {
  return {.nccl_version = nccl_version(),
          .nccl_zero_cta = comm.policy() == cta_policy::zero,
          .window_registered = window_registered};
}

// Device memory from NCCL's allocator (ncclMemAlloc), which symmetric
// windows need; move-only, freed with ncclMemFree. On the current device.
class nccl_memory {
 public:
  nccl_memory() = default;
  // Throws tierflow::error when NCCL cannot allocate (or is not built in).
  static nccl_memory allocate(std::size_t bytes);
  nccl_memory(nccl_memory&& o) noexcept;
  nccl_memory& operator=(nccl_memory&& o) noexcept;
  ~nccl_memory();
  void* get() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }

 private:
  void reset() noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Measures the crossover on one GPU (see copy_engine.hpp): times an
// all-gather of one shard through a 1-rank NCCL communicator (SMs) and as a
// copy to self on a copy-engine stream (peer_copy_group), over `sweep`.
// Throws tierflow::error without a device or NCCL.
ce_crossover measure_ce_crossover(int device, const crossover_sweep& sweep = {});

}  // namespace tierflow::collectives
