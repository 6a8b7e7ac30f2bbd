// The CUDA side of the tiers: the device tier on a stream-ordered memory pool
// and the copy-engine movers. Compiled in every CUDA build (so it never rots),
// run where a device is present; without CUDA the factories say so.
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "detail/movers.hpp"
#include "tierflow/core/units.hpp"

#if TIERFLOW_WITH_CUDA
#include <cuda_runtime.h>

#include "tierflow/core/cuda_error.hpp"
#include "tierflow/core/cuda_handles.hpp"
#endif

namespace tierflow::tiers::detail {

#if TIERFLOW_WITH_CUDA
namespace {

class cuda_mem_pool {
 public:
  cuda_mem_pool(int device, std::uint64_t keep_bytes) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    TF_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props),
                  error_context{"cudaMemPoolCreate"}.in_tier("device"));
    // Keep freed memory in the pool up to the budget instead of returning it
    // to the driver at each synchronisation: allocation stays off the OS path.
    std::uint64_t threshold = keep_bytes;
    TF_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold),
                  error_context{"cudaMemPoolSetAttribute"}.in_tier("device"));
  }
  cuda_mem_pool(cuda_mem_pool&& o) noexcept : pool_(std::exchange(o.pool_, nullptr)) {}
  cuda_mem_pool& operator=(cuda_mem_pool&&) = delete;
  ~cuda_mem_pool() {
    if (pool_)
      if (const cudaError_t rc = cudaMemPoolDestroy(pool_); rc != cudaSuccess) warn_cuda("cudaMemPoolDestroy", rc);
  }
  cudaMemPool_t get() const noexcept { return pool_; }

 private:
  cudaMemPool_t pool_ = nullptr;
};

// ---- the device tier ----------------------------------------------------------------

class cuda_device_tier final : public tier {
 public:
  cuda_device_tier(std::uint64_t budget, int device)
      : device_(device), budget_("device", budget), stream_(device), pool_(device, budget) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) device_name_ = prop.name;
    (void)cudaGetLastError();
  }
  ~cuda_device_tier() override {
    cudaSetDevice(device_);
    if (const cudaError_t rc = cudaStreamSynchronize(stream_.get()); rc != cudaSuccess)
      warn_cuda("cudaStreamSynchronize", rc);
  }

  tier_kind kind() const noexcept override { return tier_kind::device; }
  std::string name() const override {
    return "device (cuda:" + std::to_string(device_) + " " + device_name_ + ", stream-ordered pool)";
  }
  memory_kind memory() const noexcept override { return memory_kind::device; }
  std::uint64_t budget() const noexcept override { return budget_.budget(); }
  std::uint64_t used() const override { return budget_.used(); }
  std::uint64_t high_water() const override { return budget_.high_water(); }
  bool can_allocate(std::uint64_t bytes) const override { return budget_.fits(bytes); }

  tier_allocation allocate(std::uint64_t bytes, std::string_view block) override {
    budget_.charge(bytes, block);
    try {
      TF_CUDA_CHECK(cudaSetDevice(device_), error_context{"cudaSetDevice"}.in_tier("device"));
      void* p = nullptr;
      const auto context = [&] {
        return error_context{"cudaMallocFromPoolAsync"}.range(0, bytes).in_tier("device").of_block(
            std::string(block));
      };
      TF_CUDA_CHECK(cudaMallocFromPoolAsync(&p, bytes, pool_.get(), stream_.get()), context());
      // Stream-ordered memory is usable in its stream's order only; the copy
      // engines use other streams, so wait here (control plane, not per copy).
      TF_CUDA_CHECK(cudaStreamSynchronize(stream_.get()), context());
      return tier_allocation{static_cast<std::byte*>(p), 0, bytes, 0};
    } catch (...) {
      budget_.discharge(bytes);
      throw;
    }
  }

  void deallocate(const tier_allocation& a) noexcept override {
    cudaSetDevice(device_);
    // The store frees a copy only after every transfer touching it completed
    // (its event was waited on), so freeing in this stream's order is safe.
    if (const cudaError_t rc = cudaFreeAsync(a.data, stream_.get()); rc != cudaSuccess)
      warn_cuda("cudaFreeAsync", rc);
    budget_.discharge(a.size);
  }

  std::map<std::string, std::string> details() const override {
    return {{"backend", "cuda"}, {"device", std::to_string(device_)}, {"name", device_name_}};
  }

  int device() const noexcept { return device_; }

 private:
  const int device_;
  std::string device_name_;
  tier_budget budget_;
  cuda_stream stream_;
  cuda_mem_pool pool_;
};

// ---- copy engines -------------------------------------------------------------------

// Host <-> device copies on a dedicated stream per direction (the H2D and D2H
// copy engines run concurrently); each move waits for its own event.
class cuda_copy_mover final : public mover {
 public:
  cuda_copy_mover(int device, bool to_device) : device_(device), to_device_(to_device), stream_(device) {}

  std::string engine() const override {
    return std::string("cuda copy engine (") + (to_device_ ? "H2D" : "D2H") + " stream)";
  }

  void move(const transfer& t) override {
    const auto context = [&] {
      return error_context{"cudaMemcpyAsync"}.range(0, t.bytes).in_tier("device").of_block(t.block_name);
    };
    TF_CUDA_CHECK(cudaSetDevice(device_), context());
    const cuda_event done = cuda_event::create();
    // From registered (pinned) host memory this is a DMA on the copy engine,
    // asynchronous to the host; no kernel is launched.
    TF_CUDA_CHECK(cudaMemcpyAsync(t.destination.data, t.source.data, t.bytes,
                                  to_device_ ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                                  stream_.get()),
                  context());
    TF_CUDA_CHECK(cudaEventRecord(done.get(), stream_.get()), context());
    // The event completes once every copy queued before it on this stream has.
    TF_CUDA_CHECK(cudaEventSynchronize(done.get()), context());
  }

