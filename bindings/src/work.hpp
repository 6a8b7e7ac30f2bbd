// tierflow._core.Work: the completion of something running off the
// caller's thread — a collective, or a Lease.copy_into read — and the
// buffers it uses, kept alive until it is done.
#pragma once

#include <optional>
#include <utility>

#include <nanobind/nanobind.h>

#include "arrays.hpp"
#include "tierflow/collectives/communicator.hpp"

namespace tierflow::python {

// A Work dropped before it is done waits for it first: what it runs still
// reads and writes its buffers.
struct py_work {
  collectives::work_ptr work;
  std::optional<const_buffer> in;  // (the views hold the tensors they came from)
  std::optional<buffer> out;

  py_work(collectives::work_ptr w, std::optional<const_buffer> i, std::optional<buffer> o)
      : work(std::move(w)), in(std::move(i)), out(std::move(o)) {}
  py_work(py_work&& other) noexcept
      : work(std::move(other.work)), in(std::move(other.in)), out(std::move(other.out)) {}
  py_work(const py_work&) = delete;
  py_work& operator=(const py_work&) = delete;
  py_work& operator=(py_work&&) = delete;
  ~py_work() {
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

}  // namespace tierflow::python
