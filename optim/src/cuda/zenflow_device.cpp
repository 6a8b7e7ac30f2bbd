// cuda_zenflow_device: ZenFlow's device side over the trainer's tensors in
// GPU memory. The host logic of it; the kernels are in zenflow_kernels.cu.
//
// Per weight the device holds:
//   packed        the owned columns' fp32 master, exp_avg and exp_avg_sq,
//                 slot after slot in ascending column order (three planes of
//                 slots·rows floats), then the slots' column indices (uint32)
//   staging       (2-D weights) a whole-weight buffer in compute_type that
//                 stage_upload() fills from the CPU-step thread and
//                 apply_staged() copies from into the compute copy
//   staged_columns the column list of the last upload, for apply_staged()'s
//                 one-kernel copy
//   applied       an event after apply_staged()'s copy: the next upload into
//                 `staging` waits for it
//
// The gradients come down on a D2H stream of the object's own, into
// download_slots pinned slots (detail::download_ring keeps which weight is
// in which): gradients_ready() records an event on the trainer's stream,
// makes the D2H stream and the score stream wait for it, and starts the
// planned weights' downloads; each download_gradient() waits for its slot's
// event alone, widens it on the host threads and frees the slot for the next
// weight's download. Nothing on those streams waits for work the trainer
// enqueued after the gradients.
//
// Memory: what lives as long as the object is allocated with cudaMalloc at
// construction. The packed state is reallocated at every hand-over whose
// selection changes size, with cudaMallocAsync on the trainer's stream where
// the device has memory pools: stream-ordered allocation does not
// synchronise the device (cudaMalloc/cudaFree may), and the pool reuses the
// memory of the hand-over before. Without pools it falls back to cudaMalloc.
#include "tierflow/optim/zenflow_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "cuda/gradient_staging.hpp"
#include "tierflow/optim/gradients.hpp"
#include "cuda/zenflow_kernels.hpp"
#include "kernels.hpp"
#include "tierflow/core/affinity.hpp"
#include "tierflow/core/assert.hpp"
#include "tierflow/core/cuda_error.hpp"
#include "tierflow/core/cuda_handles.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::optim {
namespace {

error_context cuda_context(const char* operation) {
  return error_context{std::string("zenflow ") + operation}.in_tier("device");
}

// ---- layouts ------------------------------------------------------------------------

constexpr std::size_t align_up(std::size_t n, std::size_t to = 16) { return (n + to - 1) / to * to; }

bool known(dtype t) { return t == dtype::fp32 || t == dtype::bf16 || t == dtype::fp16; }

// Gradient slots in pinned memory: the host reads one while the next weight's
// comes down.
constexpr unsigned download_slots = 2;

// Throws user_error unless `p` is device memory of `device` (or managed)
// aligned to `element` bytes; `what` names the tensor for the message.
void check_device_pointer(const void* p, std::size_t element, int device, const std::string& what) {
  if (p == nullptr) throw user_error(what + ": a null pointer");
  if (reinterpret_cast<std::uintptr_t>(p) % element != 0) throw user_error(what + ": a pointer not aligned to its element size");
  cudaPointerAttributes attributes{};
  TF_CUDA_CHECK(cudaPointerGetAttributes(&attributes, p), error_context{"zenflow cudaPointerGetAttributes"}.in_tier("device").of_block(what));
  const bool device_memory_here = attributes.type == cudaMemoryTypeManaged ||
                                  (attributes.type == cudaMemoryTypeDevice && attributes.device == device);
  if (!device_memory_here) throw user_error(what + ": the pointer is not memory of CUDA device " + std::to_string(device));
}

// The packed state of `slots` owned columns: three planes, then the columns.
struct packed_layout {
  std::size_t plane = 0;  // floats per plane: slots · rows
  std::size_t columns_offset = 0;
  std::size_t bytes = 0;
  packed_layout(std::size_t slots, std::uint64_t rows)
      : plane(slots * rows),
        columns_offset(align_up(3 * plane * sizeof(float))),
        bytes(slots == 0 ? 0 : columns_offset + slots * sizeof(std::uint32_t)) {}
};

}  // namespace

// ---- the device -------------------------------------------------------------------

struct cuda_zenflow_device::impl {
  // Destroyed last (declared first): gives the thread its device back after
  // every handle below was released on ours.
  struct restore_device {
    int previous = -1;
    ~restore_device() {
      if (previous < 0) return;
      if (const cudaError_t rc = cudaSetDevice(previous); rc != cudaSuccess) warn_cuda("cudaSetDevice", rc);
    }
  } restore;

  struct weight_state {
    std::vector<std::uint32_t> columns;            // owned, ascending: the slots' columns
    cuda_device_memory packed;                     // packed_layout(columns.size(), rows)
    cuda_device_memory staging;                    // 2-D: elements in compute_type
    cuda_device_memory staged_columns;             // 2-D: uint32[cols]
    std::vector<zenflow::column_run> staged_runs;  // of the last stage_upload()
    std::uint64_t staged_count = 0;                // columns in staged_columns
    cuda_event applied;                            // 2-D: after apply_staged()'s copy
  };

  std::vector<zenflow::weight_shape> weights;
  std::vector<cuda_zenflow_weight> tensors;
  cuda_zenflow_options options;
  cudaStream_t stream = nullptr;  // the trainer's
  int sm_count = 1;
  bool pools = false;             // cudaMallocAsync is available
  std::int64_t simd_target = 0;   // for the host conversions
  std::size_t compute_size = 4;   // bytes per compute_type element
  // Bytes copied over the link each way (stage_upload() adds from its thread).
  std::atomic<std::uint64_t> bytes_down{0}, bytes_up{0};

