// What the bindings of collectives/'s communicators share, whatever memory
// they move: the Python store the ranks meet through, the reduction's name,
// and one bound communicator over the buffer types of its memory (CPU
// buffers for Gloo in tierflow._core, CUDA ones for NCCL in tierflow._nccl).
#pragma once

#include <cstddef>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "tierflow/collectives/communicator.hpp"
#include "tierflow/collectives/rendezvous.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::python {

// A Python store (set(key, bytes), get(key) -> bytes, blocking until set).
// The communicator keeps it, and may drop it on a thread without the GIL
// (close() waits for the collectives with the GIL released): the reference
// is dropped with the GIL taken.
class python_store final : public collectives::rendezvous_store {
 public:
  python_store(nanobind::object store, std::string owner) : store_(std::move(store)), owner_(std::move(owner)) {}
  python_store(const python_store&) = delete;
  python_store& operator=(const python_store&) = delete;
  ~python_store() override {
    if (!Py_IsInitialized()) {
      (void)store_.release();  // the interpreter is gone: nothing left to free it in
      return;
    }
    nanobind::gil_scoped_acquire gil;
    store_.reset();
  }

  void set(const std::string& key, const std::vector<char>& value) override {
    nanobind::gil_scoped_acquire gil;
    store_.attr("set")(key, nanobind::bytes(value.data(), value.size()));
  }

  std::vector<char> get(const std::string& key) override {
    nanobind::gil_scoped_acquire gil;
    nanobind::object value = store_.attr("get")(key);
    if (!nanobind::isinstance<nanobind::bytes>(value))
      throw user_error(owner_ + ": the store's get('" + key + "') did not give bytes");
    auto bytes = nanobind::borrow<nanobind::bytes>(value);
    const char* data = bytes.c_str();
    return {data, data + bytes.size()};
  }

 private:
  nanobind::object store_;
  std::string owner_;  // who asks, for the error: "GlooCommunicator"
};

inline collectives::reduce_op parse_op(const std::string& op) {
  if (op == "sum") return collectives::reduce_op::sum;
  if (op == "max") return collectives::reduce_op::max;
  if (op == "min") return collectives::reduce_op::min;
  throw user_error("op: '" + op + "' is not 'sum', 'max' or 'min'");
}

// The completion of a collective over `In` and `Out` buffers (or of a
// Lease.copy_into), holding them until it is done. Dropped unfinished, it
// waits first: what it runs still reads and writes its buffers.
template <class In, class Out>
struct basic_work {
  collectives::work_ptr work;
  std::optional<In> in;  // (the views hold the tensors they came from)
  std::optional<Out> out;

  basic_work(collectives::work_ptr w, std::optional<In> i, std::optional<Out> o)
      : work(std::move(w)), in(std::move(i)), out(std::move(o)) {}
  basic_work(basic_work&& other) noexcept
      : work(std::move(other.work)), in(std::move(other.in)), out(std::move(other.out)) {}
  basic_work(const basic_work&) = delete;
  basic_work& operator=(const basic_work&) = delete;
  basic_work& operator=(basic_work&&) = delete;
  ~basic_work() {
    if (work && !work->done()) {
      nanobind::gil_scoped_release unlocked;
      try {
        work->wait();
      } catch (...) {  // (its error was for wait() to raise; dropped unwaited, it goes with it)
      }
    }
  }

  void wait() {
    {
      nanobind::gil_scoped_release unlocked;
      work->wait();
    }
    in.reset();
    out.reset();
  }
  bool done() const { return work->done(); }
};

// A communicator bound for Python over buffers of types `In` (read) and
// `Out` (written): the checks on the tensors, the collectives, close().
// `name` ("GlooCommunicator") opens its errors.
template <class In, class Out>
class bound_communicator {
 public:
  using work_type = basic_work<In, Out>;

  bound_communicator(std::unique_ptr<collectives::communicator> comm, std::string name)
      : comm_(std::move(comm)), name_(std::move(name)) {}
  bound_communicator(const bound_communicator&) = delete;
  bound_communicator& operator=(const bound_communicator&) = delete;
  ~bound_communicator() { close(); }

  collectives::communicator& comm() {
    if (!comm_) throw user_error(name_ + ": closed");
    return *comm_;
  }

  work_type all_gather(const In& in, Out& out, const std::vector<std::size_t>& counts,
                       const collectives::work_ptr& after = nullptr) {
    collectives::communicator& c = comm();
    const dtype t = same_type(in, out, "all_gather");
    check_counts(counts, in.size(), out.size(), "all_gather", "input", "output");
    auto w = after ? c.all_gather_after(after, in.data(), out.data(), counts, t)
                   : c.all_gather(in.data(), out.data(), counts, t);
    return {std::move(w), in, out};
  }

