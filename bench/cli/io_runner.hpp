// One I/O benchmark run, as `tierflow bench io` and `tierflow tune io` do it:
// the same file, block size and queue depth as a fio job, every block of the
// run moved by the io::engine with `queue_depth` requests in flight per
// worker, each completion resubmitting the next from its callback.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "tierflow/io/engine.hpp"

namespace tierflow::cli {

enum class io_pattern { read, write, randread, randwrite };

const char* to_string(io_pattern p) noexcept;
// Parses read|write|randread|randwrite; throws user_error naming `what`.
io_pattern parse_pattern(const std::string& text, const std::string& what);

struct io_job {
  std::string path;              // the file (created and laid out when smaller than `size`)
  std::uint64_t size = 1ull << 30;  // the region of the file used
  std::uint64_t io_size = 0;     // bytes to move; 0: `size`
  io_pattern pattern = io_pattern::read;
  bool buffered = false;         // page cache instead of O_DIRECT
  bool register_memory = true;   // registered buffers and file
  io::engine_config engine;      // block_size, queue_depth, threads, backend, sqpoll
  // Called about every 100 ms on the calling thread: fraction done, bytes/s so far.
  std::function<void(double, double)> progress;
};

struct io_result {
  io_pattern pattern = io_pattern::read;
  std::uint64_t bytes = 0;
  double seconds = 0;
  double bytes_per_second = 0;
  double iops = 0;
  double p50_us = 0;
  double p99_us = 0;
  std::string engine;  // engine::describe()
  io::backend_kind backend = io::backend_kind::automatic;
  bool direct = false;
};

// Runs `job`. Throws user_error for bad values, tierflow::error for I/O failures.
io_result run_io_job(const io_job& job);

// A progress bar on stderr for runs over two seconds on a terminal; prints
// nothing otherwise. finish() clears the line.
class progress_bar {
 public:
  explicit progress_bar(std::string label);
  void update(double fraction, double bytes_per_second);
  void finish();

 private:
  std::string label_;
  bool terminal_;
  bool shown_ = false;
  double start_;
};

}  // namespace tierflow::cli