  // Destroyed after every buffer (declared first): the last stage_upload()
  // waited for it, and the destructor waits again.
  cuda_stream upload_stream;
  cuda_pinned_buffer upload_pinned;    // stage_upload(): compute_type data, then the column list
  std::size_t upload_columns_offset = 0;
  cuda_pinned_buffer transfer;         // the trainer thread's other transfers, grown on demand
  cuda_device_memory importance;       // float[max cols]
  std::vector<weight_state> state;

  // ---- the gradients' way down ----
  // This step's gradients: gradients_ready()'s, else the constructor's.
  std::vector<const void*> gradients;
  bool per_step = false;                 // gradients_ready() was called: its event orders the reads
  bool ready_unused = false;             // gradients_ready() ran since update_owned()'s last step
  std::int64_t updated_step = 0;         // the step update_owned() ran for last
  cuda_event gradients_done;             // on the trainer's stream, after the backward
  cuda_stream download_stream;           // D2H: the gradients
  cuda_stream score_stream;              // column_importance()'s kernel and copy
  std::vector<cuda_event> slot_done;     // per slot: after its download
  cuda_pinned_buffer download_pinned;    // download_slots slots of slot_bytes, grad_type
  std::size_t slot_bytes = 0;
  detail::download_ring ring{download_slots};
  std::vector<float> download_fp32;      // download_gradient() of bf16/fp16 gradients
  std::unique_ptr<executor> host_threads;  // widens and adds the downloads

  bool live = false;  // the device was found: the handles below need it current to be released

  impl() = default;
  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;
  // Nothing may still read or write what the members free: waits for every
  // stream first (the upload stream is idle unless a stage_upload() threw),
  // with the device current on this thread. Never throws.
  ~impl() {
    if (!live) return;
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != options.device) {
      if (const cudaError_t rc = cudaSetDevice(options.device); rc != cudaSuccess) warn_cuda("cudaSetDevice", rc);
      restore.previous = current;
    }
    for (const cuda_stream* own : {&upload_stream, &download_stream, &score_stream})
      if (own->get() != nullptr)
        if (const cudaError_t rc = cudaStreamSynchronize(own->get()); rc != cudaSuccess)
          warn_cuda("cudaStreamSynchronize", rc);
    if (const cudaError_t rc = cudaStreamSynchronize(stream); rc != cudaSuccess) warn_cuda("cudaStreamSynchronize", rc);
  }

  error_context context(const char* operation, std::size_t w) const {
    return cuda_context(operation).of_block(weights[w].name);
  }

  packed_layout layout(std::size_t w) const { return packed_layout(state[w].columns.size(), weights[w].rows); }

  detail::state_planes planes(std::size_t w) const {
    const packed_layout l = layout(w);
    auto* base = static_cast<float*>(state[w].packed.get());
    if (base == nullptr) return {};
    return {base, base + l.plane, base + 2 * l.plane};
  }

  void check_launch(cudaError_t rc, const char* kernel, std::size_t w) const {
    TF_CUDA_CHECK(rc, context(kernel, w));
  }

  // A weight without a gradient pointer needs gradients_ready() first.
  void require_gradient(std::size_t w) const {
    if (gradients[w] == nullptr)
      throw user_error("zenflow cuda device: weight \"" + weights[w].name +
                       "\" has no gradient: call gradients_ready() with this step's");
  }

  void synchronize(std::size_t w) const { TF_CUDA_CHECK(cudaStreamSynchronize(stream), context("cudaStreamSynchronize", w)); }

  std::byte* slot_data(unsigned slot) const { return download_pinned.data() + slot * slot_bytes; }

  // The weights whose gradient the engine brings down this step, in the
  // order it asks: the matrices with a column the host owns.
  std::vector<std::size_t> planned_downloads() const {
    std::vector<std::size_t> order;
    for (std::size_t w = 0; w < weights.size(); ++w)
      if (weights[w].matrix() && state[w].columns.size() < weights[w].cols) order.push_back(w);
    return order;
  }

  // Records gradients_done after the work on the trainer's stream so far (the
  // backward) and makes the D2H and score streams wait for it: an event
  // wait, so they do not wait for what the trainer enqueues later.
  void mark_gradients() {
    TF_CUDA_CHECK(cudaEventRecord(gradients_done.get(), stream), cuda_context("cudaEventRecord gradients"));
    TF_CUDA_CHECK(cudaStreamWaitEvent(download_stream.get(), gradients_done.get(), 0),
                  cuda_context("cudaStreamWaitEvent gradients"));
    TF_CUDA_CHECK(cudaStreamWaitEvent(score_stream.get(), gradients_done.get(), 0),
                  cuda_context("cudaStreamWaitEvent gradients"));
  }

  void wait_downloads(const char* why) const {
    TF_CUDA_CHECK(cudaStreamSynchronize(download_stream.get()), cuda_context(why));
  }

  // Starts a download into every free slot, in the ring's plan.
  void issue_downloads() {
    try {
      while (const std::optional<detail::download_ring::issued> next = ring.issue()) {
        const std::size_t w = next->weight;
        const std::size_t bytes = weights[w].elements() * size_of(options.grad_type);
        TF_CUDA_CHECK(cudaMemcpyAsync(slot_data(next->slot), gradients[w], bytes, cudaMemcpyDeviceToHost,
                                      download_stream.get()),
                      context("cudaMemcpyAsync gradient download", w));
        TF_CUDA_CHECK(cudaEventRecord(slot_done[next->slot].get(), download_stream.get()),
                      context("cudaEventRecord gradient download", w));
        bytes_down += bytes;
      }
    } catch (...) {
      // A slot issued without its copy must not be read as if it arrived:
      // the plan is dropped, so the next request is a miss that downloads
      // anew once the stream has drained.
      ring.begin({});
      throw;
    }
  }

  // Frees the slot download_gradient() returned last (fp32 gradients are
  // read in place), which starts the next download.
  void release_held() {
    if (const std::optional<unsigned> held = ring.held()) {
      ring.release(*held);
      issue_downloads();
    }
  }

  // Waits for weight w's gradient in its slot and returns the slot, taken.
  unsigned fetch(std::size_t w) {
    release_held();
    if (!per_step) {
      // No gradients_ready(): the gradient is whatever the trainer's stream
      // holds once its work so far has run; this weight alone comes down.
      mark_gradients();
      if (ring.begin({w})) wait_downloads("cudaStreamSynchronize gradient download");
      issue_downloads();
    }
    std::optional<unsigned> slot = ring.take(w);
    if (!slot) {
      // Asked out of the plan: the copies in flight finish into their slots,
      // then the plan restarts with this weight.
      wait_downloads("cudaStreamSynchronize gradient download");
      ring.replan_from(w);
      issue_downloads();
      slot = ring.take(w);
      TF_ASSERT(slot.has_value(), "download ring: a replanned weight got no slot");
    }
    TF_CUDA_CHECK(cudaEventSynchronize(slot_done[*slot].get()), context("cudaEventSynchronize gradient download", w));
    return *slot;
  }
};

