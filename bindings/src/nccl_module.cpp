// tierflow._nccl: collectives/'s NCCL communicator over CUDA tensors, in a
// module of its own. It links the NCCL of the torch it is installed beside
// (the nvidia-nccl wheel's libnccl.so.2, by its soname), so a process that
// imports torch and tierflow loads one NCCL; tierflow._core links none.
// Built without NCCL (no CUDA toolkit at build time), the module imports
// and says so: `available` is False and NcclCommunicator raises TierflowError.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.hpp"
#include "communicators.hpp"
#include "tierflow/collectives/nccl.hpp"
#include "tierflow/core/error.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {
namespace {

namespace tc = tierflow::collectives;

// C-contiguous CUDA tensors (DLPack views, as CPU ones elsewhere).
using device_buffer = nb::ndarray<nb::device::cuda, nb::c_contig>;
using const_device_buffer = nb::ndarray<nb::ro, nb::device::cuda, nb::c_contig>;
using nccl_work = basic_work<const_device_buffer, device_buffer>;

class nccl_binding : public bound_communicator<const_device_buffer, device_buffer> {
 public:
  nccl_binding(std::unique_ptr<tc::nccl_communicator> comm, std::shared_ptr<tc::ce_telemetry> telemetry)
      : bound_communicator(std::move(comm), "NcclCommunicator"), telemetry_(std::move(telemetry)) {}

  tc::nccl_communicator& nccl() { return static_cast<tc::nccl_communicator&>(comm()); }  // (raises once closed)

  std::uintptr_t stream() { return reinterpret_cast<std::uintptr_t>(nccl().stream()); }
  // `waiter` waits on the GPU for `w`; the host goes on (see nccl.hpp).
  void stream_wait(const nccl_work& w, std::uintptr_t waiter) {
    if (!w.work) throw user_error("NcclCommunicator.stream_wait: the work was moved from");
    nccl().stream_wait(w.work, reinterpret_cast<CUstream_st*>(waiter));
  }
  int device() { return nccl().device(); }
  std::string policy() {
    switch (nccl().policy()) {
      case tc::cta_policy::efficiency: return "efficiency";
      case tc::cta_policy::zero: return "zero";
      case tc::cta_policy::standard: break;
    }
    return "standard";
  }
  // The fallbacks the communicator counted: the copy-engine policy asked of
  // an NCCL without it, a window NCCL refused.
  nb::dict fallbacks() const {
    const tc::ce_telemetry::counts c = telemetry_->snapshot();
    nb::dict d;
    d["zero_cta_unsupported"] = c.zero_cta_unsupported;
    d["window_registration_failed"] = c.window_registration_failed;
    return d;
  }

 private:
  std::shared_ptr<tc::ce_telemetry> telemetry_;
};

tc::cta_policy parse_policy(const std::string& p) {
  if (p == "standard") return tc::cta_policy::standard;
  if (p == "efficiency") return tc::cta_policy::efficiency;
  if (p == "zero") return tc::cta_policy::zero;
  throw user_error("policy: '" + p + "' is not 'standard', 'efficiency' or 'zero'");
}

// Makes `self` an NCCL communicator joining the group (nanobind's __init__).
void join(nccl_binding* self, int rank, int size, int device, nb::object store, const std::string& prefix,
          double timeout, const std::string& policy, std::uintptr_t stream) {
  if (!(timeout > 0))
    throw user_error("NcclCommunicator: timeout " + std::to_string(timeout) + " s is not positive");
  tc::nccl_options options;
  options.rank = rank;
  options.size = size;
  options.device = device;
  if (!store.is_none()) options.store = std::make_shared<python_store>(store, "NcclCommunicator");
  options.prefix = prefix;
  options.timeout = std::chrono::milliseconds(static_cast<long long>(timeout * 1000.0));
  options.policy = parse_policy(policy);
  options.stream = reinterpret_cast<CUstream_st*>(stream);
  options.telemetry = std::make_shared<tc::ce_telemetry>();
  std::unique_ptr<tc::nccl_communicator> comm;
  {
    nb::gil_scoped_release unlocked;  // the rendezvous waits on the other ranks; the store takes the GIL
    comm = tc::make_nccl_communicator(options);
  }
  new (self) nccl_binding(std::move(comm), options.telemetry);
}

}  // namespace
}  // namespace tierflow::python

