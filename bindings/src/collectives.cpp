// GlooCommunicator and Work: collectives/'s Gloo communicator over CPU
// buffers handed in as DLPack views (torch tensors, NumPy arrays), the ranks
// meeting through a store the trainer already has (torch.distributed's
// TCPStore: anything with set(key, value) and a blocking get(key)) or a
// directory.
#include <chrono>
#include <cstddef>
#include <memory>
#include <numeric>
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

// A Python store (set(key, bytes), get(key) -> bytes, blocking until set).
// The communicator keeps it, and may drop it on a thread without the GIL
// (close() waits for the collectives with the GIL released): the reference
// is dropped with the GIL taken.
class python_store final : public tc::rendezvous_store {
 public:
  explicit python_store(nb::object store) : store_(std::move(store)) {}
  python_store(const python_store&) = delete;
  python_store& operator=(const python_store&) = delete;
  ~python_store() override {
    if (!Py_IsInitialized()) {
      (void)store_.release();  // the interpreter is gone: nothing left to free it in
      return;
    }
    nb::gil_scoped_acquire gil;
    store_.reset();
  }

  void set(const std::string& key, const std::vector<char>& value) override {
    nb::gil_scoped_acquire gil;
    store_.attr("set")(key, nb::bytes(value.data(), value.size()));
  }

  std::vector<char> get(const std::string& key) override {
    nb::gil_scoped_acquire gil;
    nb::object value = store_.attr("get")(key);
    if (!nb::isinstance<nb::bytes>(value))
      throw user_error("GlooCommunicator: the store's get('" + key + "') did not give bytes");
    auto bytes = nb::borrow<nb::bytes>(value);
    const char* data = bytes.c_str();
    return {data, data + bytes.size()};
  }

 private:
  nb::object store_;
};

tc::reduce_op parse_op(const std::string& op) {
  if (op == "sum") return tc::reduce_op::sum;
  if (op == "max") return tc::reduce_op::max;
  if (op == "min") return tc::reduce_op::min;
  throw user_error("op: '" + op + "' is not 'sum', 'max' or 'min'");
}

class py_communicator {
 public:
  py_communicator(int rank, int size, std::optional<nb::object> store, std::optional<std::string> store_dir,
                  const std::string& prefix, const std::string& hostname, double timeout) {
    if (store.has_value() == store_dir.has_value())
      throw user_error("GlooCommunicator: give exactly one of store (torch.distributed's, say) and store_dir");
    if (!(timeout > 0))
      throw user_error("GlooCommunicator: timeout " + std::to_string(timeout) + " s is not positive");
    tc::gloo_options options;
    options.prefix = prefix;
    options.hostname = hostname;
    options.timeout = std::chrono::milliseconds(static_cast<long long>(timeout * 1000.0));
    if (store) options.store = std::make_shared<python_store>(*store);
    if (store_dir) options.store_dir = *store_dir;
    {
      nb::gil_scoped_release unlocked;  // the rendezvous waits on the other ranks; the store takes the GIL
      comm_ = tc::make_gloo_communicator(rank, size, options);
    }
    // (options, and the Python store in it, go here, with the GIL held)
  }

  py_communicator(const py_communicator&) = delete;
  py_communicator& operator=(const py_communicator&) = delete;
  ~py_communicator() { close(); }

  tc::communicator& comm() {
    if (!comm_) throw user_error("GlooCommunicator: closed");
    return *comm_;
  }

  py_work all_gather(const const_buffer& in, buffer& out, const std::vector<std::size_t>& counts,
                     const py_work* after) {
    tc::communicator& c = comm();
    const dtype t = same_type(in, out, "all_gather");
    check_counts(counts, in.size(), out.size(), "all_gather", "input", "output");
    auto w = after != nullptr ? c.all_gather_after(after->work, in.data(), out.data(), counts, t)
                              : c.all_gather(in.data(), out.data(), counts, t);
    return {std::move(w), in, out};
  }

  py_work reduce_scatter(const const_buffer& in, buffer& out, const std::vector<std::size_t>& counts,
                         const std::string& op) {
    tc::communicator& c = comm();
    const dtype t = same_type(in, out, "reduce_scatter");
    check_counts(counts, out.size(), in.size(), "reduce_scatter", "output", "input");
    auto w = c.reduce_scatter(in.data(), out.data(), counts, t, parse_op(op));
    return {std::move(w), in, out};
  }

  py_work all_reduce(buffer& tensor, const std::string& op) {
    tc::communicator& c = comm();
    auto w = c.all_reduce(tensor.data(), tensor.size(), element_type(tensor, "all_reduce: tensor"), parse_op(op));
    return {std::move(w), std::nullopt, tensor};
  }

  py_work broadcast(buffer& tensor, int root) {
    tc::communicator& c = comm();
    auto w = c.broadcast(tensor.data(), tensor.size(), element_type(tensor, "broadcast: tensor"), root);
    return {std::move(w), std::nullopt, tensor};
  }