cuda_zenflow_device::cuda_zenflow_device(const std::vector<zenflow::weight_shape>& weights,
                                         std::vector<cuda_zenflow_weight> tensors,
                                         const cuda_zenflow_options& options)
    : impl_(std::make_unique<impl>()) {
  impl& d = *impl_;
  // ---- the arguments, before any CUDA call --------------------------------------
  if (weights.empty()) throw user_error("zenflow cuda device: no weights");
  if (tensors.size() != weights.size())
    throw user_error("zenflow cuda device: " + std::to_string(tensors.size()) + " tensors for " +
                     std::to_string(weights.size()) + " weights");
  if (!known(options.compute_type) || !known(options.grad_type))
    throw user_error("zenflow cuda device: compute_type and grad_type must be fp32, bf16 or fp16");
  if (options.adam.amsgrad == amsgrad::on)
    throw user_error("zenflow cuda device: amsgrad is not supported on the device side");
  (void)adam_optimizer(options.adam);  // validates the hyper-parameters (user_error)
  for (std::size_t w = 0; w < weights.size(); ++w) {
    const zenflow::weight_shape& s = weights[w];
    const std::string name = "zenflow cuda device: weight \"" + s.name + "\"";
    if (s.rows == 0 || s.cols == 0) throw user_error(name + " has an empty shape");
    if (s.cols > UINT32_MAX) throw user_error(name + " has too many columns");
    // A null gradient: every step names its gradients (gradients_ready()).
    if (tensors[w].parameters == nullptr) throw user_error(name + ": a null parameter pointer");
    if (reinterpret_cast<std::uintptr_t>(tensors[w].parameters) % size_of(options.compute_type) != 0 ||
        reinterpret_cast<std::uintptr_t>(tensors[w].gradient) % size_of(options.grad_type) != 0)
      throw user_error(name + ": a pointer not aligned to its element size");
  }
  {
    // The widening threads, one per CPU (executor refuses a CPU this process
    // may not run on, with user_error).
    std::vector<int> cpus = options.host_cpus.empty() ? current_affinity() : options.host_cpus;
    const int threads = static_cast<int>(cpus.size());
    d.host_threads = std::make_unique<executor>(threads, "auto", std::move(cpus));
  }
  d.weights = weights;
  d.tensors = std::move(tensors);
  d.options = options;
  d.stream = reinterpret_cast<cudaStream_t>(options.stream);
  d.compute_size = size_of(options.compute_type);
  // The best target that rounds subnormals as the GPU's __float2bfloat16_rn
  // does ("avx512-bf16" flushes them), so host- and device-made copies agree.
  for (const auto& [bits, name] : detail::available_targets()) {
    if ((bits & detail::native_bf16_bit) == 0) {
      d.simd_target = bits;
      break;
    }
  }

  // ---- the device -----------------------------------------------------------------
  int count = 0;
  // No driver or no GPU: an environment failure, with CUDA's own words for it.
  TF_CUDA_CHECK(cudaGetDeviceCount(&count), error_context{"zenflow cuda device needs a GPU: cudaGetDeviceCount"});
  if (options.device < 0 || options.device >= count)
    throw user_error("zenflow cuda device: device " + std::to_string(options.device) + " does not exist (" +
                     std::to_string(count) + " visible)");
  const cuda_device_scope scope(options.device);
  d.live = true;
  TF_CUDA_CHECK(cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, options.device),
                cuda_context("cudaDeviceGetAttribute"));
  int pools = 0;
  TF_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, options.device),
                cuda_context("cudaDeviceGetAttribute"));
  d.pools = pools != 0;

  // The tensors must be memory this device's kernels can address.
  for (std::size_t w = 0; w < d.weights.size(); ++w) {
    const std::string name = "zenflow cuda device: weight \"" + d.weights[w].name + "\"";
    check_device_pointer(d.tensors[w].parameters, d.compute_size, options.device, name + "'s parameters");
    if (d.tensors[w].gradient != nullptr)
      check_device_pointer(d.tensors[w].gradient, size_of(options.grad_type), options.device, name + "'s gradient");
    d.gradients.push_back(d.tensors[w].gradient);
  }

  d.upload_stream = cuda_stream(options.device);
  d.download_stream = cuda_stream(options.device);
  d.score_stream = cuda_stream(options.device);
  d.gradients_done = cuda_event::create();
  for (unsigned i = 0; i < download_slots; ++i) d.slot_done.push_back(cuda_event::create());
  std::uint64_t max_elements = 0, max_matrix_elements = 0, max_cols = 0;
  d.state.resize(d.weights.size());
  for (std::size_t w = 0; w < d.weights.size(); ++w) {
    const zenflow::weight_shape& s = d.weights[w];
    impl::weight_state& ws = d.state[w];
    max_elements = std::max(max_elements, s.elements());
    max_cols = std::max(max_cols, s.cols);
    if (s.matrix()) {
      max_matrix_elements = std::max(max_matrix_elements, s.elements());
      ws.staging = cuda_device_memory::allocate(s.elements() * d.compute_size, d.context("cudaMalloc staging", w));
      ws.staged_columns =
          cuda_device_memory::allocate(s.cols * sizeof(std::uint32_t), d.context("cudaMalloc staged columns", w));
      ws.applied = cuda_event::create();
    } else {
      // A 1-D weight is the device's from the start: one slot, column 0, its
      // master set by initialize() and its moments zero.
      ws.columns = {0};
      const packed_layout l = d.layout(w);
      ws.packed = cuda_device_memory::allocate(l.bytes, d.context("cudaMalloc packed state", w));
      TF_CUDA_CHECK(cudaMemsetAsync(ws.packed.get(), 0, l.bytes, d.stream), d.context("cudaMemsetAsync", w));
    }
  }
  d.importance = cuda_device_memory::allocate(max_cols * sizeof(float), cuda_context("cudaMalloc importance"));
  d.slot_bytes = align_up(max_elements * size_of(options.grad_type), 64);
  d.download_pinned.reserve(download_slots * d.slot_bytes, "gradient download");
  if (options.grad_type != dtype::fp32) d.download_fp32.resize(max_elements);
  if (max_matrix_elements > 0) {
    d.upload_columns_offset = align_up(max_matrix_elements * d.compute_size);
    d.upload_pinned.reserve(d.upload_columns_offset + max_cols * sizeof(std::uint32_t), "master upload");
  }
  // The memsets are done (and every allocation visible) before any stream
  // but the trainer's, or any host code, relies on them.
  TF_CUDA_CHECK(cudaStreamSynchronize(d.stream), cuda_context("cudaStreamSynchronize"));
}

