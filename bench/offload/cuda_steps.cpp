// The steps of a run on a CUDA GPU (--device cuda).
//
// The device runs each step's matmuls for real: for every 2-D weight a token
// is multiplied by (model_shape::matmuls), one forward GEMM and the two of
// the backward (the input's and the weight's gradient), bf16 with fp32
// accumulation through cuBLAS, over micro-batches of the plan's size: the
// 6 · weights · tokens FLOPs the simulated device counts. The values are not
// a model's: activations and weights are scratch buffers, and the gradient
// the host works with is the same fixed buffer the simulated device hands
// down. The copies are real: every byte each link carries crosses PCIe.
//
// Streams: compute (the matmuls), zenflow (ZenFlow's device side: the
// trainer's stream as cuda_zenflow_device sees it), down (gradients to the
// host) and up (parameters to the device). Timed events bound each step's
// matmuls and the device side's update; a step's stall is the compute
// stream's idle time before it, less the time the device side kept the
// device busy in it.
//
// sync, pipelined: step s's gradient goes down after its matmuls; the host
//   waits for it, runs the whole optimizer step, and sends every parameter
//   up; step s+1's matmuls wait for that upload.
// zenflow: after step s's matmuls the device side updates the columns it
//   owns (engine::update_device), then step s+1's matmuls are launched
//   before the host's part of step s runs (engine::step), unless the engine
//   says the device must wait for it. The device's gradient buffers are
//   written once (no backward writes them), so step s's gradient can be read
//   while step s+1 computes; a trainer would keep a second buffer.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "offload/steps.hpp"
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

  void enqueue(cublasHandle_t h) const {
    const std::uint64_t tokens = plan_.options.batch_tokens, micro = plan_.device_memory.micro_batch_tokens;
    for (std::uint64_t at = 0; at < tokens; at += micro) {
      const int n = static_cast<int>(std::min(micro, tokens - at));
      for (const auto& w : weights_) forward(h, w, n);
      for (auto it = weights_.rbegin(); it != weights_.rend(); ++it) backward(h, *it, n);
    }
  }

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
// side's update before the next step.
struct step_events {
  cuda_event start = cuda_event::create_timed(), end = cuda_event::create_timed();
  cuda_event side_start = cuda_event::create_timed(), side_end = cuda_event::create_timed();
  bool side = false;  // the device side ran after this step
};

}  // namespace

