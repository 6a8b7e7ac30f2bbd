// Peer copies within a process (copy_engine.hpp): each member's incoming
// copies on its own copy-engine stream, as one cudaMemcpyBatchAsync where
// the runtime has it. Compiled in every CUDA build, run where a device is.

#include <cuda_runtime.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "tierflow/collectives/copy_engine.hpp"
#include "tierflow/core/cuda_error.hpp"
#include "tierflow/core/cuda_handles.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::collectives {

namespace {

std::string cuda_text(cudaError_t rc) { return std::string(cudaGetErrorName(rc)) + ": " + cudaGetErrorString(rc); }

// What a copy-engine failure says: "copy engine (member 1, cuda:0):
// all_gather failed: cudaMemcpyBatchAsync: cudaErrorInvalidValue: ...".
error copy_failure(std::string_view what, int member, int device, const std::string& cause) {
  return error(EIO, error_context{std::string(what)}.in_tier("device"),
               "copy engine (member " + std::to_string(member) + ", cuda:" + std::to_string(device) +
                   "): " + std::string(what) + " failed: " + cause);
}

// The copies of one collective: an event per member stream that got any,
// recorded after them.
class copy_work final : public work {
 public:
  struct mark {
    int member, device;
    cuda_event event;
  };
  copy_work(std::string what, std::vector<mark> marks) : what_(std::move(what)), marks_(std::move(marks)) {}

  bool done() const override {
    for (const mark& m : marks_) {
      const cudaError_t rc = cudaEventQuery(m.event.get());
      if (rc == cudaErrorNotReady) {
        (void)cudaGetLastError();  // (not an error: leaves nothing sticky behind)
        return false;
      }
      if (rc != cudaSuccess) {
        (void)cudaGetLastError();
        return true;  // failed: wait() says how
      }
    }
    return true;
  }

  void wait() override {
    for (const mark& m : marks_) {
      // An event waits on its own device's work, whichever device is current.
      if (const cudaError_t rc = cudaEventSynchronize(m.event.get()); rc != cudaSuccess) {
        (void)cudaGetLastError();
        throw copy_failure(what_, m.member, m.device, "cudaEventSynchronize: " + cuda_text(rc));
      }
    }
  }

 private:
  std::string what_;
  std::vector<mark> marks_;
};

class done_work final : public work {
 public:
  bool done() const override { return true; }
  void wait() override {}
};

// One copy of a member's batch.
struct copy {
  void* dst;
  const void* src;
  std::size_t bytes;
  int src_device;
};

}  // namespace

struct peer_copy_group::state {
  std::vector<int> devices;
  std::vector<cuda_stream> own;  // empty when the caller gave the streams
  std::vector<cudaStream_t> streams;
  std::shared_ptr<ce_telemetry> telemetry;
  bool batched = false;

  // Enqueues `copies` into member `member`'s buffer on its stream, and
  // records the member's event after them.
  copy_work::mark enqueue(std::string_view what, int member, const std::vector<copy>& copies) {
    const int device = devices[member];
    const cuda_device_scope on(device);
    const cudaStream_t stream = streams[member];
    bool one_by_one = !batched;
#if CUDART_VERSION >= 12080
    if (batched) {
      std::vector<void*> dsts;
      std::vector<const void*> srcs;
      std::vector<std::size_t> sizes;
      for (const copy& c : copies) {
        dsts.push_back(c.dst);
        srcs.push_back(c.src);
        sizes.push_back(c.bytes);
      }
      // One attribute for the whole batch: sources read in stream order
      // (after the work before on this stream, which may have written them),
      // and the hint that the copies should overlap compute (the copy
      // engines, not SMs). The location hints only matter for managed or
      // pageable memory; these buffers are device memory.
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.srcLocHint.type = cudaMemLocationTypeDevice;
      attr.srcLocHint.id = copies.front().src_device;
      attr.dstLocHint.type = cudaMemLocationTypeDevice;
      attr.dstLocHint.id = device;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      std::size_t first = 0;
#if CUDART_VERSION >= 13000
      // CUDA 13 took failIdx out and made the pointer arrays const.
      const cudaError_t rc =
          cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), copies.size(), &attr, &first, 1, stream);
      const std::string at;
#else
      std::size_t failed = SIZE_MAX;
      const cudaError_t rc =
          cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(), copies.size(), &attr,
                               &first, 1, &failed, stream);
      const std::string at = failed == SIZE_MAX ? "" : " (copy " + std::to_string(failed) + ")";
