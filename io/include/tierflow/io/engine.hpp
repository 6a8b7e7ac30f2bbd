// The asynchronous file I/O engine (control plane): choose a backend, register
// long-lived buffers and files, submit operations.
//
//   auto eng = io::make_engine({.backend = io::backend_kind::automatic});
//   io::file f = io::file::open(path, {.creation = io::creation::if_missing});
//   io::operation op;
//   op.prepare_write(f, 0, bytes);
//   eng->submit(op);
//   op.wait();  // throws tierflow::error on failure
//
// Each request is split into chunks of `block_size` (and its unaligned head and
// tail), up to `queue_depth` chunks in flight per worker. Backends:
//   uring   — one io_uring per worker thread (SINGLE_ISSUER | DEFER_TASKRUN
//             where the kernel has them), registered buffers and files,
//             batched submission, optional SQPOLL;
//   threads — a pool of threads × queue_depth threads (at most 256) doing
//             pread/pwrite, same semantics;
//   automatic — uring when the kernel lets this process set up a ring, else threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "tierflow/io/fault.hpp"
#include "tierflow/io/file.hpp"
#include "tierflow/io/operation.hpp"

namespace tierflow::io {

enum class backend_kind : std::uint8_t { automatic, uring, threads };

// "auto", "uring", "threads".
const char* to_string(backend_kind kind) noexcept;
// Parses "auto" | "uring" | "threads"; throws user_error naming `what`.
backend_kind parse_backend(const std::string& text, const std::string& what);

struct engine_config {
  backend_kind backend = backend_kind::automatic;
  unsigned threads = 1;                  // worker threads (one ring each)
  unsigned queue_depth = 32;             // chunks in flight per worker (per ring)
  std::size_t block_size = 1u << 20;     // chunk size: a multiple of 4096
  // io_uring: while refilling the queue, hand SQEs to the kernel every
  // `submit_batch` of them (the device starts on those while the rest are
  // prepared); the remainder goes with the wait. 0: one submission per round.
  unsigned submit_batch = 8;
  bool sqpoll = false;                   // io_uring: a kernel thread polls the rings
  unsigned sqpoll_idle_ms = 50;
  unsigned max_registered_files = 64;    // per engine (each takes two ring slots)
  unsigned max_registered_buffers = 64;  // per engine
  std::shared_ptr<fault_injector> faults;  // tests only: the fault seam
};

// Checks a configuration; throws user_error naming the bad field.
void validate(const engine_config& config);

class engine;

// A file registered with an engine (io_uring registered files; a no-op on the
// threads backend). Unregisters on destruction; must not outlive the engine or
// the file, and must be destroyed only when no request on the file is in flight.
class file_registration {
 public:
  file_registration() noexcept = default;
  file_registration(file_registration&& other) noexcept;
  file_registration& operator=(file_registration&& other) noexcept;
  file_registration(const file_registration&) = delete;
  file_registration& operator=(const file_registration&) = delete;
  ~file_registration();
  int slot() const noexcept { return slot_; }

 private:
  friend class engine;
  file_registration(engine* owner, const file* f, int slot) noexcept;
  void reset() noexcept;
  engine* engine_ = nullptr;
  const file* file_ = nullptr;
  int slot_ = -1;
};

// A buffer registered with an engine (io_uring_register_buffers: the pages are
// pinned once, requests use READ_FIXED/WRITE_FIXED). Same lifetime rules.
class buffer_registration {
 public:
  buffer_registration() noexcept = default;
  buffer_registration(buffer_registration&& other) noexcept;
  buffer_registration& operator=(buffer_registration&& other) noexcept;
  buffer_registration(const buffer_registration&) = delete;
  buffer_registration& operator=(const buffer_registration&) = delete;
  ~buffer_registration();

  int index() const noexcept { return index_; }
  const engine* owner() const noexcept { return engine_; }
  std::span<std::byte> memory() const noexcept { return memory_; }
  // The ring accepted it (false on the threads backend, or where the kernel
  // refused; requests then move the data without the fixed opcodes).
  bool fixed() const noexcept { return fixed_; }

 private:
  friend class engine;
  buffer_registration(engine* owner, std::span<std::byte> memory, int index, bool fixed) noexcept;
  void reset() noexcept;
  engine* engine_ = nullptr;
  std::span<std::byte> memory_;
  int index_ = -1;
  bool fixed_ = false;
};

class engine {
 public:
  virtual ~engine() = default;
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  // Queues `op` and returns at once; the operation completes on an engine
  // thread. Needs: `op` prepared and not in flight. Never throws for I/O
  // errors (they complete the operation); thread-safe, also from callbacks.
  virtual void submit(operation& op) = 0;

  // Registers `f` so requests on it skip the per-request file lookup. Blocks
  // until every worker has it. Needs: not called from a completion callback.
  // Throws tierflow::error when the table is full or the kernel refuses.
  virtual file_registration register_file(const file& f) = 0;
  // Registers `memory` (long-lived, e.g. pinned host buffers). Same rules.
  virtual buffer_registration register_buffer(std::span<std::byte> memory) = 0;

  // The backend actually running (never automatic).
  virtual backend_kind backend() const noexcept = 0;
  // One line for people: "io_uring: 1 ring, SINGLE_ISSUER|DEFER_TASKRUN, ...".
  virtual std::string describe() const = 0;
  const engine_config& config() const noexcept { return config_; }

  // Synchronous helpers: submit and wait. Throw tierflow::error on failure.
  void read(const file& f, std::uint64_t offset, std::span<std::byte> into);
  void write(const file& f, std::uint64_t offset, std::span<const std::byte> from);

 protected:
  explicit engine(engine_config config) : config_(std::move(config)) {}
  // Hands a registration back (called by the registration's destructor).
  virtual void unregister_file(const file& f, int slot) noexcept = 0;
  virtual void unregister_buffer(int index) noexcept = 0;
  // For backends: wrap a slot/index in its handle.
  file_registration make_file_registration(const file& f, int slot) noexcept;
  buffer_registration make_buffer_registration(std::span<std::byte> memory, int index,
                                               bool fixed) noexcept;

  engine_config config_;

 private:
  friend class file_registration;
  friend class buffer_registration;
};

// Builds the engine `config` asks for. With backend automatic, io_uring is
// tried first and the thread pool used when the kernel refuses a ring.
// Throws user_error for a bad configuration, tierflow::error when a forced
// backend cannot start.
std::unique_ptr<engine> make_engine(const engine_config& config = {});

// The config snippet `tierflow tune io` writes and the engine reads: a JSON
// object whose "aio" section has DeepSpeed's keys (block_size, queue_depth,
// intra_op_parallelism, single_submit, overlap_events) and whose "io" section
// has tierflow's own (backend, sqpoll, submit_batch). A whole DeepSpeed config
// also reads (single_submit: true means submit_batch 1). overlap_events is
// always true: the engine submits a request as each one completes, and
// parse_config refuses false.
std::string config_snippet(const engine_config& config);
// Parses a snippet (text); keys absent keep `base`'s values. Throws user_error
// naming the bad key.
engine_config parse_config(const std::string& json_text, engine_config base = {});
// Reads a snippet from a file. Throws user_error naming the path.
engine_config read_config(const std::string& path, engine_config base = {});

}  // namespace tierflow::io