cuda_zenflow_device::~cuda_zenflow_device() = default;  // impl's destructor waits and frees


void cuda_zenflow_device::initialize(std::size_t w, std::span<const float> master) {
  impl& d = *impl_;
  if (w >= d.weights.size()) throw user_error("zenflow cuda device: initialize: no weight " + std::to_string(w));
  const zenflow::weight_shape& s = d.weights[w];
  if (master.size() != s.elements())
    throw user_error("zenflow cuda device: initialize: weight \"" + s.name + "\" has " +
                     std::to_string(s.elements()) + " elements, got " + std::to_string(master.size()));
  const cuda_device_scope scope(d.options.device);
  const std::size_t n = master.size(), compute_bytes = n * d.compute_size;
  const std::size_t master_at = align_up(compute_bytes);
  d.transfer.reserve(master_at + (s.matrix() ? 0 : n * sizeof(float)), "initialize");
  // Round to nearest even, as the kernels do on the device.
  detail::convert_range(d.simd_target, master.data(), dtype::fp32, d.transfer.data(), d.options.compute_type, 1.0f,
                        0, n);
  TF_CUDA_CHECK(cudaMemcpyAsync(d.tensors[w].parameters, d.transfer.data(), compute_bytes, cudaMemcpyHostToDevice,
                                d.stream),
                d.context("cudaMemcpyAsync initialize", w));
  d.bytes_up += compute_bytes;
  if (!s.matrix()) {
    // The device-owned master of a 1-D weight.
    std::memcpy(d.transfer.data() + master_at, master.data(), n * sizeof(float));
    TF_CUDA_CHECK(cudaMemcpyAsync(d.planes(w).master, d.transfer.data() + master_at, n * sizeof(float),
                                  cudaMemcpyHostToDevice, d.stream),
                  d.context("cudaMemcpyAsync initialize", w));
    d.bytes_up += n * sizeof(float);
  }
  d.synchronize(w);  // the transfer buffer is free again
}

void cuda_zenflow_device::set_adam(const adam_options& adam) {
  if (adam.amsgrad == amsgrad::on)
    throw user_error("zenflow cuda device: amsgrad is not supported on the device side");
  (void)adam_optimizer(adam);  // validates the hyper-parameters (user_error)
  // Read by update_owned() on this (the trainer's) thread when it enqueues
  // the next kernel; kernels already enqueued took their constants by value.
  impl_->options.adam = adam;
}

bool cuda_zenflow_device::read_owned(std::size_t w, const zenflow::packed_columns& out) {
  impl& d = *impl_;
  TF_ASSERT(w < d.weights.size());
  const impl::weight_state& ws = d.state[w];
  TF_ASSERT(std::ranges::equal(out.columns, ws.columns), "read_owned: not the columns the device owns");
  const std::size_t n = ws.columns.size() * d.weights[w].rows;
  TF_ASSERT(out.param.size() == n && out.state0.size() == n && out.state1.size() == n,
            "read_owned: the CUDA device keeps Adam's two moments; the packed columns must hold both");
  if (n == 0) return true;
  const cuda_device_scope scope(d.options.device);
  const detail::state_planes planes = d.planes(w);
  const std::size_t bytes = n * sizeof(float);
  d.transfer.reserve(3 * bytes, "read owned state");
  float* const pinned = reinterpret_cast<float*>(d.transfer.data());
  // On the trainer's stream: after every update and hand-over enqueued.
  const float* const from[3] = {planes.master, planes.exp_avg, planes.exp_avg_sq};
  for (int k = 0; k < 3; ++k)
    TF_CUDA_CHECK(cudaMemcpyAsync(pinned + k * n, from[k], bytes, cudaMemcpyDeviceToHost, d.stream),
                  d.context("cudaMemcpyAsync read owned state", w));
  d.bytes_down += 3 * bytes;
  d.synchronize(w);
  std::memcpy(out.param.data(), pinned, bytes);
  std::memcpy(out.state0.data(), pinned + n, bytes);
  std::memcpy(out.state1.data(), pinned + 2 * n, bytes);
  return true;
}

