// The CUDA side of the tiers: the device tier on a stream-ordered memory pool
// and the copy-engine movers. Compiled in every CUDA build (so it never rots),
// run where a device is present; without CUDA the factories say so.
#include <array>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
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

// ---- stream-ordered allocation, seen from the copy streams ------------------------

// One per device, shared by its device tiers and the movers that copy to and
// from it. A tier allocates and frees on `stream` (which carries nothing
// else) and records `allocated` after every allocation; every copy stream
// waits for `allocated` before it touches device memory. That is the
// ordering CUDA asks for memory from cudaMallocFromPoolAsync used on another
// stream, and it is a wait on the device: the tier never blocks the host
// (allocate() runs under the store's lock), and the copy's stream waits only
// for allocations, which complete as soon as they are reached.
//
// Why the most recent record is enough: allocation X happens, then its
// thread records `allocated`, then (after allocate() returned) the copy's
// thread calls cudaStreamWaitEvent. Whatever record is the most recent at
// that call was enqueued on `stream` after X, so it completes after X.
struct allocation_order {
  cuda_stream stream;
  cuda_event allocated;
  explicit allocation_order(int device) : stream(device), allocated(cuda_event::create()) {}
};

// The device's allocation_order, made by its first user and gone with its
// last (a tier or a mover).
std::shared_ptr<allocation_order> allocation_order_of(int device) {
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<allocation_order>> orders;
  const std::lock_guard lock(mutex);
  std::weak_ptr<allocation_order>& slot = orders[device];
  if (std::shared_ptr<allocation_order> alive = slot.lock()) return alive;
  auto made = std::make_shared<allocation_order>(device);
  slot = made;
  return made;
}

// Makes `copy` wait for every allocation so far on `device` (see allocation_order).
void order_after_allocations(const allocation_order& order, cudaStream_t copy, const error_context& context) {
  TF_CUDA_CHECK(cudaStreamWaitEvent(copy, order.allocated.get(), 0), context);
}

// ---- the device tier ----------------------------------------------------------------

