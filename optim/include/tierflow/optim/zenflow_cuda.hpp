// ZenFlow's device side on a CUDA GPU: the engine's zenflow::device_side over
// the trainer's own parameter and gradient tensors in device memory.
//
// The device keeps, per weight, the fp32 master values and the Adam moments
// of the columns it owns (the engine's selection; all of a 1-D weight),
// packed column after column in ascending column order, and updates them
// every step with Adam or AdamW, writing the result into the trainer's
// compute copy. It is the stand-in device (core's standin_device) on a GPU,
// with the same semantics, and its arithmetic per element is adam_optimizer's
// (bit-identical to its FMA SIMD paths).
//
// Adam/AdamW only: Muon's whole-matrix rule (granularity::matrix) is not run
// here, and amsgrad is refused. The engine's update_rule must apply the same
// Adam on the host side.
//
// Gradients and streams, for a trainer that overlaps the host's part of a
// step with the next forward (engine::update_device()):
//
//   backward(t) on the trainer's stream, into gradient buffer t % 2
//   device.gradients_ready(buffers[t % 2])  the gradients' trip down starts,
//                                           on the device's own D2H stream
//   engine.update_device()                  Adam on the owned columns, on the
//                                           trainer's stream
//   forward(t+1) [+ backward(t+1) into buffer (t+1) % 2], unless
//                engine.device_waits_for_step()
//   engine.step()                           waits only for the downloads
//
// The downloads and the column scores run on streams of their own that wait
// for the gradients (an event), not for what the trainer enqueued after
// them, so they never queue behind the next forward. Two gradient buffers
// (or any per-step pointers) let the next backward run while the host still
// reads this step's: a step's gradients must stay unchanged until the
// step() that reads them has returned. Without gradients_ready() the
// gradients are the constructor's, each download waits for all the work on
// the trainer's stream so far, and nothing is fetched ahead.
//
// Threads: everything runs on the trainer's thread, except stage_upload(),
// which the engine calls from its CPU-step thread and which uses a stream, a
// pinned buffer and a staging area of its own. The downloaded bf16/fp16
// gradients are widened to fp32 on a thread pool of host_cpus.size()
// threads. column_importance(), download_gradient(), initialize() and
// hand_over() return host data, so they wait for what they need;
// update_owned(), apply_staged() and gradients_ready() only enqueue.
//
// Needs a CUDA build of tierflow; elsewhere the constructor throws user_error.
// This header does not include the CUDA runtime's.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tierflow/core/dtype.hpp"
#include "tierflow/core/zenflow/engine.hpp"
#include "tierflow/optim/adam.hpp"

namespace tierflow::optim {

// One weight as the trainer holds it on the device. Layout of both: the
// weight's flat buffer, a 2-D weight stored transposed (column c is elements
// [c·rows, (c+1)·rows)), rows·cols elements.
struct cuda_zenflow_weight {
  void* parameters = nullptr;      // the compute copy, options.compute_type, written by the device side
  // The gradient, options.grad_type, written by the backward: the one every
  // step uses unless gradients_ready() names another; null when it always does.
  const void* gradient = nullptr;
};

struct cuda_zenflow_options {
  int device = 0;                    // the CUDA device the tensors live on
  dtype compute_type = dtype::bf16;  // of the compute copies: fp32, bf16 or fp16
  dtype grad_type = dtype::bf16;     // of the gradients: fp32, bf16 or fp16
  adam_options adam;                 // amsgrad must be off
  // The trainer's compute stream (a cudaStream_t), which produces the
  // gradients and consumes the parameters; 0 is the legacy default stream.
  // It must outlive the device object.
  std::uintptr_t stream = 0;
  // The CPUs the threads that widen downloaded gradients run on, one thread
  // pinned to each (the trainer's share: core_split::trainer); empty: the
  // CPUs the constructing thread may run on.
  std::vector<int> host_cpus;
};

// Bytes the device side has copied over the host link, each way.
struct cuda_zenflow_traffic {
  std::uint64_t device_to_host = 0;
  std::uint64_t host_to_device = 0;
};

class cuda_zenflow_device final : public zenflow::device_side {
 public:
  // `weights` and `tensors` in the engine's weight order. Allocates the device
  // state (the 1-D weights' masters and moments, a staging copy of each 2-D
  // weight in compute_type) and the pinned buffers. Throws user_error for bad
  // arguments (sizes that differ, an empty shape, a null, misaligned or
  // non-device pointer, an unknown dtype, amsgrad, an invalid Adam
  // hyper-parameter, a device index out of range, a CPU in host_cpus this
  // process may not run on) and in a build without
  // CUDA; tierflow::error for a failed CUDA call (no driver, no device, out of
  // memory), naming the call and the weight.
  cuda_zenflow_device(const std::vector<zenflow::weight_shape>& weights, std::vector<cuda_zenflow_weight> tensors,
                      const cuda_zenflow_options& options);
  // Waits for this object's work on both streams, then frees what it holds.
  // Never throws: failures are logged to stderr.
  ~cuda_zenflow_device() override;
  cuda_zenflow_device(const cuda_zenflow_device&) = delete;
  cuda_zenflow_device& operator=(const cuda_zenflow_device&) = delete;