bool cuda_zenflow_device::write_owned(std::size_t w, const zenflow::packed_columns& in) {
  impl& d = *impl_;
  TF_ASSERT(w < d.weights.size());
  const impl::weight_state& ws = d.state[w];
  TF_ASSERT(std::ranges::equal(in.columns, ws.columns), "write_owned: not the columns the device owns");
  const std::uint64_t rows = d.weights[w].rows;
  const std::size_t n = ws.columns.size() * rows;
  TF_ASSERT(in.param.size() == n && in.state0.size() == n && in.state1.size() == n,
            "write_owned: the CUDA device keeps Adam's two moments; the packed columns must hold both");
  if (n == 0) return true;
  const cuda_device_scope scope(d.options.device);
  const detail::state_planes planes = d.planes(w);
  const std::size_t bytes = n * sizeof(float);
  const std::size_t compute_at = align_up(3 * bytes);
  d.transfer.reserve(compute_at + n * d.compute_size, "write owned state");
  std::byte* const pinned = d.transfer.data();
  std::memcpy(pinned, in.param.data(), bytes);
  std::memcpy(pinned + bytes, in.state0.data(), bytes);
  std::memcpy(pinned + 2 * bytes, in.state1.data(), bytes);
  // The compute copy rounded to nearest even, as the kernels round it.
  detail::convert_range(d.simd_target, in.param.data(), dtype::fp32, pinned + compute_at, d.options.compute_type,
                        1.0f, 0, n);
  float* const to[3] = {planes.master, planes.exp_avg, planes.exp_avg_sq};
  for (int k = 0; k < 3; ++k)
    TF_CUDA_CHECK(cudaMemcpyAsync(to[k], pinned + k * bytes, bytes, cudaMemcpyHostToDevice, d.stream),
                  d.context("cudaMemcpyAsync write owned state", w));
  const std::size_t column_bytes = rows * d.compute_size;
  for (std::size_t i = 0; i < ws.columns.size(); ++i)
    TF_CUDA_CHECK(cudaMemcpyAsync(static_cast<std::byte*>(d.tensors[w].parameters) + ws.columns[i] * column_bytes,
                                  pinned + compute_at + i * column_bytes, column_bytes, cudaMemcpyHostToDevice,
                                  d.stream),
                  d.context("cudaMemcpyAsync write owned state", w));
  d.bytes_up += 3 * bytes + n * d.compute_size;
  d.synchronize(w);  // the transfer buffer is free again
  return true;
}

cuda_zenflow_traffic cuda_zenflow_device::traffic() const {
  return {impl_->bytes_down.load(), impl_->bytes_up.load()};
}

std::span<const std::uint32_t> cuda_zenflow_device::owned_columns(std::size_t w) const {
  TF_ASSERT(w < impl_->weights.size());
  return impl_->state[w].columns;
}

void cuda_zenflow_device::column_importance(std::size_t w, zenflow::importance_norm norm, std::span<float> out) {
  impl& d = *impl_;
  TF_ASSERT(w < d.weights.size() && out.size() == d.weights[w].cols);
  const zenflow::weight_shape& s = d.weights[w];
  d.require_gradient(w);
  const cuda_device_scope scope(d.options.device);
  // On the score stream, behind the gradients' event (without
  // gradients_ready(), behind everything on the trainer's stream so far).
  if (!d.per_step) d.mark_gradients();
  const cudaStream_t scoring = d.score_stream.get();
  auto* scores = static_cast<float*>(d.importance.get());
  d.check_launch(detail::launch_column_importance(d.gradients[w], d.options.grad_type, s.rows, s.cols,
                                                  norm == zenflow::importance_norm::l2 ? detail::column_norm::l2
                                                                                       : detail::column_norm::l1,
                                                  scores, scoring, d.sm_count),
                 "column importance kernel", w);
  const std::size_t bytes = out.size() * sizeof(float);
  d.transfer.reserve(bytes, "column importance");
  TF_CUDA_CHECK(cudaMemcpyAsync(d.transfer.data(), scores, bytes, cudaMemcpyDeviceToHost, scoring),
                d.context("cudaMemcpyAsync column importance", w));
  d.bytes_down += bytes;
  // Also what keeps `importance` and `transfer` from being reused too early.
  TF_CUDA_CHECK(cudaStreamSynchronize(scoring), d.context("cudaStreamSynchronize column importance", w));
  std::memcpy(out.data(), d.transfer.data(), bytes);
}

void cuda_zenflow_device::update_owned(std::size_t w, std::int64_t step) {
  impl& d = *impl_;
  TF_ASSERT(w < d.weights.size() && step >= 1);
  const impl::weight_state& ws = d.state[w];
  if (ws.columns.empty()) return;
  const cuda_device_scope scope(d.options.device);
  const detail::state_planes planes = d.planes(w);
  detail::adam_columns_args a;
  a.master = planes.master;
  a.exp_avg = planes.exp_avg;
  a.exp_avg_sq = planes.exp_avg_sq;
  a.columns = reinterpret_cast<const std::uint32_t*>(static_cast<const std::byte*>(ws.packed.get()) +
                                                     d.layout(w).columns_offset);
  a.count = ws.columns.size();
  a.rows = d.weights[w].rows;
  d.require_gradient(w);
  if (d.per_step && step != d.updated_step) {
    // A new step must name its gradients first, or it would read the last one's.
    if (!d.ready_unused)
      throw user_error("zenflow cuda device: step " + std::to_string(step) +
                       " updates the device before gradients_ready() named its gradients");
    d.ready_unused = false;
    d.updated_step = step;
  }
  a.grad = d.gradients[w];
  a.grad_type = d.options.grad_type;
  a.param = d.tensors[w].parameters;
  a.param_type = d.options.compute_type;
  a.k = detail::make_adam_element_constants(d.options.adam, step);
  d.check_launch(detail::launch_adam_columns(a, d.stream, d.sm_count), "adam kernel", w);
}