 private:
  const int device_;
  const bool to_device_;
  cuda_stream stream_;
};

// The staged path's crossing for a real device: one stream per direction and
// one event per bounce buffer.
class cuda_copier {
 public:
  cuda_copier(int device, unsigned slots) : device_(device), h2d_(device), d2h_(device) {
    // After the streams: their construction made the device current.
    for (unsigned i = 0; i < slots; ++i) events_.push_back(cuda_event::create());
  }

  void to_device(std::byte* d, const std::byte* s, std::size_t n, unsigned slot) {
    copy(d, s, n, slot, cudaMemcpyHostToDevice, h2d_.get());
  }
  void to_host(std::byte* d, const std::byte* s, std::size_t n, unsigned slot) {
    copy(d, s, n, slot, cudaMemcpyDeviceToHost, d2h_.get());
  }
  void wait(unsigned slot) {
    // An event never recorded counts as complete.
    TF_CUDA_CHECK(cudaEventSynchronize(events_[slot].get()),
                  error_context{"cudaEventSynchronize"}.in_tier("device"));
  }
  std::string name() const { return "cuda copy engines"; }

 private:
  void copy(std::byte* d, const std::byte* s, std::size_t n, unsigned slot, cudaMemcpyKind kind,
            cudaStream_t stream) {
    TF_CUDA_CHECK(cudaSetDevice(device_), error_context{"cudaSetDevice"}.in_tier("device"));
    TF_CUDA_CHECK(cudaMemcpyAsync(d, s, n, kind, stream),
                  error_context{"cudaMemcpyAsync"}.range(0, n).in_tier("device"));
    TF_CUDA_CHECK(cudaEventRecord(events_[slot].get(), stream),
                  error_context{"cudaEventRecord"}.in_tier("device"));
  }

  int device_;
  cuda_stream h2d_;
  cuda_stream d2h_;
  std::vector<cuda_event> events_;
};

}  // namespace

std::unique_ptr<tier> make_cuda_device_tier(const device_tier_options& options) {
  if (!cuda_device_present())
    throw user_error("device tier: backend cuda needs a CUDA device, and none is usable here");
  return std::make_unique<cuda_device_tier>(aligned_size(options.budget), options.cuda_device);
}

int cuda_device_of(const tier& t) noexcept {
  if (const auto* c = dynamic_cast<const cuda_device_tier*>(&t)) return c->device();
  return -1;
}

std::unique_ptr<mover> make_cuda_copy_mover(int device, bool to_device) {
  return std::make_unique<cuda_copy_mover>(device, to_device);
}

std::unique_ptr<mover> make_staged_mover(tier& device, nvme_tier& nvme, bool to_nvme,
                                         const mover_options& options) {
  const unsigned engines = std::max(1u, options.engines);
  host_region_options bounce;
  bounce.bytes = std::uint64_t(engines) * 2 * options.staging_chunk;
  bounce.pre_touch = true;
  bounce.pin = pinning::automatic;  // cudaHostRegister with a device: DMA straight from it
  const int cuda = cuda_device_of(device);
  if (cuda >= 0) {
    bounce.cuda_device = cuda;
    return std::make_unique<staged_mover<cuda_copier>>(cuda_copier(cuda, engines * 2), nvme, to_nvme,
                                                       options, host_region::map(bounce));
  }
  return std::make_unique<staged_mover<memcpy_copier>>(memcpy_copier{}, nvme, to_nvme, options,
                                                       host_region::map(bounce));
}

#else  // no CUDA in this build

std::unique_ptr<tier> make_cuda_device_tier(const device_tier_options&) {
  throw user_error("device tier: backend cuda needs a CUDA build of tierflow (TIERFLOW_CUDA=ON)");
}

int cuda_device_of(const tier&) noexcept { return -1; }

std::unique_ptr<mover> make_cuda_copy_mover(int, bool) {
  throw user_error("cuda copy mover: this tierflow was built without CUDA");
}

std::unique_ptr<mover> make_staged_mover(tier&, nvme_tier& nvme, bool to_nvme,
                                         const mover_options& options) {
  const unsigned engines = std::max(1u, options.engines);
  host_region_options bounce;
  bounce.bytes = std::uint64_t(engines) * 2 * options.staging_chunk;
  bounce.pin = pinning::automatic;
  return std::make_unique<staged_mover<memcpy_copier>>(memcpy_copier{}, nvme, to_nvme, options,
                                                       host_region::map(bounce));
}

#endif

std::unique_ptr<tier> make_device_tier_impl(const device_tier_options& options) {
  if (options.budget == 0) throw user_error("device tier: the budget is zero");
  switch (options.backend) {
    case device_backend::cuda: return make_cuda_device_tier(options);
    case device_backend::stand_in: return make_device_stand_in(options);
    case device_backend::automatic:
      return cuda_device_present() ? make_cuda_device_tier(options) : make_device_stand_in(options);
  }
  return make_device_stand_in(options);
}

}  // namespace tierflow::tiers::detail

namespace tierflow::tiers {

std::unique_ptr<tier> make_device_tier(const device_tier_options& options) {
  return detail::make_device_tier_impl(options);
}

}  // namespace tierflow::tiers
