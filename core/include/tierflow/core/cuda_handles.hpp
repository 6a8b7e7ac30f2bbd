// Move-only owners of CUDA resources: a stream, an event, page-locked host
// memory, device memory, and a scope that makes a device current. Include
// only from code built with CUDA (TIERFLOW_WITH_CUDA), like cuda_error.hpp.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
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

// An event. By default with timing off (the cheapest kind: it only orders
// work or waits for it); create_timed() makes one cudaEventElapsedTime can
// measure between. Default-constructed it holds none; an event never
// recorded counts as complete.
class cuda_event {
 public:
  cuda_event() = default;
  // On the calling thread's current device.
  static cuda_event create() { return make(cudaEventDisableTiming); }
  static cuda_event create_timed() { return make(cudaEventDefault); }
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
  static cuda_event make(unsigned flags) {
    cuda_event e;
    TF_CUDA_CHECK(cudaEventCreateWithFlags(&e.event_, flags),
                  error_context{"cudaEventCreateWithFlags"}.in_tier("device"));
    return e;
  }
  void reset() noexcept {
    if (!event_) return;
    if (const cudaError_t rc = cudaEventDestroy(std::exchange(event_, nullptr)); rc != cudaSuccess)
      warn_cuda("cudaEventDestroy", rc);
  }
  cudaEvent_t event_ = nullptr;
};

// Makes `device` current on the calling thread for a scope and restores the
// thread's previous device after: the trainer's thread and the engine's
// CPU-step thread may be set to another device by the program.
class cuda_device_scope {
 public:
  explicit cuda_device_scope(int device) {
    TF_CUDA_CHECK(cudaGetDevice(&previous_), error_context{"cudaGetDevice"}.in_tier("device"));
    if (previous_ != device) {
      TF_CUDA_CHECK(cudaSetDevice(device), error_context{"cudaSetDevice"}.in_tier("device"));
      changed_ = true;
    }
  }
  ~cuda_device_scope() {
    if (!changed_) return;
    if (const cudaError_t rc = cudaSetDevice(previous_); rc != cudaSuccess) warn_cuda("cudaSetDevice", rc);
  }
  cuda_device_scope(const cuda_device_scope&) = delete;
  cuda_device_scope& operator=(const cuda_device_scope&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Page-locked host memory (cudaMallocHost): copies from and to it are DMA,
// truly asynchronous with respect to the host.
class cuda_pinned_buffer {
 public:
  cuda_pinned_buffer() = default;
  cuda_pinned_buffer(cuda_pinned_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  cuda_pinned_buffer& operator=(cuda_pinned_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~cuda_pinned_buffer() { reset(); }

  // Makes the buffer at least `bytes` long; its contents are lost when it
  // grows. No copy from or to it may be in flight.
  void reserve(std::size_t bytes, const char* what) {
    if (bytes <= bytes_) return;
    const std::size_t grown = std::max(bytes, bytes_ + bytes_ / 2);
    reset();
    TF_CUDA_CHECK(cudaMallocHost(&data_, grown),
                  error_context{"cudaMallocHost"}.in_tier("device").of_block(what).range(0, grown));
    bytes_ = grown;
  }
  std::byte* data() const noexcept { return static_cast<std::byte*>(data_); }
  std::size_t size() const noexcept { return bytes_; }

 private:
  void reset() noexcept {
    if (!data_) return;
    if (const cudaError_t rc = cudaFreeHost(std::exchange(data_, nullptr)); rc != cudaSuccess)
      warn_cuda("cudaFreeHost", rc);
    bytes_ = 0;
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Device memory from cudaMalloc, or stream-ordered from cudaMallocAsync
// (freed with cudaFreeAsync on the same stream, after the work enqueued there).
class cuda_device_memory {
 public:
  cuda_device_memory() = default;
  static cuda_device_memory allocate(std::size_t bytes, const error_context& context) {
    cuda_device_memory m;
    if (bytes == 0) return m;
    TF_CUDA_CHECK(cudaMalloc(&m.data_, bytes), error_context(context).range(0, bytes));
    return m;
  }
  static cuda_device_memory allocate_async(std::size_t bytes, cudaStream_t stream, const error_context& context) {
    cuda_device_memory m;
    if (bytes == 0) return m;
    TF_CUDA_CHECK(cudaMallocAsync(&m.data_, bytes, stream), error_context(context).range(0, bytes));
    m.stream_ = stream;
    m.async_ = true;
    return m;
  }
  cuda_device_memory(cuda_device_memory&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), stream_(o.stream_), async_(o.async_) {}
  cuda_device_memory& operator=(cuda_device_memory&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      stream_ = o.stream_;
      async_ = o.async_;
    }
    return *this;
  }
  ~cuda_device_memory() { reset(); }
  void* get() const noexcept { return data_; }

 private:
  void reset() noexcept {
    if (!data_) return;
    void* p = std::exchange(data_, nullptr);
    const cudaError_t rc = async_ ? cudaFreeAsync(p, stream_) : cudaFree(p);
    if (rc != cudaSuccess) warn_cuda(async_ ? "cudaFreeAsync" : "cudaFree", rc);
  }
  void* data_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool async_ = false;
};

}  // namespace tierflow
