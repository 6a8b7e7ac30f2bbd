// The CUDA device (--device cuda): a GPU running each step's matmuls for
// real, for every 2-D weight a token is multiplied by (model_shape::matmuls):
// one forward GEMM and the two of the backward (the input's and the weight's
// gradient), bf16 with fp32 accumulation through cuBLAS, over micro-batches
// of the plan's size: the 6 · weights · tokens FLOPs the simulated device
// counts. The values are not a model's: activations and weights are scratch
// buffers, and the gradient the host works with is the same fixed buffer the
// simulated device hands down. The copies are real: every byte each link
// carries crosses PCIe.
//
// Streams: compute (the matmuls), side (ZenFlow's device side: the trainer's
// stream as cuda_zenflow_device sees it), down (the baselines' gradients) and
// up (their parameters). Timed events bound each step's matmuls and the
// device side's update after it; the timeline maps them onto the host clock
// through one origin event. The baselines' gradient of each weight goes down
// once its last micro-batch's weight-gradient GEMM is done, as the backward
// goes on (DeepSpeed's overlap of the gradient offload with the backward).
// ZenFlow's device gradient buffers are written once (no backward writes
// them), so step s's gradient can be read while step s+1 computes; a trainer
// keeps a second buffer and names it in gradients_ready().
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <functional>
#include <cstdio>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "offload/steps.hpp"
#include "tierflow/core/assert.hpp"
#include "tierflow/core/cuda_error.hpp"
#include "tierflow/core/cuda_handles.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optim/adam.hpp"
#include "tierflow/optim/zenflow_cuda.hpp"