void cuda_zenflow_device::gradients_ready(std::span<const void* const> gradients) {
  impl& d = *impl_;
  if (gradients.size() != d.weights.size())
    throw user_error("zenflow cuda device: gradients_ready: " + std::to_string(gradients.size()) +
                     " gradients for " + std::to_string(d.weights.size()) + " weights");
  const cuda_device_scope scope(d.options.device);
  for (std::size_t w = 0; w < gradients.size(); ++w)
    check_device_pointer(gradients[w], size_of(d.options.grad_type), d.options.device,
                         "zenflow cuda device: gradients_ready: weight \"" + d.weights[w].name + "\"'s gradient");
  d.gradients.assign(gradients.begin(), gradients.end());
  d.per_step = true;
  d.ready_unused = true;
  d.mark_gradients();
  // A download of the last step nobody took still reads its gradients;
  // the hand-overs drop those, so this is a safety net, not a wait per step.
  if (d.ring.begin(d.planned_downloads())) d.wait_downloads("cudaStreamSynchronize gradient download");
  d.issue_downloads();
}

void cuda_zenflow_device::gradients_ready() {
  std::vector<const void*> gradients;
  for (const cuda_zenflow_weight& t : impl_->tensors) gradients.push_back(t.gradient);
  gradients_ready(gradients);
}

std::span<const float> cuda_zenflow_device::download_gradient(std::size_t w) {
  impl& d = *impl_;
  TF_ASSERT(w < d.weights.size());
  d.require_gradient(w);
  const std::size_t n = d.weights[w].elements();
  const cuda_device_scope scope(d.options.device);
  const unsigned slot = d.fetch(w);
  if (d.options.grad_type == dtype::fp32) {
    // Read in place: the slot stays taken until the next request.
    return {reinterpret_cast<const float*>(d.slot_data(slot)), n};
  }
  optim::widen_gradient(*d.host_threads, d.slot_data(slot), d.options.grad_type, d.download_fp32.data(), n);
  d.ring.release(slot);
  d.issue_downloads();
  return {d.download_fp32.data(), n};
}

bool cuda_zenflow_device::accumulate_gradient(std::size_t w, std::span<const zenflow::column_run> runs,
                                              std::span<float> sum) {
  impl& d = *impl_;
  if (w >= d.weights.size()) throw user_error("zenflow cuda device: accumulate_gradient: no weight " + std::to_string(w));
  const zenflow::weight_shape& s = d.weights[w];
  if (sum.size() != s.elements())
    throw user_error("zenflow cuda device: accumulate_gradient: weight \"" + s.name + "\" has " +
                     std::to_string(s.elements()) + " elements, the sum " + std::to_string(sum.size()));
  for (std::size_t i = 0; i < runs.size(); ++i)
    if (runs[i].begin >= runs[i].end || runs[i].end > s.cols || (i > 0 && runs[i].begin < runs[i - 1].end))
      throw user_error("zenflow cuda device: accumulate_gradient: weight \"" + s.name +
                       "\": the runs are not ascending columns of the weight");
  d.require_gradient(w);
  const cuda_device_scope scope(d.options.device);
  const unsigned slot = d.fetch(w);
  optim::accumulate_gradient(*d.host_threads, d.slot_data(slot), d.options.grad_type, runs, s.rows, sum);
  d.ring.release(slot);
  d.issue_downloads();
  return true;
}

void cuda_zenflow_device::stage_upload(std::size_t w, std::span<const zenflow::column_run> runs,
                                       std::span<const float> master) {
  // On the engine's CPU-step thread: only the upload stream, upload_pinned
  // and this weight's staging area, staged_columns and staged_runs, which
  // the trainer's thread touches only in apply_staged(), after this returned.
  impl& d = *impl_;
  TF_ASSERT(w < d.weights.size() && d.weights[w].matrix());
  const zenflow::weight_shape& s = d.weights[w];
  const std::uint64_t rows = s.rows;
  TF_ASSERT(master.size() == s.elements(), "stage_upload: master of the wrong size");
  impl::weight_state& ws = d.state[w];
  ws.staged_runs.assign(runs.begin(), runs.end());
  ws.staged_count = 0;
  if (runs.empty()) return;
  const cuda_device_scope scope(d.options.device);
  const cudaStream_t upload = d.upload_stream.get();
  // The previous window's apply_staged() copy may still be reading staging
  // and staged_columns on the trainer's stream: the upload waits for it
  // (an event never recorded is complete, so the first upload does not wait).
  TF_CUDA_CHECK(cudaStreamWaitEvent(upload, ws.applied.get(), 0), d.context("cudaStreamWaitEvent", w));
  // Each run converted into the pinned buffer at its place in the whole
  // weight, and the runs' columns listed after it.
  auto* columns = reinterpret_cast<std::uint32_t*>(d.upload_pinned.data() + d.upload_columns_offset);
  std::uint64_t count = 0;
  for (const zenflow::column_run r : runs) {
    TF_ASSERT(r.begin < r.end && r.end <= s.cols, "stage_upload: a run outside the weight");
    TF_ASSERT(count == 0 || r.begin > columns[count - 1], "stage_upload: runs not ascending");
    detail::convert_range(d.simd_target, master.data(), dtype::fp32, d.upload_pinned.data(), d.options.compute_type,
                          1.0f, r.begin * rows, r.end * rows);
    for (std::uint32_t c = r.begin; c < r.end; ++c) columns[count++] = c;
  }
  // One copy over the span the runs cover: the device-owned columns in
  // between carry stale bytes that apply_staged() never copies.
  const std::size_t first = runs.front().begin * rows * d.compute_size;
  const std::size_t last = runs.back().end * rows * d.compute_size;
  TF_CUDA_CHECK(cudaMemcpyAsync(static_cast<std::byte*>(ws.staging.get()) + first, d.upload_pinned.data() + first,
                                last - first, cudaMemcpyHostToDevice, upload),
                d.context("cudaMemcpyAsync master upload", w).range(first, last - first));
  d.bytes_up += last - first;
  TF_CUDA_CHECK(cudaMemcpyAsync(ws.staged_columns.get(), columns, count * sizeof(std::uint32_t),
                                cudaMemcpyHostToDevice, upload),
                d.context("cudaMemcpyAsync master upload", w));
  d.bytes_up += count * sizeof(std::uint32_t);
  // Done before returning: the engine applies the runs only after this
  // returned, and the pinned buffer serves the next weight.
  TF_CUDA_CHECK(cudaStreamSynchronize(upload), d.context("cudaStreamSynchronize upload", w));
  ws.staged_count = count;
}