#endif
      if (rc == cudaErrorNotSupported || rc == cudaErrorCallRequiresNewerDriver) {
        // A driver without batches: from now on one copy per call.
        (void)cudaGetLastError();
        batched = false;
        one_by_one = true;
      } else if (rc != cudaSuccess) {
        (void)cudaGetLastError();
        throw copy_failure(what, member, device, "cudaMemcpyBatchAsync" + at + ": " + cuda_text(rc));
      }
    }
#endif
    if (one_by_one) {
      if (telemetry) telemetry->batch_copy_unsupported.fetch_add(1, std::memory_order_relaxed);
      for (const copy& c : copies) {
        // A peer copy goes over NVLink or PCIe directly where peer access is
        // on (the constructor turned it on), staged through the host else.
        if (const cudaError_t rc = cudaMemcpyPeerAsync(c.dst, device, c.src, c.src_device, c.bytes, stream);
            rc != cudaSuccess) {
          (void)cudaGetLastError();
          throw copy_failure(what, member, device, "cudaMemcpyPeerAsync: " + cuda_text(rc));
        }
      }
    }
    copy_work::mark m{member, device, cuda_event::create()};
    if (const cudaError_t rc = cudaEventRecord(m.event.get(), stream); rc != cudaSuccess) {
      (void)cudaGetLastError();
      throw copy_failure(what, member, device, "cudaEventRecord: " + cuda_text(rc));
    }
    return m;
  }
};

peer_copy_group::peer_copy_group(std::vector<int> devices, std::vector<CUstream_st*> streams,
                                 std::shared_ptr<ce_telemetry> telemetry)
    : state_(std::make_unique<state>()) {
  if (devices.empty()) throw user_error("peer_copy_group: no devices");
  if (!streams.empty() && streams.size() != devices.size())
    throw user_error("peer_copy_group: " + std::to_string(streams.size()) + " streams for " +
                     std::to_string(devices.size()) + " members");
  int count = 0;
  TF_CUDA_CHECK(cudaGetDeviceCount(&count), error_context{"cudaGetDeviceCount"}.in_tier("device"));
  for (const int d : devices)
    if (d < 0 || d >= count)
      throw user_error("peer_copy_group: device " + std::to_string(d) + " is not one of the " + std::to_string(count) +
                       " here");
  state& s = *state_;
  s.devices = std::move(devices);
  s.telemetry = std::move(telemetry);
  if (streams.empty()) {
    for (const int d : s.devices) {
      const cuda_device_scope on(d);  // (cuda_stream makes its device current)
      s.own.emplace_back(d);
      s.streams.push_back(s.own.back().get());
    }
  } else {
    s.streams.assign(streams.begin(), streams.end());
  }
  // Peer access both ways between every two distinct devices that can: the
  // copies then go over the link directly instead of through host memory.
  for (const int a : s.devices) {
    for (const int b : s.devices) {
      if (a == b) continue;
      int can = 0;
      TF_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, a, b), error_context{"cudaDeviceCanAccessPeer"}.in_tier("device"));
      if (!can) continue;
      const cuda_device_scope on(a);
      const cudaError_t rc = cudaDeviceEnablePeerAccess(b, 0);
      if (rc == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else {
        TF_CUDA_CHECK(rc, error_context{"cudaDeviceEnablePeerAccess"}.in_tier("device"));
      }
    }
  }
  // Batches where both the runtime this was built with and the driver have
  // them (12.8); the runtime is linked statically, so its version is the
  // one compiled against.
  int driver = 0;
  TF_CUDA_CHECK(cudaDriverGetVersion(&driver), error_context{"cudaDriverGetVersion"}.in_tier("device"));
  s.batched = CUDART_VERSION >= 12080 && driver >= 12080;
}

peer_copy_group::~peer_copy_group() = default;

