// AioHandle: DeepSpeed's aio_handle (its async_io op's) calls over tierflow's
// I/O engine, for tierflow.deepspeed's handle. A request reads or writes a
// whole CPU buffer at an offset of a file named by path; wait() waits for
// every request in flight and reports the first failure by its file, offset
// and errno (a read past the end of a file is ENODATA, never short data; a
// full disk ENOSPC), after all of them have ended, so no buffer is in use
// when it raises.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "bindings.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/io/engine.hpp"
#include "tierflow/io/file.hpp"
#include "tierflow/io/operation.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {
namespace {

using bytes_buffer = nb::ndarray<nb::device::cpu, nb::c_contig>;

class aio_handle {
 public:
  aio_handle(std::uint64_t block_size, unsigned queue_depth, unsigned threads) {
    if (block_size == 0 || block_size % 4096 != 0)
      throw user_error("aio_handle: block_size " + std::to_string(block_size) +
                       " is not a positive multiple of 4096");
    if (queue_depth == 0) throw user_error("aio_handle: queue_depth is 0");
    if (threads == 0) throw user_error("aio_handle: intra_op_parallelism is 0");
    config_.block_size = static_cast<std::size_t>(block_size);
    config_.queue_depth = queue_depth;
    config_.threads = threads;
    io::validate(config_);
    engine_ = io::make_engine(config_);
  }

  ~aio_handle() {
    nb::gil_scoped_release unlocked;
    for (request& r : pending_) r.op.wait_quietly();
  }
  aio_handle(const aio_handle&) = delete;
  aio_handle& operator=(const aio_handle&) = delete;

  // Queues a read of the whole `buffer` from `path` at `offset`.
  void read(bytes_buffer buffer, const std::string& path, std::int64_t offset) {
    queue(buffer, path, offset, /*writing=*/false);
  }
  // Queues a write of the whole `buffer` to `path` at `offset` (the file made when missing).
  void write(bytes_buffer buffer, const std::string& path, std::int64_t offset) {
    queue(buffer, path, offset, /*writing=*/true);
  }

  // Waits for every request in flight; returns how many there were, or
  // raises the first one's error once all have ended.
  std::size_t wait() {
    std::exception_ptr first;
    std::size_t n = 0;
    {
      nb::gil_scoped_release unlocked;
      for (request& r : pending_) {
        try {
          r.op.wait();
        } catch (...) {
          if (!first) first = std::current_exception();
        }
        ++n;
      }
    }
    pending_.clear();
    if (first) std::rethrow_exception(first);
    return n;
  }

  std::size_t pending() const noexcept { return pending_.size(); }
  std::uint64_t block_size() const noexcept { return config_.block_size; }
  unsigned queue_depth() const noexcept { return config_.queue_depth; }
  unsigned threads() const noexcept { return config_.threads; }
  std::string backend() const { return io::to_string(engine_->backend()); }

 private:
  struct request {
    request(io::file f, nb::object owner) : file(std::move(f)), keep(std::move(owner)) {}
    io::file file;
    io::operation op;  // (neither copied nor moved: the deque builds it in place)
    nb::object keep;   // the buffer's owner, alive while the request is in flight
  };

  void queue(bytes_buffer& buffer, const std::string& path, std::int64_t offset, bool writing) {
    if (offset < 0) throw user_error("aio_handle: offset " + std::to_string(offset) + " of " + path + " is negative");
    const std::size_t bytes = buffer.nbytes();
    io::open_options options;
    options.access = writing ? io::access::read_write : io::access::read_only;
    options.creation = writing ? io::creation::if_missing : io::creation::open_existing;
    request& r = pending_.emplace_back(io::file::open(path, options), nb::find(buffer));
    try {
      auto* data = static_cast<std::byte*>(buffer.data());
      if (writing) {
        r.op.prepare_write(r.file, static_cast<std::uint64_t>(offset), {data, bytes});
      } else {
        r.op.prepare_read(r.file, static_cast<std::uint64_t>(offset), {data, bytes});
      }
      engine_->submit(r.op);
    } catch (...) {
      pending_.pop_back();  // (never submitted)
      throw;
    }
  }

  io::engine_config config_;
  std::unique_ptr<io::engine> engine_;
  std::deque<request> pending_;  // stable addresses: the engine holds the operations
};

}  // namespace

void bind_aio(nb::module_& m) {
  nb::class_<aio_handle>(m, "AioHandle",
      "Reads and writes of whole CPU buffers at offsets of files named by path, queued on\n"
      "tierflow's I/O engine (io_uring, or a thread pool where the kernel refuses a ring),\n"
      "as DeepSpeed's aio_handle queues them. wait() waits for all and raises the first\n"
      "failure, naming its file: a read past the end of a file (ENODATA) or a full disk\n"
      "(ENOSPC) is an error, never short data.")
      .def(nb::init<std::uint64_t, unsigned, unsigned>(), "block_size"_a, "queue_depth"_a, "threads"_a)
      .def("read", &aio_handle::read, "buffer"_a, "path"_a, "offset"_a = 0,
           "Queues a read of the whole buffer from path at offset.")
      .def("write", &aio_handle::write, "buffer"_a, "path"_a, "offset"_a = 0,
           "Queues a write of the whole buffer to path at offset (the file made 0600 when missing).")
      .def("wait", &aio_handle::wait,
           "Waits for every request in flight; returns their number, or raises the first\n"
           "failure once all have ended.")
      .def_prop_ro("pending", &aio_handle::pending, "Requests queued and not yet waited for.")
      .def_prop_ro("block_size", &aio_handle::block_size)
      .def_prop_ro("queue_depth", &aio_handle::queue_depth)
      .def_prop_ro("threads", &aio_handle::threads)
      .def_prop_ro("backend", &aio_handle::backend, "The engine's backend: \"uring\" or \"threads\".");
}

}  // namespace tierflow::python