void cuda_zenflow_device::apply_staged(std::size_t w, std::span<const zenflow::column_run> runs) {
  impl& d = *impl_;
  TF_ASSERT(w < d.weights.size() && d.weights[w].matrix());
  if (runs.empty()) return;
  const zenflow::weight_shape& s = d.weights[w];
  impl::weight_state& ws = d.state[w];
  const cuda_device_scope scope(d.options.device);
  if (std::equal(runs.begin(), runs.end(), ws.staged_runs.begin(), ws.staged_runs.end())) {
    // The runs just staged (the engine's case): one kernel over their columns.
    d.check_launch(detail::launch_copy_columns(d.tensors[w].parameters, ws.staging.get(), d.compute_size,
                                               static_cast<const std::uint32_t*>(ws.staged_columns.get()),
                                               ws.staged_count, s.rows, d.stream, d.sm_count),
                   "copy columns kernel", w);
  } else {
    // Some other staged runs: one device-to-device copy each.
    for (const zenflow::column_run r : runs) {
      TF_ASSERT(r.begin < r.end && r.end <= s.cols, "apply_staged: a run outside the weight");
      const std::size_t offset = r.begin * s.rows * d.compute_size;
      const std::size_t bytes = (r.end - r.begin) * s.rows * d.compute_size;
      TF_CUDA_CHECK(cudaMemcpyAsync(static_cast<std::byte*>(d.tensors[w].parameters) + offset,
                                    static_cast<const std::byte*>(ws.staging.get()) + offset, bytes,
                                    cudaMemcpyDeviceToDevice, d.stream),
                    d.context("cudaMemcpyAsync apply staged", w).range(offset, bytes));
    }
  }
  TF_CUDA_CHECK(cudaEventRecord(ws.applied.get(), d.stream), d.context("cudaEventRecord", w));
}