int peer_copy_group::size() const noexcept { return static_cast<int>(state_->devices.size()); }
CUstream_st* peer_copy_group::stream(int member) const noexcept { return state_->streams.at(member); }
bool peer_copy_group::batched() const noexcept { return state_->batched; }

work_ptr peer_copy_group::all_gather(std::span<const void* const> in, std::span<void* const> out,
                                     std::span<const std::size_t> counts, dtype t) {
  state& s = *state_;
  const std::size_t n = s.devices.size();
  if (in.size() != n || out.size() != n || counts.size() != n)
    throw user_error("all_gather: " + std::to_string(in.size()) + " inputs, " + std::to_string(out.size()) +
                     " outputs and " + std::to_string(counts.size()) + " counts for " + std::to_string(n) +
                     " members");
  const std::size_t element = size_of(t);
  std::vector<std::size_t> offsets(n, 0);
  std::exclusive_scan(counts.begin(), counts.end(), offsets.begin(), std::size_t{0});
  std::vector<copy_work::mark> marks;
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<copy> copies;
    for (std::size_t j = 0; j < n; ++j) {
      if (counts[j] == 0) continue;
      void* slot = static_cast<std::byte*>(out[i]) + offsets[j] * element;
      if (slot == in[j]) continue;  // in place: member i's own shard already in its slot
      copies.push_back(copy{slot, in[j], counts[j] * element, s.devices[j]});
    }
    if (!copies.empty()) marks.push_back(s.enqueue("all_gather", static_cast<int>(i), copies));
  }
  if (marks.empty()) return std::make_shared<done_work>();
  return std::make_shared<copy_work>("all_gather", std::move(marks));
}

work_ptr peer_copy_group::broadcast(std::span<void* const> buffers, std::size_t count, dtype t, int root) {
  state& s = *state_;
  const std::size_t n = s.devices.size();
  if (buffers.size() != n)
    throw user_error("broadcast: " + std::to_string(buffers.size()) + " buffers for " + std::to_string(n) +
                     " members");
  if (root < 0 || static_cast<std::size_t>(root) >= n)
    throw user_error("broadcast: root " + std::to_string(root) + " is not a member of " + std::to_string(n));
  std::vector<copy_work::mark> marks;
  if (count != 0) {
    for (std::size_t i = 0; i < n; ++i) {
      if (static_cast<int>(i) == root || buffers[i] == buffers[root]) continue;
      marks.push_back(s.enqueue("broadcast", static_cast<int>(i),
                                {copy{buffers[i], buffers[root], count * size_of(t), s.devices[root]}}));
    }
  }
  if (marks.empty()) return std::make_shared<done_work>();
  return std::make_shared<copy_work>("broadcast", std::move(marks));
}

ce_topology probe_ce_topology(std::span<const int> devices) {
  if (devices.empty()) throw user_error("probe_ce_topology: no devices");
  int count = 0;
  TF_CUDA_CHECK(cudaGetDeviceCount(&count), error_context{"cudaGetDeviceCount"}.in_tier("device"));
  for (const int d : devices)
    if (d < 0 || d >= count)
      throw user_error("probe_ce_topology: device " + std::to_string(d) + " is not one of the " +
                       std::to_string(count) + " here");
  ce_topology topology;
  topology.ranks = static_cast<int>(devices.size());
  topology.one_node = true;
  topology.one_process = true;
  topology.links = link_kind::self;
  for (const int a : devices) {
    for (const int b : devices) {
      if (a == b) continue;
      if (topology.links == link_kind::self) topology.links = link_kind::nvlink;
      // NVLink without NVML: peer access with native atomics, which PCIe
      // peers do not report.
      int access = 0, atomics = 0;
      TF_CUDA_CHECK(cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported, a, b),
                    error_context{"cudaDeviceGetP2PAttribute"}.in_tier("device"));
      TF_CUDA_CHECK(cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, a, b),
                    error_context{"cudaDeviceGetP2PAttribute"}.in_tier("device"));
      if (!access || !atomics) topology.links = link_kind::pcie;
    }
  }
  return topology;
}

}  // namespace tierflow::collectives
