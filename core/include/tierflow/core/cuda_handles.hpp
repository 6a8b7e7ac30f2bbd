// Move-only owners of a CUDA stream and a CUDA event. Include only from code
// built with CUDA (TIERFLOW_WITH_CUDA), like cuda_error.hpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <utility>

#include "tierflow/core/cuda_error.hpp"

namespace tierflow {

// Logs a CUDA failure that cannot be thrown (a destructor's, a cleanup's)
// and clears it, so later calls run.
inline void warn_cuda(const char* what, cudaError_t rc) noexcept {
  (void)cudaGetLastError();
  std::fprintf(stderr, "tierflow: warning: %s: %s\n", what, cudaGetErrorString(rc));
}

// A stream on one device. Non-blocking: no implicit synchronisation with the
// legacy default stream, so work on stream 0 never serialises against it.
// Default-constructed it holds none.
class cuda_stream {
 public:
  cuda_stream() = default;
  // Makes `device` current on the calling thread and creates the stream there.
  explicit cuda_stream(int device) : device_(device) {
    TF_CUDA_CHECK(cudaSetDevice(device), error_context{"cudaSetDevice"}.in_tier("device"));
    TF_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                  error_context{"cudaStreamCreateWithFlags"}.in_tier("device"));
  }
  cuda_stream(cuda_stream&& o) noexcept : device_(o.device_), stream_(std::exchange(o.stream_, nullptr)) {}
  cuda_stream& operator=(cuda_stream&& o) noexcept {
    if (this != &o) {
      reset();
      device_ = o.device_;
      stream_ = std::exchange(o.stream_, nullptr);
    }
    return *this;
  }
  ~cuda_stream() { reset(); }
  cudaStream_t get() const noexcept { return stream_; }

 private:
  void reset() noexcept {
    if (!stream_) return;
    cudaSetDevice(device_);
    if (const cudaError_t rc = cudaStreamDestroy(std::exchange(stream_, nullptr)); rc != cudaSuccess)
      warn_cuda("cudaStreamDestroy", rc);
  }
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};

// An event with timing off (the cheapest kind: it only orders work or waits
// for it). Default-constructed it holds none; an event never recorded
// counts as complete.
class cuda_event {
 public:
  cuda_event() = default;
  // On the calling thread's current device.
  static cuda_event create() {
    cuda_event e;
    TF_CUDA_CHECK(cudaEventCreateWithFlags(&e.event_, cudaEventDisableTiming),
                  error_context{"cudaEventCreateWithFlags"}.in_tier("device"));
    return e;
  }
  cuda_event(cuda_event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  cuda_event& operator=(cuda_event&& o) noexcept {
    if (this != &o) {
      reset();
      event_ = std::exchange(o.event_, nullptr);
    }
    return *this;
  }
  ~cuda_event() { reset(); }
  cudaEvent_t get() const noexcept { return event_; }

 private:
  void reset() noexcept {
    if (!event_) return;
    if (const cudaError_t rc = cudaEventDestroy(std::exchange(event_, nullptr)); rc != cudaSuccess)
      warn_cuda("cudaEventDestroy", rc);
  }
  cudaEvent_t event_ = nullptr;
};

}  // namespace tierflow