  // `in`'s elements into `out` at `stride` a rank: `out` holds from this
  // chunk's piece of rank 0's shard to the end of the last rank's.
  work_type all_gather_strided(const In& in, Out& out, std::size_t stride,
                               const collectives::work_ptr& after = nullptr) {
    collectives::communicator& c = comm();
    const dtype t = same_type(in, out, "all_gather_strided");
    const std::size_t count = in.size(), need = (c.size() - 1) * stride + count;
    if (count != 0 && out.size() < need)
      throw user_error("all_gather_strided: the output has " + std::to_string(out.size()) + " elements, " +
                       std::to_string(c.size()) + " ranks' " + std::to_string(count) + " at a stride of " +
                       std::to_string(stride) + " need " + std::to_string(need));
    auto w = c.all_gather_strided(after, in.data(), out.data(), count, stride, t);
    return {std::move(w), in, out};
  }

  work_type reduce_scatter(const In& in, Out& out, const std::vector<std::size_t>& counts, const std::string& op) {
    collectives::communicator& c = comm();
    const dtype t = same_type(in, out, "reduce_scatter");
    check_counts(counts, out.size(), in.size(), "reduce_scatter", "output", "input");
    auto w = c.reduce_scatter(in.data(), out.data(), counts, t, parse_op(op));
    return {std::move(w), in, out};
  }

  work_type all_reduce(Out& tensor, const std::string& op) {
    collectives::communicator& c = comm();
    auto w = c.all_reduce(tensor.data(), tensor.size(), element_type(tensor, "all_reduce: tensor"), parse_op(op));
    return {std::move(w), std::nullopt, tensor};
  }

  work_type broadcast(Out& tensor, int root) {
    collectives::communicator& c = comm();
    auto w = c.broadcast(tensor.data(), tensor.size(), element_type(tensor, "broadcast: tensor"), root);
    return {std::move(w), std::nullopt, tensor};
  }

  void close() {
    if (!comm_) return;
    nanobind::gil_scoped_release unlocked;  // (waits for the collectives under way)
    comm_.reset();
  }

  int rank() { return comm().rank(); }
  int size() { return comm().size(); }

 private:
  static dtype same_type(const In& in, const Out& out, const std::string& what) {
    const dtype a = element_type(in, what + ": input"), b = element_type(out, what + ": output");
    if (a != b)
      throw user_error(what + ": the input is " + std::string(name(a)) + ", the output " + std::string(name(b)));
    return a;
  }

  void check_counts(const std::vector<std::size_t>& counts, std::size_t mine, std::size_t whole,
                    const std::string& what, const char* mine_name, const char* whole_name) {
    collectives::communicator& c = comm();
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

  std::unique_ptr<collectives::communicator> comm_;
  std::string name_;
};

// all_gather_strided's docstring, the same for every communicator.
inline constexpr const char* strided_doc =
    "`output[r * stride:][:len(input)]` becomes rank r's `input` (as many elements on every rank),\n"
    "what lies between left alone: one chunk of each rank's shard gathered into its place in the\n"
    "full tensor (`output` starts at rank 0's piece). In place when `input` is this rank's piece.";

// Binds a basic_work as `name`: wait() and done, `doc` and `wait_doc` its words.
template <class Work>
void bind_work(nanobind::module_& m, const char* name, const char* doc, const char* wait_doc) {
  nanobind::class_<Work>(m, name, doc)
      .def("wait", &Work::wait, wait_doc)
      .def_prop_ro("done", &Work::done, "Whether it has finished, done or failed; never blocks.");
}

// Binds what every bound communicator has beside its constructor and its
// all_gather (whose options differ): rank, size, reduce_scatter,
// all_reduce, broadcast and close.
template <class Communicator>
void bind_collectives_of(nanobind::class_<Communicator>& c) {
  using namespace nanobind::literals;
  c.def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("size", &Communicator::size)
      .def("reduce_scatter", &Communicator::reduce_scatter, "input"_a, "output"_a, "counts"_a, "op"_a = "sum",
           "`output` (counts[rank] elements) becomes the reduction ('sum', 'max', 'min') over the\n"
           "ranks of their `input` (sum(counts) elements)'s slice for this rank.")
      .def("all_reduce", &Communicator::all_reduce, "tensor"_a, "op"_a = "sum",
           "`tensor` becomes the reduction ('sum', 'max', 'min') over the ranks of theirs.")
      .def("broadcast", &Communicator::broadcast, "tensor"_a, "root"_a, "`tensor` becomes the root's on every rank.")
      .def("close", &Communicator::close,
           "Waits for the collectives under way and leaves the group. Idempotent; a collective\n"
           "after it raises ValueError.");
}

}  // namespace tierflow::python