  // Sets weight `w`'s initial fp32 master: written, converted, into its
  // compute copy, and for a 1-D weight (which the device owns from the start)
  // also kept as the device's master with zero moments. The host_state's
  // master must start from the same values. Throws user_error for a wrong
  // index or size.
  void initialize(std::size_t w, std::span<const float> master);

  // The columns whose master and moments the device holds, ascending: the
  // engine's selected(w) after every step.
  std::span<const std::uint32_t> owned_columns(std::size_t w) const;

  // This step's gradients: gradients[w] for weight w, options.grad_type,
  // device memory, complete once the work enqueued on the trainer's stream
  // before this call has run. Call once per step, after its backward is
  // enqueued and before update_device() or step(); starts downloading the
  // gradients the host will accumulate, on the device's D2H stream. The
  // pointers serve until the next call. Throws user_error for a wrong
  // count, a null, misaligned or non-device pointer.
  void gradients_ready(std::span<const void* const> gradients);
  // The same with the constructor's gradients (each weight's `gradient`).
  void gradients_ready();

  // Adds this step's gradient of matrix `w` over the columns in `runs`
  // (ascending) into `sum` (fp32, the whole weight): the download and the
  // widening fused into one pass over the pinned copy, on the host threads.
  // The same values as adding download_gradient(w) by hand; ends the span
  // download_gradient() returned last. Returns true: it did the work (the
  // answer of a device side that offers this fused path to the engine).
  bool accumulate_gradient(std::size_t w, std::span<const zenflow::column_run> runs,
                           std::span<float> sum) override;

  // The Adam hyper-parameters of the next update_owned() calls (an LR
  // schedule changing lr between steps). Trainer's thread. Throws
  // user_error as the constructor does for bad values or amsgrad; nothing
  // changes then.
  void set_adam(const adam_options& adam);

  // Every copy so far, counted when it is enqueued.
  cuda_zenflow_traffic traffic() const;

  // zenflow::device_side. download_gradient()'s span is valid until the next
  // download_gradient() call for any weight (one buffer serves them all: the
  // engine adds each weight's gradient up before it asks for the next).
  void column_importance(std::size_t w, zenflow::importance_norm norm, std::span<float> out) override;
  void update_owned(std::size_t w, std::int64_t step) override;
  std::span<const float> download_gradient(std::size_t w) override;
  void stage_upload(std::size_t w, std::span<const zenflow::column_run> runs,
                    std::span<const float> master) override;
  void apply_staged(std::size_t w, std::span<const zenflow::column_run> runs) override;
  void hand_over(std::size_t w, std::span<const std::uint32_t> selected, const zenflow::packed_columns& entering,
                 const zenflow::packed_columns& leaving) override;
  // For checkpoints: the owned columns' master and moments brought down
  // (read_owned) or sent up, with their compute copy rewritten from the
  // master (write_owned); both wait for the trainer's stream.
  bool read_owned(std::size_t w, const zenflow::packed_columns& out) override;
  bool write_owned(std::size_t w, const zenflow::packed_columns& in) override;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace tierflow::optim