step_loop_output cuda_steps(const step_loop_inputs& in) {
  const offload_plan& plan = in.plan;
  const offload_options& o = plan.options;
  const cuda_device_scope scope(o.cuda_device);
  step_loop_output out;

  const cuda_stream compute(o.cuda_device), side(o.cuda_device), down(o.cuda_device), up(o.cuda_device);
  const cublas_handle blas(compute.get());

  // Test data: the fixed gradient, as bf16 (truncated), repeated.
  std::vector<std::uint16_t> pattern(std::min<std::size_t>(in.gradient.size(), 4u << 20));
  for (std::size_t i = 0; i < pattern.size(); ++i)
    pattern[i] = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(in.gradient[i]) >> 16);
  const model_matmuls matmuls(plan, pattern);

  // The model's bf16 parameters and gradients, every sub-group after the last.
  auto parameters = cuda_device_memory::allocate(plan.parameter_bytes, cuda_context("cudaMalloc parameters"));
  auto gradients = cuda_device_memory::allocate(plan.gradient_bytes, cuda_context("cudaMalloc gradients"));
  fill(gradients.get(), plan.gradient_bytes, pattern);

  std::unique_ptr<optim::cuda_zenflow_device> device_side;
  std::unique_ptr<zenflow::engine> engine;
  cuda_pinned_buffer staging_down, staging_up;
  if (o.strategy == strategy::zenflow) {
    std::vector<zenflow::weight_shape> shapes;
    std::vector<optim::cuda_zenflow_weight> tensors;
    std::size_t at = 0;
    for (const auto& c : plan.chunks) {
      shapes.push_back(c.shape);
      tensors.push_back({static_cast<std::byte*>(parameters.get()) + at,
                         static_cast<const std::byte*>(gradients.get()) + at});
      at += c.shape.elements() * 2;
    }
    optim::cuda_zenflow_options zo;
    zo.device = o.cuda_device;
    zo.compute_type = dtype::bf16;
    zo.grad_type = dtype::bf16;
    zo.adam = optim::adam_options::adamw();  // the host side's rule (run.cpp's optim_rule)
    zo.stream = reinterpret_cast<std::uintptr_t>(side.get());
    device_side = std::make_unique<optim::cuda_zenflow_device>(shapes, std::move(tensors), zo);
    for (std::size_t w = 0; w < shapes.size(); ++w) {
      const std::vector<float> master(shapes[w].elements(), in.initial_parameter);
      device_side->initialize(w, master);
    }
    engine = std::make_unique<zenflow::engine>(plan.zenflow, std::move(shapes), *device_side, *in.host_state, in.rule);
  } else {
    staging_down.reserve(plan.gradient_bytes, "gradient staging");
    staging_up.reserve(plan.parameter_bytes, "parameter staging");
    std::fill_n(reinterpret_cast<std::uint16_t*>(staging_up.data()), plan.parameter_bytes / 2, pattern[0]);
  }

  // The origin: device events and the host clock meet here.
  TF_CUDA_CHECK(cudaDeviceSynchronize(), cuda_context("cudaDeviceSynchronize"));
  const cuda_event origin = cuda_event::create_timed();
  record(origin, compute.get());
  TF_CUDA_CHECK(cudaEventSynchronize(origin.get()), cuda_context("cudaEventSynchronize"));
  const clock::time_point origin_time = clock::now();

  std::vector<step_events> ev(o.steps);
  std::vector<clock::time_point> host_start(o.steps), host_end(o.steps);
  auto launch = [&](std::uint64_t s) {
    record(ev[s].start, compute.get());
    matmuls.enqueue(blas.get());
    record(ev[s].end, compute.get());
  };

  if (engine) {
    const cuda_event side_done = cuda_event::create();
    launch(0);
    for (std::uint64_t s = 0; s < o.steps; ++s) {
      step_record rec;
      rec.step = s;
      // After step s's matmuls: the previous window's result (the trainer
      // applies it once the backward is done), then the owned columns' update.
      wait(side.get(), ev[s].end);
      if (engine->will_update()) {
        const auto apply_start = clock::now();
        engine->apply_previous_window();
        out.events.push_back({"host: apply window", host_track, apply_start, seconds_between(apply_start, clock::now())});
      }
      record(ev[s].side_start, side.get());
      engine->update_device();
      record(ev[s].side_end, side.get());
      ev[s].side = true;
      const bool waits = engine->device_waits_for_step();
      auto next = [&] {
        if (s + 1 >= o.steps) return;
        record(side_done, side.get());
        wait(compute.get(), side_done);
        launch(s + 1);
      };
      if (!waits) next();
      host_start[s] = clock::now();
      rec.boundary = engine->step().update_boundary;
      host_end[s] = clock::now();
      if (waits) next();
      out.steps.push_back(rec);
    }
  } else {
    const cuda_event downloaded = cuda_event::create(), uploaded = cuda_event::create();
    for (std::uint64_t s = 0; s < o.steps; ++s) {
      step_record rec;
      rec.step = s;
      rec.boundary = true;
      if (s > 0) wait(compute.get(), uploaded);  // every parameter back up first
      launch(s);
      wait(down.get(), ev[s].end);
      TF_CUDA_CHECK(cudaMemcpyAsync(staging_down.data(), gradients.get(), plan.gradient_bytes,
                                    cudaMemcpyDeviceToHost, down.get()),
                    cuda_context("cudaMemcpyAsync gradient download"));
      record(downloaded, down.get());
      TF_CUDA_CHECK(cudaEventSynchronize(downloaded.get()), cuda_context("cudaEventSynchronize"));
      out.d2h_bytes += plan.gradient_bytes;
      host_start[s] = clock::now();
      out.optimizer_seconds.push_back(std::chrono::duration<double>(in.optimizer_step()).count());
      TF_CUDA_CHECK(cudaMemcpyAsync(parameters.get(), staging_up.data(), plan.parameter_bytes,
                                    cudaMemcpyHostToDevice, up.get()),
                    cuda_context("cudaMemcpyAsync parameter upload"));
      record(uploaded, up.get());
      out.h2d_bytes += plan.parameter_bytes;
      host_end[s] = clock::now();
      out.steps.push_back(rec);
    }
  }

  // The drain: the last window's CPU step and the device's last work.
  const auto drain_start = clock::now();
  if (engine) {
    engine->finish();
    out.engine_stats = engine->stats();
  }
  TF_CUDA_CHECK(cudaDeviceSynchronize(), cuda_context("cudaDeviceSynchronize"));
  out.drain_seconds = seconds_between(drain_start, clock::now());
  if (device_side) {
    const auto t = device_side->traffic();
    out.d2h_bytes = t.device_to_host;
    out.h2d_bytes = t.host_to_device;
  }

  // The timeline, read back from the events.
  auto at = [&](const cuda_event& e) { return origin_time + span_of(seconds_between(origin, e)); };
  double compute_total = 0;
  for (std::uint64_t s = 0; s < o.steps; ++s) {
    step_record& rec = out.steps[s];
    const cuda_event& previous_end = s ? ev[s - 1].end : origin;
    const double compute_s = seconds_between(ev[s].start, ev[s].end);
    const double idle = seconds_between(previous_end, ev[s].start);
    const double side_busy = s && ev[s - 1].side ? seconds_between(ev[s - 1].side_start, ev[s - 1].side_end) : 0;
    rec.stall_seconds = std::max(0.0, idle - side_busy);
    rec.seconds = idle + compute_s;
    rec.host_seconds = seconds_between(host_start[s], host_end[s]);
    compute_total += compute_s;
    if (rec.stall_seconds > 0)
      out.events.push_back({"stall", stall_track, at(previous_end), rec.stall_seconds});
    out.events.push_back({"step " + std::to_string(s), device_track, at(ev[s].start), compute_s});
    out.events.push_back({rec.boundary ? "host: step + update" : "host: accumulate", host_track, host_start[s],
                          rec.host_seconds});
  }
  out.compute_seconds = compute_total / static_cast<double>(o.steps);
  const double tflops = plan.model.step_flops(o.batch_tokens) / out.compute_seconds / 1e12;
  char line[160];
  std::snprintf(line, sizeof line, "; the model's bf16 matmuls through cuBLAS measured %.0f TFLOP/s, copies real",
                tflops);
  out.device_description = plan.device_description + line;
  return out;
}

}  // namespace tierflow::bench