void cuda_zenflow_device::hand_over(std::size_t w, std::span<const std::uint32_t> selected,
                                    const zenflow::packed_columns& entering_state,
                                    const zenflow::packed_columns& leaving_state) {
  impl& d = *impl_;
  TF_ASSERT(w < d.weights.size());
  const zenflow::weight_shape& s = d.weights[w];
  const std::uint64_t rows = s.rows;
  impl::weight_state& ws = d.state[w];
  const std::vector<std::uint32_t>& old = ws.columns;
  const std::size_t in_elements = entering_state.columns.size() * rows;
  const std::size_t out_elements = leaving_state.columns.size() * rows;
  TF_ASSERT(entering_state.param.size() == in_elements && entering_state.state0.size() == in_elements &&
                entering_state.state1.size() == in_elements && leaving_state.param.size() == out_elements &&
                leaving_state.state0.size() == out_elements && leaving_state.state1.size() == out_elements,
            "hand_over: the CUDA device keeps Adam's two moments; the packed columns must hold both");

  // Where each new slot comes from: a kept column's old slot (>= 0), or the
  // next entering column (-1 - its index among the entering ones).
  const std::size_t slots = selected.size();
  std::vector<std::int64_t> source(slots);
  std::vector<std::uint32_t> entering;
  for (std::size_t j = 0; j < slots; ++j) {
    const std::uint32_t c = selected[j];
    TF_ASSERT(c < s.cols && (j == 0 || selected[j - 1] < c), "hand_over: the selection is not ascending");
    const auto it = std::lower_bound(old.begin(), old.end(), c);
    if (it != old.end() && *it == c) {
      source[j] = it - old.begin();
    } else {
      source[j] = -1 - static_cast<std::int64_t>(entering.size());
      entering.push_back(c);
    }
  }
  std::vector<std::int64_t> leaving(leaving_state.columns.size());
  for (std::size_t i = 0; i < leaving.size(); ++i) {
    const std::uint32_t c = leaving_state.columns[i];
    const auto it = std::lower_bound(old.begin(), old.end(), c);
    TF_ASSERT(it != old.end() && *it == c, "a leaving column was not the device's");
    leaving[i] = it - old.begin();
  }
  TF_ASSERT(entering.size() + (old.size() - leaving.size()) == slots, "hand-over does not add up");
  TF_ASSERT(std::ranges::equal(entering, entering_state.columns),
            "hand-over: the entering columns disagree with the selection");

  // One transfer buffer, mirrored by one device scratch allocation:
  //   [entering master | exp_avg | exp_avg_sq] [source] [leaving] [columns]  → up, one copy
  //   [leaving master | exp_avg | exp_avg_sq]                                ← down, one copy
  const std::size_t in_plane = entering.size() * rows, out_plane = leaving.size() * rows;
  const std::size_t source_at = align_up(3 * in_plane * sizeof(float));
  const std::size_t leaving_at = align_up(source_at + slots * sizeof(std::int64_t));
  const std::size_t columns_at = align_up(leaving_at + leaving.size() * sizeof(std::int64_t));
  const std::size_t up_bytes = columns_at + slots * sizeof(std::uint32_t);
  const std::size_t out_at = align_up(up_bytes);
  const std::size_t total = out_at + 3 * out_plane * sizeof(float);
  const cuda_device_scope scope(d.options.device);
  d.transfer.reserve(total, "hand-over");
  std::byte* const pinned = d.transfer.data();
  {
    auto* in = reinterpret_cast<float*>(pinned);
    if (in_plane > 0) {
      std::memcpy(in, entering_state.param.data(), in_plane * sizeof(float));
      std::memcpy(in + in_plane, entering_state.state0.data(), in_plane * sizeof(float));
      std::memcpy(in + 2 * in_plane, entering_state.state1.data(), in_plane * sizeof(float));
    }
    // (An empty vector's data() may be null, which memcpy must not see.)
    if (slots > 0) {
      std::memcpy(pinned + source_at, source.data(), slots * sizeof(std::int64_t));
      std::memcpy(pinned + columns_at, selected.data(), slots * sizeof(std::uint32_t));
    }
    if (!leaving.empty()) std::memcpy(pinned + leaving_at, leaving.data(), leaving.size() * sizeof(std::int64_t));
  }
  // Freed at the end of this function, after the synchronisation below.
  cuda_device_memory scratch =
      d.pools ? cuda_device_memory::allocate_async(total, d.stream, d.context("cudaMallocAsync hand-over", w))
              : cuda_device_memory::allocate(total, d.context("cudaMalloc hand-over", w));
  auto* const dev = static_cast<std::byte*>(scratch.get());
  if (up_bytes > 0) {
    TF_CUDA_CHECK(cudaMemcpyAsync(dev, pinned, up_bytes, cudaMemcpyHostToDevice, d.stream),
                  d.context("cudaMemcpyAsync hand-over", w));
    d.bytes_up += up_bytes;
  }
  const detail::state_planes old_planes = d.planes(w);
  const detail::const_state_planes kept{old_planes.master, old_planes.exp_avg, old_planes.exp_avg_sq};

  // Leaving columns: gathered into the scratch, brought down in one copy.
  if (!leaving.empty()) {
    auto* out = reinterpret_cast<float*>(dev + out_at);
    detail::repack_args gather;
    gather.dst = {out, out + out_plane, out + 2 * out_plane};
    gather.slots = leaving.size();
    gather.rows = rows;
    gather.source = reinterpret_cast<const std::int64_t*>(dev + leaving_at);
    gather.kept = kept;
    d.check_launch(detail::launch_repack(gather, d.stream, d.sm_count), "gather kernel", w);
    TF_CUDA_CHECK(cudaMemcpyAsync(pinned + out_at, dev + out_at, 3 * out_plane * sizeof(float),
                                  cudaMemcpyDeviceToHost, d.stream),
                  d.context("cudaMemcpyAsync hand-over", w));
    d.bytes_down += 3 * out_plane * sizeof(float);
  }

  // The new packed state, in selection order: kept slots move on the
  // device, entering ones come from the scratch and set their compute copy.
  const packed_layout next_layout(slots, rows);
  cuda_device_memory next =
      d.pools ? cuda_device_memory::allocate_async(next_layout.bytes, d.stream, d.context("cudaMallocAsync packed state", w))
              : cuda_device_memory::allocate(next_layout.bytes, d.context("cudaMalloc packed state", w));
  if (slots > 0) {
    auto* base = static_cast<float*>(next.get());
    auto* next_columns = reinterpret_cast<std::uint32_t*>(static_cast<std::byte*>(next.get()) + next_layout.columns_offset);
    TF_CUDA_CHECK(cudaMemcpyAsync(next_columns, dev + columns_at, slots * sizeof(std::uint32_t),
                                  cudaMemcpyDeviceToDevice, d.stream),
                  d.context("cudaMemcpyAsync hand-over", w));
    const auto* in = reinterpret_cast<const float*>(dev);
    detail::repack_args repack;
    repack.dst = {base, base + next_layout.plane, base + 2 * next_layout.plane};
    repack.slots = slots;
    repack.rows = rows;
    repack.source = reinterpret_cast<const std::int64_t*>(dev + source_at);
    repack.kept = kept;
    repack.entering = {in, in + in_plane, in + 2 * in_plane};
    repack.param = d.tensors[w].parameters;
    repack.param_type = d.options.compute_type;
    repack.columns = next_columns;
    d.check_launch(detail::launch_repack(repack, d.stream, d.sm_count), "repack kernel", w);
  }
  // The host buffers are read (done above) and written (below) before this
  // returns, and the old state may be freed only once the kernels read it.
  d.synchronize(w);
  {
    const auto* out = reinterpret_cast<const float*>(pinned + out_at);
    if (out_plane > 0) {
      std::memcpy(leaving_state.param.data(), out, out_plane * sizeof(float));
      std::memcpy(leaving_state.state0.data(), out + out_plane, out_plane * sizeof(float));
      std::memcpy(leaving_state.state1.data(), out + 2 * out_plane, out_plane * sizeof(float));
    }
  }
  ws.packed = std::move(next);  // frees the old state
  ws.columns.assign(selected.begin(), selected.end());
  if (ws.columns.size() == s.cols) {
    // The host asks for this gradient no more: a download of it already on
    // its way is waited for (it reads the gradient, which the trainer may
    // overwrite once step() returns), and its slot serves the next weight.
    if (const std::optional<unsigned> freed = d.ring.drop(w)) {
      TF_CUDA_CHECK(cudaEventSynchronize(d.slot_done[*freed].get()), d.context("cudaEventSynchronize", w));
      d.issue_downloads();
    }
  }
}

}  // namespace tierflow::optim