class cuda_device_tier final : public tier {
 public:
  cuda_device_tier(std::uint64_t budget, int device)
      : device_(device), budget_("device", budget), order_(allocation_order_of(device)), pool_(device, budget) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) device_name_ = prop.name;
    (void)cudaGetLastError();
  }
  ~cuda_device_tier() override {
    // The frees enqueued on the allocation stream run before the pool goes.
    cudaSetDevice(device_);
    if (const cudaError_t rc = cudaStreamSynchronize(order_->stream.get()); rc != cudaSuccess)
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

  // Called under the store's lock: enqueues and records, never waits.
  tier_allocation allocate(std::uint64_t bytes, std::string_view block) override {
    budget_.charge(bytes, block);
    try {
      TF_CUDA_CHECK(cudaSetDevice(device_), error_context{"cudaSetDevice"}.in_tier("device"));
      void* p = nullptr;
      const auto context = [&](const char* call) {
        return error_context{call}.range(0, bytes).in_tier("device").of_block(std::string(block));
      };
      const cudaStream_t stream = order_->stream.get();
      TF_CUDA_CHECK(cudaMallocFromPoolAsync(&p, bytes, pool_.get(), stream), context("cudaMallocFromPoolAsync"));
      if (const cudaError_t rc = cudaEventRecord(order_->allocated.get(), stream); rc != cudaSuccess) {
        // Unusable without its ordering event: give it back, in order.
        (void)cudaFreeAsync(p, stream);
        TF_CUDA_CHECK(rc, context("cudaEventRecord"));
      }
      return tier_allocation{static_cast<std::byte*>(p), 0, bytes, 0};
    } catch (...) {
      budget_.discharge(bytes);
      throw;
    }
  }

  void deallocate(const tier_allocation& a) noexcept override {
    cudaSetDevice(device_);
    // The store frees a copy only after every transfer touching it completed
    // (its event was waited on), so freeing in the allocation stream's order
    // is safe; the pool hands the memory out again only after the free was
    // reached on that stream.
    if (const cudaError_t rc = cudaFreeAsync(a.data, order_->stream.get()); rc != cudaSuccess)
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
  std::shared_ptr<allocation_order> order_;
  cuda_mem_pool pool_;  // after order_: destroyed first, once the destructor drained the frees
};

// ---- copy engines -------------------------------------------------------------------

// Host <-> device copies, one direction. Each traffic class has its own
// stream: a demand fetch is never queued on the device behind the prefetches
// or write-backs the link's other engine threads already started, so the
// fair queue's order (demand first, one engine always free for it) holds on
// the device too. Within a class, copies keep their submission order. Each
// move waits for its own event.
class cuda_copy_mover final : public mover {
 public:
  cuda_copy_mover(int device, bool to_device)
      : device_(device), to_device_(to_device), order_(allocation_order_of(device)) {
    for (cuda_stream& s : streams_) s = cuda_stream(device);
  }

  std::string engine() const override {
    return std::string("cuda copy engine (") + (to_device_ ? "H2D" : "D2H") + " stream per traffic class)";
  }

  void move(const transfer& t) override {
    const auto context = [&](const char* call) {
      return error_context{call}.range(0, t.bytes).in_tier("device").of_block(t.block_name);
    };
    TF_CUDA_CHECK(cudaSetDevice(device_), context("cudaSetDevice"));
    const cudaStream_t stream = streams_[index_of(t.cls)].get();
    const pooled_event done(*this);
    order_after_allocations(*order_, stream, context("cudaStreamWaitEvent"));
    // From registered (pinned) host memory this is a DMA on the copy engine,
    // asynchronous to the host; no kernel is launched.
    TF_CUDA_CHECK(cudaMemcpyAsync(t.destination.data, t.source.data, t.bytes,
                                  to_device_ ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream),
                  context("cudaMemcpyAsync"));
    TF_CUDA_CHECK(cudaEventRecord(done.get(), stream), context("cudaEventRecord"));
    // The event completes once every copy queued before it on this class's
    // stream has: this move and earlier ones of its class, never another class's.
    TF_CUDA_CHECK(cudaEventSynchronize(done.get()), context("cudaEventSynchronize"));
  }

 private:
  // An event from the mover's free list for one move, returned after it
  // (whether the move succeeded or threw): no create/destroy per copy.
  class pooled_event {
   public:
    explicit pooled_event(cuda_copy_mover& owner) : owner_(owner) {
      {
        const std::lock_guard lock(owner_.events_mutex_);
        if (!owner_.free_events_.empty()) {
          event_ = std::move(owner_.free_events_.back());
          owner_.free_events_.pop_back();
        }
      }
      if (event_.get() == nullptr) event_ = cuda_event::create();  // the device is current (move() set it)
    }
    ~pooled_event() {
      // A failed move's event may still be recorded on a stream that
      // continues; reusing it is fine: a record replaces the last one.
      const std::lock_guard lock(owner_.events_mutex_);
      owner_.free_events_.push_back(std::move(event_));
    }
    pooled_event(const pooled_event&) = delete;
    pooled_event& operator=(const pooled_event&) = delete;
    cudaEvent_t get() const noexcept { return event_.get(); }

   private:
    cuda_copy_mover& owner_;
    cuda_event event_;
  };

  const int device_;
  const bool to_device_;
  std::shared_ptr<allocation_order> order_;
  std::array<cuda_stream, traffic_class_count> streams_;
  std::mutex events_mutex_;
  std::vector<cuda_event> free_events_;  // at most one per engine thread
};

// The staged path's crossing for a real device. One stream per direction for
// each bounce-buffer pair, that is for each of the mover's engine threads:
// a transfer's chunks never queue on the device behind another transfer's,
// whatever their classes (the link's fair queue has already chosen which
// transfers run); one event per bounce buffer.
class cuda_copier {
 public:
  cuda_copier(int device, unsigned slots) : device_(device), order_(allocation_order_of(device)) {
    const unsigned pairs = (slots + 1) / 2;
    for (unsigned i = 0; i < pairs; ++i) {
      h2d_.emplace_back(device);
      d2h_.emplace_back(device);
    }
    // After the streams: their construction made the device current.
    for (unsigned i = 0; i < slots; ++i) events_.push_back(cuda_event::create());
  }

  void to_device(std::byte* d, const std::byte* s, std::size_t n, unsigned slot) {
    copy(d, s, n, slot, cudaMemcpyHostToDevice, h2d_[slot / 2].get());
  }
  void to_host(std::byte* d, const std::byte* s, std::size_t n, unsigned slot) {
    copy(d, s, n, slot, cudaMemcpyDeviceToHost, d2h_[slot / 2].get());
  }
  void wait(unsigned slot) {
    // An event never recorded counts as complete.
    TF_CUDA_CHECK(cudaEventSynchronize(events_[slot].get()),
                  error_context{"cudaEventSynchronize"}.in_tier("device"));
  }
  std::string name() const { return "cuda copy engines, a stream per engine and direction"; }

 private:
  void copy(std::byte* d, const std::byte* s, std::size_t n, unsigned slot, cudaMemcpyKind kind,
            cudaStream_t stream) {
    TF_CUDA_CHECK(cudaSetDevice(device_), error_context{"cudaSetDevice"}.in_tier("device"));
    order_after_allocations(*order_, stream, error_context{"cudaStreamWaitEvent"}.in_tier("device"));
    TF_CUDA_CHECK(cudaMemcpyAsync(d, s, n, kind, stream),
                  error_context{"cudaMemcpyAsync"}.range(0, n).in_tier("device"));
    TF_CUDA_CHECK(cudaEventRecord(events_[slot].get(), stream),
                  error_context{"cudaEventRecord"}.in_tier("device"));
  }

  int device_;
  std::shared_ptr<allocation_order> order_;
  std::vector<cuda_stream> h2d_;  // per bounce pair (slot / 2)
  std::vector<cuda_stream> d2h_;
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