NB_MODULE(_nccl, m) {
  using namespace tierflow::python;
  register_errors(m);
  m.doc() = "tierflow's NCCL communicator over CUDA tensors: one GPU a rank, between processes or nodes.";
  m.attr("available") = tierflow::collectives::nccl_version() != 0;
  m.def("version", &tierflow::collectives::nccl_version,
        "The runtime NCCL's version as NCCL_VERSION_CODE writes it (23007 for 2.30.7); 0 when built\n"
        "without NCCL.");

  bind_work<nccl_work>(m, "NcclWork",
      "The completion of one NCCL collective on this rank: an event on the communicator's stream\n"
      "(keeps its tensors alive; dropped unfinished, it waits first).",
      "Blocks (the GIL released) until the collective has run on the GPU; raises TierflowError\n"
      "naming the rank, the collective and NCCL's words if it failed or passed the timeout.");

  nb::class_<nccl_binding> nccl(
      m, "NcclCommunicator",
      "Collectives over CUDA tensors between the ranks of a group, one GPU a rank, on NCCL.\n"
      "Every rank issues the same collectives in the same order; each is enqueued on the\n"
      "communicator's `stream` at once and returns an NcclWork. Order the tensors' producers\n"
      "before it (make `stream` wait for them) and their readers after it. Tensors are\n"
      "C-contiguous CUDA tensors of float32, bfloat16 or float16 on `device`. A failed or\n"
      "timed-out collective aborts NCCL's communicator and breaks this one: every pending and\n"
      "later collective fails with its error. The ranks meet through `store`\n"
      "(torch.distributed's TCPStore, or anything with set(key, bytes) and a blocking get(key);\n"
      "None for a group of one), where rank 0 puts NCCL's unique id under `prefix`.");
  nccl.def("__init__", &join, "rank"_a, "size"_a, "device"_a, nb::kw_only(), "store"_a = nb::none(),
           "prefix"_a = "tierflow", "timeout"_a = 60.0, "policy"_a = "standard", "stream"_a = 0,
           "Joins the group (blocks until every rank has, or raises TierflowError after `timeout`\n"
           "seconds). policy: NCCL's CTA policy, 'standard', 'efficiency' or 'zero' (copy engines\n"
           "where NCCL 2.28.3+ has them; the default policy on older ones). stream: a CUDA stream's\n"
           "handle (torch.cuda.Stream.cuda_stream) to enqueue on, 0 for a stream of its own.")
      .def_prop_ro("device", &nccl_binding::device, "The CUDA device this rank runs on.")
      .def_prop_ro("stream", &nccl_binding::stream,
                   "The handle of the CUDA stream every collective is enqueued on\n"
                   "(torch.cuda.ExternalStream(stream) orders torch's work against it).")
      .def_prop_ro("policy", &nccl_binding::policy,
                   "The CTA policy NCCL was given: 'zero' only where it was asked for and NCCL has it.")
      .def_prop_ro("fallbacks", &nccl_binding::fallbacks,
                   "{'zero_cta_unsupported', 'window_registration_failed'}: how often this communicator\n"
                   "fell back from the copy engines (the policy 'zero' asked of an NCCL without it).")
      .def("stream_wait", &nccl_binding::stream_wait, "work"_a, "stream"_a,
           "Makes the CUDA stream whose handle is `stream` (torch.cuda.Stream.cuda_stream) wait on\n"
           "the GPU for `work`, one of this communicator's, without blocking the host: what is\n"
           "enqueued on `stream` afterwards runs after the collective (as torch.distributed's NCCL\n"
           "Work.wait()). Keep `work` until it is done: it holds the tensors. A collective that fails\n"
           "later (NCCL's error, or the timeout, which a watchdog thread enforces whether anyone\n"
           "waits or not) breaks the communicator and ends NCCL's kernels, so `stream` goes on\n"
           "behind a collective that did not complete: call work.wait() before reading results on\n"
           "the host. Raises TierflowError where `work` has already failed.")
      .def("all_gather",
           [](nccl_binding& c, const const_device_buffer& in, device_buffer& out,
              const std::vector<std::size_t>& counts) { return c.all_gather(in, out, counts); },
           "input"_a, "output"_a, "counts"_a,
           "`output` (sum(counts) elements) becomes every rank's `input` (counts[rank] elements)\n"
           "in rank order; counts may be uneven (one broadcast a rank) and 0.")
      .def("all_gather_strided",
           [](nccl_binding& c, const const_device_buffer& in, device_buffer& out, std::size_t stride) {
             return c.all_gather_strided(in, out, stride);
           },
           "input"_a, "output"_a, "stride"_a, strided_doc);
  bind_collectives_of(nccl);
}