  void close() {
    if (!comm_) return;
    nb::gil_scoped_release unlocked;  // (waits for the collectives under way)
    comm_.reset();
  }

  int rank() { return comm().rank(); }
  int size() { return comm().size(); }

 private:
  static dtype same_type(const const_buffer& in, const buffer& out, const std::string& what) {
    const dtype a = element_type(in, what + ": input"), b = element_type(out, what + ": output");
    if (a != b)
      throw user_error(what + ": the input is " + std::string(name(a)) + ", the output " + std::string(name(b)));
    return a;
  }

  void check_counts(const std::vector<std::size_t>& counts, std::size_t mine, std::size_t whole,
                    const std::string& what, const char* mine_name, const char* whole_name) {
    tc::communicator& c = comm();
    if (counts.size() != static_cast<std::size_t>(c.size()))
      throw user_error(what + ": " + std::to_string(counts.size()) + " counts for " + std::to_string(c.size()) +
                       " ranks");
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    if (mine != counts[c.rank()])
      throw user_error(what + ": the " + mine_name + " has " + std::to_string(mine) + " elements, counts[" +
                       std::to_string(c.rank()) + "] is " + std::to_string(counts[c.rank()]));
    if (whole != total)
      throw user_error(what + ": the " + whole_name + " has " + std::to_string(whole) +
                       " elements, the counts add up to " + std::to_string(total));
  }

  std::unique_ptr<tc::communicator> comm_;
};

}  // namespace

void bind_collectives(nb::module_& m) {
  nb::class_<py_work>(m, "Work",
      "The completion of one collective on this rank, or of a Lease.copy_into (keeps its\n"
      "buffers alive; dropped unfinished, it waits first).")
      .def("wait", &py_work::wait,
           "Blocks (the GIL released) until it has finished; raises its error (TierflowError\n"
           "naming the rank and the collective, or the block and the file) if it failed.")
      .def_prop_ro("done", &py_work::done, "Whether it has finished, done or failed; never blocks.");

  nb::class_<py_communicator>(
      m, "GlooCommunicator",
      "Collectives over CPU buffers between the ranks of a group, on Gloo's TCP transport.\n"
      "Every rank issues the same collectives in the same order; each returns a Work at once\n"
      "and they complete in issue order. Buffers are C-contiguous CPU tensors or arrays of\n"
      "float32, bfloat16 or float16, left alone until the Work is done. A failed collective\n"
      "(a peer died, `timeout` seconds passed) breaks the communicator: every pending and later\n"
      "collective fails too. The ranks meet through `store` (torch.distributed's TCPStore, or\n"
      "anything with set(key, bytes) and a blocking get(key)) or the directory `store_dir`.")
      .def(nb::init<int, int, std::optional<nb::object>, std::optional<std::string>, const std::string&,
                    const std::string&, double>(),
           "rank"_a, "size"_a, nb::kw_only(), "store"_a = nb::none(), "store_dir"_a = nb::none(),
           "prefix"_a = "tierflow", "hostname"_a = "127.0.0.1", "timeout"_a = 60.0,
           "Joins the group (blocks until every rank has). `prefix`: the keys' prefix in the store,\n"
           "one per communicator; `hostname`: the address this rank listens on.")
      .def_prop_ro("rank", &py_communicator::rank)
      .def_prop_ro("size", &py_communicator::size)
      .def("all_gather", &py_communicator::all_gather, "input"_a, "output"_a, "counts"_a, nb::kw_only(),
           "after"_a = nb::none(),
           "`output` (sum(counts) elements) becomes every rank's `input` (counts[rank] elements)\n"
           "in rank order; counts may be uneven and 0. `after`: a Work (Lease.copy_into's read of\n"
           "the input, say) the gather waits for on the communicator's thread before it starts,\n"
           "so it can be issued now; when that fails, the gather fails with its error and the\n"
           "communicator is broken.")
      .def("reduce_scatter", &py_communicator::reduce_scatter, "input"_a, "output"_a, "counts"_a, "op"_a = "sum",
           "`output` (counts[rank] elements) becomes the reduction ('sum', 'max', 'min') over the\n"
           "ranks of their `input` (sum(counts) elements)'s slice for this rank.")
      .def("all_reduce", &py_communicator::all_reduce, "tensor"_a, "op"_a = "sum",
           "`tensor` becomes the reduction ('sum', 'max', 'min') over the ranks of theirs.")
      .def("broadcast", &py_communicator::broadcast, "tensor"_a, "root"_a,
           "`tensor` becomes the root's on every rank.")
      .def("close", &py_communicator::close,
           "Waits for the collectives under way and leaves the group. Idempotent; a collective\n"
           "after it raises ValueError.");
}

}  // namespace tierflow::python
