// GlooCommunicator and Work: collectives/'s Gloo communicator over CPU
// buffers handed in as DLPack views (torch tensors, NumPy arrays), the ranks
// meeting through a store the trainer already has (torch.distributed's
// TCPStore: anything with set(key, value) and a blocking get(key)) or a
// directory.
#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "work.hpp"
#include "tierflow/collectives/gloo.hpp"
#include "tierflow/core/error.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {
namespace {

namespace tc = tierflow::collectives;

using gloo_communicator = bound_communicator<const_buffer, buffer>;

// Makes `self` a Gloo communicator joining the group (nanobind's __init__).
void join(gloo_communicator* self, int rank, int size, std::optional<nb::object> store,
          std::optional<std::string> store_dir, const std::string& prefix, const std::string& hostname,
          double timeout) {
  if (store.has_value() == store_dir.has_value())
    throw user_error("GlooCommunicator: give exactly one of store (torch.distributed's, say) and store_dir");
  if (!(timeout > 0))
    throw user_error("GlooCommunicator: timeout " + std::to_string(timeout) + " s is not positive");
  tc::gloo_options options;
  options.prefix = prefix;
  options.hostname = hostname;
  options.timeout = std::chrono::milliseconds(static_cast<long long>(timeout * 1000.0));
  if (store) options.store = std::make_shared<python_store>(*store, "GlooCommunicator");
  if (store_dir) options.store_dir = *store_dir;
  std::unique_ptr<tc::communicator> comm;
  {
    nb::gil_scoped_release unlocked;  // the rendezvous waits on the other ranks; the store takes the GIL
    comm = tc::make_gloo_communicator(rank, size, options);
  }
  // (options, and the Python store in it, go here, with the GIL held)
  new (self) gloo_communicator(std::move(comm), "GlooCommunicator");
}

}  // namespace

void bind_collectives(nb::module_& m) {
  static const std::string gloo_strided_doc = std::string(strided_doc) + "\n`after`: as all_gather's.";
  bind_work<py_work>(m, "Work",
      "The completion of one collective on this rank, or of a Lease.copy_into (keeps its\n"
      "buffers alive; dropped unfinished, it waits first).",
      "Blocks (the GIL released) until it has finished; raises its error (TierflowError\n"
      "naming the rank and the collective, or the block and the file) if it failed.");

  nb::class_<gloo_communicator> gloo(
      m, "GlooCommunicator",
      "Collectives over CPU buffers between the ranks of a group, on Gloo's TCP transport.\n"
      "Every rank issues the same collectives in the same order; each returns a Work at once\n"
      "and they complete in issue order. Buffers are C-contiguous CPU tensors or arrays of\n"
      "float32, bfloat16 or float16, left alone until the Work is done. A failed collective\n"
      "(a peer died, `timeout` seconds passed) breaks the communicator: every pending and later\n"
      "collective fails too. The ranks meet through `store` (torch.distributed's TCPStore, or\n"
      "anything with set(key, bytes) and a blocking get(key)) or the directory `store_dir`.");
  gloo.def("__init__", &join,
           "rank"_a, "size"_a, nb::kw_only(), "store"_a = nb::none(), "store_dir"_a = nb::none(),
           "prefix"_a = "tierflow", "hostname"_a = "127.0.0.1", "timeout"_a = 60.0,
           "Joins the group (blocks until every rank has). `prefix`: the keys' prefix in the store,\n"
           "one per communicator; `hostname`: the address this rank listens on.")
      .def("all_gather",
           [](gloo_communicator& c, const const_buffer& in, buffer& out, const std::vector<std::size_t>& counts,
              const py_work* after) { return c.all_gather(in, out, counts, after ? after->work : nullptr); },
           "input"_a, "output"_a, "counts"_a, nb::kw_only(),
           "after"_a = nb::none(),
           "`output` (sum(counts) elements) becomes every rank's `input` (counts[rank] elements)\n"
           "in rank order; counts may be uneven and 0. `after`: a Work (Lease.copy_into's read of\n"
           "the input, say) the gather waits for on the communicator's thread before it starts,\n"
           "so it can be issued now; when that fails, the gather fails with its error and the\n"
           "communicator is broken.")
      .def("all_gather_strided",
           [](gloo_communicator& c, const const_buffer& in, buffer& out, std::size_t stride, const py_work* after) {
             return c.all_gather_strided(in, out, stride, after ? after->work : nullptr);
           },
           "input"_a, "output"_a, "stride"_a, nb::kw_only(), "after"_a = nb::none(),
           gloo_strided_doc.c_str());
  bind_collectives_of(gloo);
}

}  // namespace tierflow::python