namespace tierflow::bench {
namespace {

using clock = offload_clock;

class cublas_category_t final : public std::error_category {
 public:
  const char* name() const noexcept override { return "cublas"; }
  std::string message(int status) const override {
    return cublasGetStatusString(static_cast<cublasStatus_t>(status));
  }
};

const std::error_category& cublas_category() {
  static const cublas_category_t category;
  return category;
}

void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    throw error(std::error_code(static_cast<int>(status), cublas_category()),
                error_context{std::string("bench offload: ") + call}.in_tier("device"));
}

error_context cuda_context(const char* call) {
  return error_context{std::string("bench offload: ") + call}.in_tier("device");
}

class cublas_handle {
 public:
  explicit cublas_handle(cudaStream_t stream) {
    check_cublas(cublasCreate(&handle_), "cublasCreate");
    try {
      check_cublas(cublasSetStream(handle_, stream), "cublasSetStream");
    } catch (...) {
      cublasDestroy(handle_);
      throw;
    }
  }
  ~cublas_handle() { cublasDestroy(handle_); }
  cublas_handle(const cublas_handle&) = delete;
  cublas_handle& operator=(const cublas_handle&) = delete;
  cublasHandle_t get() const noexcept { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

// Fills `bytes` of device memory at `p` with `pattern`, repeated.
void fill(void* p, std::size_t bytes, std::span<const std::uint16_t> pattern) {
  const std::size_t chunk = pattern.size_bytes();
  for (std::size_t at = 0; at < bytes; at += chunk) {
    TF_CUDA_CHECK(cudaMemcpy(static_cast<std::byte*>(p) + at, pattern.data(), std::min(chunk, bytes - at),
                             cudaMemcpyHostToDevice),
                  cuda_context("cudaMemcpy fill"));
  }
}

// One step's matmuls, enqueued on the handle's stream.
class model_matmuls {
 public:
  model_matmuls(const offload_plan& plan, std::span<const std::uint16_t> pattern) : plan_(plan) {
    std::uint64_t widest = 0, largest = 0;
    for (const auto& w : plan.model.matmuls()) {
      weights_.push_back(w);
      widest = std::max({widest, w.rows, w.cols});
      largest = std::max(largest, w.elements());
    }
    const std::size_t activation = plan.device_memory.micro_batch_tokens * widest * 2;
    x_ = cuda_device_memory::allocate(activation, cuda_context("cudaMalloc activations"));
    y_ = cuda_device_memory::allocate(activation, cuda_context("cudaMalloc activations"));
    w_ = cuda_device_memory::allocate(largest * 2, cuda_context("cudaMalloc weight"));
    dw_ = cuda_device_memory::allocate(largest * 2, cuda_context("cudaMalloc weight gradient"));
    // Non-zero operands: a GPU's power, and so its clock, depends on the data.
    fill(x_.get(), activation, pattern);
    fill(y_.get(), activation, pattern);
    fill(w_.get(), largest * 2, pattern);
  }

  // Enqueues one step's matmuls. `gradient_done(i)` (if set) is called once
  // the weight gradient of matmuls()[i] is complete: after its GEMM in the
  // last micro-batch.
  void enqueue(cublasHandle_t h, const std::function<void(std::size_t)>& gradient_done = {}) const {
    const std::uint64_t tokens = plan_.options.batch_tokens, micro = plan_.device_memory.micro_batch_tokens;
    for (std::uint64_t at = 0; at < tokens; at += micro) {
      const int n = static_cast<int>(std::min(micro, tokens - at));
      const bool last = at + micro >= tokens;
      for (const auto& w : weights_) forward(h, w, n);
      for (std::size_t i = weights_.size(); i-- > 0;) {
        backward(h, weights_[i], n);
        if (last && gradient_done) gradient_done(i);
      }
    }
  }
  const std::vector<weight>& weights() const noexcept { return weights_; }

 private:
  // Column-major: W is out × in, X in × n, Y out × n (out = rows, in = cols).
  void forward(cublasHandle_t h, const weight& w, int n) const {
    const int out = static_cast<int>(w.rows), in = static_cast<int>(w.cols);
    gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, out, n, in, w_.get(), out, x_.get(), in, y_.get(), out);  // Y = W·X
  }
  void backward(cublasHandle_t h, const weight& w, int n) const {
    const int out = static_cast<int>(w.rows), in = static_cast<int>(w.cols);
    gemm(h, CUBLAS_OP_N, CUBLAS_OP_T, out, in, n, y_.get(), out, x_.get(), in, dw_.get(), out);  // dW = dY·Xᵀ
    gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, in, n, out, w_.get(), out, y_.get(), out, x_.get(), in);   // dX = Wᵀ·dY
  }
  static void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* a,
                   int lda, const void* b, int ldb, void* c, int ldc) {
    const float one = 1.0f, zero = 0.0f;
    check_cublas(cublasGemmEx(h, ta, tb, m, n, k, &one, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &zero, c,
                              CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  }

  const offload_plan& plan_;
  std::vector<weight> weights_;
  cuda_device_memory x_, y_, w_, dw_;
};

void record(const cuda_event& e, cudaStream_t s) {
  TF_CUDA_CHECK(cudaEventRecord(e.get(), s), cuda_context("cudaEventRecord"));
}
void wait(cudaStream_t s, const cuda_event& e) {
  TF_CUDA_CHECK(cudaStreamWaitEvent(s, e.get(), 0), cuda_context("cudaStreamWaitEvent"));
}
double seconds_between(const cuda_event& a, const cuda_event& b) {
  float ms = 0;
  TF_CUDA_CHECK(cudaEventElapsedTime(&ms, a.get(), b.get()), cuda_context("cudaEventElapsedTime"));
  return ms / 1e3;
}

// A step's events on the device: its matmuls, and (ZenFlow) the device
// side's update after it, with the host times that update was issued between.
struct step_events {
  cuda_event start = cuda_event::create_timed(), end = cuda_event::create_timed();
  cuda_event side_start = cuda_event::create_timed(), side_end = cuda_event::create_timed();
  bool side = false;
  clock::time_point side_issued_from{}, side_issued_until{};
};

// The model's bf16 parameters and gradients on the device, every sub-group after the last.
struct device_model_buffers {
  cuda_device_memory parameters, gradients;
};

class cuda_timeline final : public device_timeline {
 public:
  cuda_timeline(const offload_plan& plan, std::span<const float> gradient, float initial_parameter)
      : plan_(plan), scope_(plan.options.cuda_device), compute_(plan.options.cuda_device),
        side_(plan.options.cuda_device), down_(plan.options.cuda_device), up_(plan.options.cuda_device),
        blas_(compute_.get()), pattern_(bf16_pattern(gradient)), matmuls_(plan, pattern_),
        buffers_{cuda_device_memory::allocate(plan.parameter_bytes, cuda_context("cudaMalloc parameters")),
                 cuda_device_memory::allocate(plan.gradient_bytes, cuda_context("cudaMalloc gradients"))},
        events_(plan.options.steps + 1) {
    fill(buffers_.gradients.get(), plan.gradient_bytes, pattern_);
    if (plan.options.strategy == strategy::zenflow) make_zenflow_side(initial_parameter);
    else make_baseline_staging();
    // The origin: device events and the host clock meet here.
    TF_CUDA_CHECK(cudaDeviceSynchronize(), cuda_context("cudaDeviceSynchronize"));
    record(origin_, compute_.get());
    TF_CUDA_CHECK(cudaEventSynchronize(origin_.get()), cuda_context("cudaEventSynchronize"));
    origin_time_ = clock::now();
  }

  void launch(std::uint64_t s) override {
    wait_for_inputs(s);
    record(events_[s].start, compute_.get());
    if (zenflow_side_) {
      matmuls_.enqueue(blas_.get());
    } else {
      matmuls_.enqueue(blas_.get(), [&](std::size_t i) { send_weight_gradient(i); });
    }
    record(events_[s].end, compute_.get());
  }
  void mark_next_start(std::uint64_t s) override {
    wait_for_inputs(s);
    record(events_[s].start, compute_.get());
  }
  void receive_gradient(std::uint64_t s) override {
    // What no matmul produces (1-D weights, position embeddings) after the step.
    wait(down_.get(), events_[s].end);
    copy_gradient(matmul_gradient_bytes_, plan_.gradient_bytes - matmul_gradient_bytes_);
    record(downloaded_, down_.get());
    TF_CUDA_CHECK(cudaEventSynchronize(downloaded_.get()), cuda_context("cudaEventSynchronize"));
    d2h_bytes_ += plan_.gradient_bytes;
  }
  void send_parameters() override {
    TF_CUDA_CHECK(cudaMemcpyAsync(buffers_.parameters.get(), staging_up_.data(), plan_.parameter_bytes,
                                  cudaMemcpyHostToDevice, up_.get()),
                  cuda_context("cudaMemcpyAsync parameter upload"));
    record(uploaded_, up_.get());
    uploads_ += 1;
    h2d_bytes_ += plan_.parameter_bytes;
  }
  zenflow::device_side& zenflow_device() override { return *zenflow_side_; }
  void order_after_backward(std::uint64_t s) override {
    // The device side's stream past step s's backward: its gradients are
    // ready, and their trip down starts on the device side's own D2H stream.
    wait(side_.get(), events_[s].end);
    zenflow_side_->gradients_ready();
  }
  void begin_side(std::uint64_t s) override {
    events_[s].side_issued_from = clock::now();
    record(events_[s].side_start, side_.get());
  }
  void end_side(std::uint64_t s) override {
    record(events_[s].side_end, side_.get());
    events_[s].side = true;
    events_[s].side_issued_until = clock::now();
  }
  device_timeline_result finish() override;

 private:
  static std::vector<std::uint16_t> bf16_pattern(std::span<const float> gradient) {
    // Test data: the fixed gradient, as bf16 (truncated), repeated.
    std::vector<std::uint16_t> pattern(std::min<std::size_t>(gradient.size(), 4u << 20));
    for (std::size_t i = 0; i < pattern.size(); ++i)
      pattern[i] = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(gradient[i]) >> 16);
    return pattern;
  }
  void make_zenflow_side(float initial_parameter);
  void make_baseline_staging();
  void wait_for_inputs(std::uint64_t s) {
    if (zenflow_side_) {
      record(side_done_, side_.get());
      wait(compute_.get(), side_done_);
    } else if (uploads_ > 0) {
      wait(compute_.get(), uploaded_);  // every parameter back up first
    }
    TF_ASSERT(s < events_.size());
  }
  void send_weight_gradient(std::size_t i) {
    record(gradient_ready_, compute_.get());
    wait(down_.get(), gradient_ready_);
    copy_gradient(matmul_offsets_[i], matmuls_.weights()[i].elements() * 2);
  }
  void copy_gradient(std::uint64_t offset, std::uint64_t bytes) {
    if (bytes == 0) return;
    const auto* from = static_cast<const std::byte*>(buffers_.gradients.get()) + offset;
    TF_CUDA_CHECK(cudaMemcpyAsync(staging_down_.data() + offset, from, bytes, cudaMemcpyDeviceToHost, down_.get()),
                  cuda_context("cudaMemcpyAsync gradient download"));
  }
  clock::time_point at(const cuda_event& e) const {
    return origin_time_ + span_of(seconds_between(origin_, e));
  }
  double side_seconds(const step_events& e) const;

  const offload_plan& plan_;
  const cuda_device_scope scope_;
  const cuda_stream compute_, side_, down_, up_;
  const cublas_handle blas_;
  const std::vector<std::uint16_t> pattern_;
  const model_matmuls matmuls_;
  device_model_buffers buffers_;
  std::vector<step_events> events_;  // one per step, and the step after the last
  std::unique_ptr<optim::cuda_zenflow_device> zenflow_side_;
  // The baselines: pinned staging for the gradient and the parameters, each
  // matmul's gradient at its offset in the gradient buffer.
  cuda_pinned_buffer staging_down_, staging_up_;
  std::vector<std::uint64_t> matmul_offsets_;
  std::uint64_t matmul_gradient_bytes_ = 0;
  const cuda_event origin_ = cuda_event::create_timed();
  const cuda_event side_done_ = cuda_event::create(), gradient_ready_ = cuda_event::create();
  const cuda_event downloaded_ = cuda_event::create(), uploaded_ = cuda_event::create();
  clock::time_point origin_time_;
  std::uint64_t uploads_ = 0, d2h_bytes_ = 0, h2d_bytes_ = 0;
};

void cuda_timeline::make_zenflow_side(float initial_parameter) {
  std::vector<zenflow::weight_shape> shapes;
  std::vector<optim::cuda_zenflow_weight> tensors;
  std::size_t at = 0;
  for (const auto& c : plan_.chunks) {
    shapes.push_back(c.shape);
    tensors.push_back({static_cast<std::byte*>(buffers_.parameters.get()) + at,
                       static_cast<const std::byte*>(buffers_.gradients.get()) + at});
    at += c.shape.elements() * 2;
  }
  optim::cuda_zenflow_options zo;
  zo.device = plan_.options.cuda_device;
  zo.compute_type = dtype::bf16;
  zo.grad_type = dtype::bf16;
  zo.adam = optim::adam_options::adamw();  // the host side's rule (run.cpp's optim_rule)
  zo.stream = reinterpret_cast<std::uintptr_t>(side_.get());
  zenflow_side_ = std::make_unique<optim::cuda_zenflow_device>(shapes, std::move(tensors), zo);
  for (std::size_t w = 0; w < shapes.size(); ++w) {
    const std::vector<float> master(shapes[w].elements(), initial_parameter);
    zenflow_side_->initialize(w, master);
  }
}

void cuda_timeline::make_baseline_staging() {
  staging_down_.reserve(plan_.gradient_bytes, "gradient staging");
  staging_up_.reserve(plan_.parameter_bytes, "parameter staging");
  std::fill_n(reinterpret_cast<std::uint16_t*>(staging_up_.data()), plan_.parameter_bytes / 2, pattern_[0]);
  for (const auto& w : matmuls_.weights()) {
    matmul_offsets_.push_back(matmul_gradient_bytes_);
    matmul_gradient_bytes_ += w.elements() * 2;
  }
  TF_ASSERT(matmul_gradient_bytes_ <= plan_.gradient_bytes, "the matmuls' weights are among the parameters");
}

// The device side's busy time after a step: its events' span, less the part
// of it the trainer was still issuing the work after the step had ended (a
// first selection or a refresh reading the state on the host: the device
// was waiting then, and that is stall).
double cuda_timeline::side_seconds(const step_events& e) const {
  if (!e.side) return 0;
  const double span = seconds_between(e.side_start, e.side_end);
  const auto issue_from = std::max(e.side_issued_from, at(e.end));
  const double late = std::max(0.0, bench::seconds_between(issue_from, e.side_issued_until));
  return std::max(0.0, span - late);
}

device_timeline_result cuda_timeline::finish() {
  TF_CUDA_CHECK(cudaDeviceSynchronize(), cuda_context("cudaDeviceSynchronize"));
  device_timeline_result out;
  const std::uint64_t steps = plan_.options.steps;
  double compute_total = 0;
  for (std::uint64_t s = 0; s < steps; ++s) {
    const step_events& e = events_[s];
    out.spans.push_back({at(e.start), at(e.end), side_seconds(e)});
    compute_total += seconds_between(e.start, e.end);
  }
  out.next_start = at(events_[steps].start);
  out.compute_seconds = compute_total / static_cast<double>(steps);
  out.d2h_bytes = d2h_bytes_;
  out.h2d_bytes = h2d_bytes_;
  if (zenflow_side_) {
    const auto t = zenflow_side_->traffic();
    out.d2h_bytes = t.device_to_host;
    out.h2d_bytes = t.host_to_device;
  }
  const double tflops = plan_.model.step_flops(plan_.options.batch_tokens) / out.compute_seconds / 1e12;
  char line[160];
  std::snprintf(line, sizeof line, "; the model's bf16 matmuls through cuBLAS measured %.0f TFLOP/s, copies real",
                tflops);
  out.description = plan_.device_description + line;
  return out;
}

}  // namespace

std::unique_ptr<device_timeline> make_cuda_timeline(const offload_plan& plan, std::span<const float> gradient,
                                                    float initial_parameter) {
  return std::make_unique<cuda_timeline>(plan, gradient, initial_parameter);
}

}  // namespace tierflow::bench
