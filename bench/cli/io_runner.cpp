#include "io_runner.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/io/aligned_buffer.hpp"

namespace tierflow::cli {
namespace {

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

struct run_state;

// One request slot: an operation that, on completion, records its latency and
// resubmits itself for the next block until the run has moved everything.
struct slot {
  io::operation op;
  run_state* run = nullptr;
  std::byte* memory = nullptr;
  std::uint64_t submitted_ns = 0;
  std::uint64_t rng = 0;
};

struct run_state {
  io::engine* engine = nullptr;
  const io::file* file = nullptr;
  const io::buffer_registration* registration = nullptr;
  io_pattern pattern = io_pattern::read;
  std::uint64_t block = 0;
  std::uint64_t blocks_in_file = 0;
  std::uint64_t total_ops = 0;
  std::atomic<std::uint64_t> issued{0};     // ops handed out
  std::atomic<std::uint64_t> completed{0};  // ops finished
  std::atomic<std::uint64_t> end_ns{0};
  std::atomic<unsigned> slots_done{0};
  std::atomic<bool> failed{false};
  std::vector<std::uint32_t> latencies_ns;  // one per op, indexed by completion order
  std::mutex error_mutex;
  std::exception_ptr error;
};

std::uint64_t next_random(std::uint64_t& s) {  // xorshift64*
  s ^= s >> 12;
  s ^= s << 25;
  s ^= s >> 27;
  return s * 2685821657736338717ull;
}

void on_complete(io::operation& op, void* context);

// Prepares and submits the slot's next op; false when the run has no more.
bool issue_next(slot& s) {
  run_state& r = *s.run;
  if (r.failed.load(std::memory_order_relaxed)) return false;
  const std::uint64_t index = r.issued.fetch_add(1, std::memory_order_relaxed);
  if (index >= r.total_ops) return false;
  const bool random = r.pattern == io_pattern::randread || r.pattern == io_pattern::randwrite;
  const std::uint64_t block_index = random ? next_random(s.rng) % r.blocks_in_file : index % r.blocks_in_file;
  const std::uint64_t offset = block_index * r.block;
  const std::span<std::byte> memory(s.memory, r.block);
  if (r.pattern == io_pattern::read || r.pattern == io_pattern::randread) s.op.prepare_read(*r.file, offset, memory);
  else s.op.prepare_write(*r.file, offset, memory);
  if (r.registration != nullptr) s.op.use_buffer(*r.registration);
  s.op.on_complete(on_complete, &s);
  s.submitted_ns = now_ns();
  r.engine->submit(s.op);
  return true;
}

void on_complete(io::operation& op, void* context) {
  slot& s = *static_cast<slot*>(context);
  run_state& r = *s.run;
  const std::uint64_t t = now_ns();
  if (op.failed()) {
    std::lock_guard lock(r.error_mutex);
    if (!r.error) r.error = op.error();
    r.failed.store(true, std::memory_order_relaxed);
  } else {
    const std::uint64_t n = r.completed.fetch_add(1, std::memory_order_relaxed);
    const std::uint64_t latency = t - s.submitted_ns;
    if (n < r.latencies_ns.size()) r.latencies_ns[n] = static_cast<std::uint32_t>(std::min<std::uint64_t>(latency, UINT32_MAX));
  }
  if (!issue_next(s)) {
    std::uint64_t end = r.end_ns.load(std::memory_order_relaxed);
    while (end < t && !r.end_ns.compare_exchange_weak(end, t, std::memory_order_relaxed)) {
    }
    // Release: the main thread's acquire load of slots_done sees the results above.
    r.slots_done.fetch_add(1, std::memory_order_release);
  }
}

double percentile_us(std::vector<std::uint32_t>& v, double p) {
  if (v.empty()) return 0;
  const std::size_t k = std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k] / 1000.0;
}

// Makes `f` at least `size` bytes: written with data for reads (a read of a
// hole measures nothing), preallocated for writes (as fio lays files out).
void lay_out(io::engine& eng, io::file& f, std::uint64_t size, io_pattern pattern) {
  const std::uint64_t have = f.size();
  if (have >= size) return;
  if (pattern == io_pattern::write || pattern == io_pattern::randwrite) {
    try {
      f.allocate(0, size);
    } catch (const error& e) {
      if (e.errnum() != EOPNOTSUPP) throw;
      f.truncate(size);
    }
    return;
  }
  constexpr std::uint64_t piece = 8u << 20;
  constexpr unsigned depth = 4;
  io::aligned_buffer memory(piece * depth);
  for (std::uint64_t i = 0; i < memory.size(); i += 8) {
    const std::uint64_t v = i * 0x9e3779b97f4a7c15ull;
    std::memcpy(memory.data() + i, &v, 8);
  }
  io::operation ops[depth];
  const std::uint64_t start = have - have % piece;
  unsigned k = 0;
  for (std::uint64_t offset = start; offset < size; offset += piece, k = (k + 1) % depth) {
    if (offset >= start + depth * piece) ops[k].wait();
    ops[k].prepare_write(f, offset, {memory.data() + k * piece, std::min(piece, size - offset)});
    eng.submit(ops[k]);
  }
  for (auto& op : ops) {
    if (op.target() != nullptr) op.wait();  // the ones submitted
  }
  f.sync();
}

// Opens the run's file, creating it when missing. ENOENT from the create has
// two causes a user acts on differently, and strerror names neither: the
// directory is missing, or it exists on a filesystem that makes no files.
io::file open_run_file(const io_job& job) {
  try {
    return io::file::open(job.path, {.creation = io::creation::if_missing,
                                     .direct = job.buffered ? io::direct_io::off : io::direct_io::prefer});
  } catch (const error& e) {
    if (e.errnum() != ENOENT) throw;
    const auto slash = job.path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : job.path.substr(0, slash);
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      throw user_error("--path " + job.path + ": its directory " + dir + " does not exist");
    }
    if (!S_ISDIR(st.st_mode)) throw;
    throw user_error("--path " + job.path + ": cannot be created: " + dir +
                     " is on a filesystem that does not let files be created");
  }
}

}  // namespace

const char* to_string(io_pattern p) noexcept {
  switch (p) {
    case io_pattern::read: return "read";
    case io_pattern::write: return "write";
    case io_pattern::randread: return "randread";
    case io_pattern::randwrite: return "randwrite";
  }
  return "?";
}

io_pattern parse_pattern(const std::string& text, const std::string& what) {
  for (io_pattern p : {io_pattern::read, io_pattern::write, io_pattern::randread, io_pattern::randwrite}) {
    if (text == to_string(p)) return p;
  }
  throw user_error(what + ": '" + text + "' is not one of read, write, randread, randwrite");
}

io_result run_io_job(const io_job& job) {
  io::validate(job.engine);
  const std::uint64_t block = job.engine.block_size;
  if (job.size < block) {
    throw user_error("--size " + format_bytes(static_cast<double>(job.size)) + " is smaller than the block size " +
                     format_bytes(static_cast<double>(block)));
  }
  const std::uint64_t io_size = job.io_size == 0 ? job.size : job.io_size;
  if (io_size < block) throw user_error("--io-size is smaller than the block size");
  struct stat st {};
  if (::stat(job.path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    throw user_error("--path " + job.path + ": is a directory; give a file (it is created when missing)");
  }

  std::unique_ptr<io::engine> eng = io::make_engine(job.engine);
  io::file f = open_run_file(job);
  lay_out(*eng, f, job.size, job.pattern);

  const unsigned slots = job.engine.queue_depth * job.engine.threads;
  io::aligned_buffer memory(static_cast<std::size_t>(block) * slots);
  if (job.pattern == io_pattern::write || job.pattern == io_pattern::randwrite) {
    for (std::size_t i = 0; i + 8 <= memory.size(); i += 8) {
      const std::uint64_t v = (i + 1) * 0xbf58476d1ce4e5b9ull;
      std::memcpy(memory.data() + i, &v, 8);
    }
  }

  run_state r;
  r.engine = eng.get();
  r.file = &f;
  r.pattern = job.pattern;
  r.block = block;
  r.blocks_in_file = job.size / block;
  r.total_ops = io_size / block;
  r.latencies_ns.assign(r.total_ops, 0);

  io::file_registration file_registration;
  io::buffer_registration buffer_registration;
  if (job.register_memory) {
    file_registration = eng->register_file(f);
    buffer_registration = eng->register_buffer(memory.span());
    r.registration = &buffer_registration;
  }

  std::unique_ptr<slot[]> slot_array(new slot[slots]);
  const std::uint64_t start = now_ns();
  unsigned started = 0;
  for (unsigned i = 0; i < slots; ++i) {
    slot& s = slot_array[i];
    s.run = &r;
    s.memory = memory.data() + static_cast<std::size_t>(i) * block;
    s.rng = 0x9e3779b97f4a7c15ull * (i + 1);
    if (issue_next(s)) ++started;
    else break;
  }
  // The slots that started finish on the engine's threads; this thread only
  // reports progress (a sleep between looks, never a spin).
  while (r.slots_done.load(std::memory_order_acquire) < started) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (job.progress) {
      const double elapsed = static_cast<double>(now_ns() - start) / 1e9;
      const double done = static_cast<double>(r.completed.load(std::memory_order_relaxed));
      job.progress(done / static_cast<double>(r.total_ops), elapsed > 0 ? done * static_cast<double>(block) / elapsed : 0);
    }
  }
  for (unsigned i = 0; i < started; ++i) slot_array[i].op.wait_quietly();
  if (r.error) std::rethrow_exception(r.error);

  io_result out;
  out.pattern = job.pattern;
  out.bytes = r.completed.load() * block;
  out.seconds = static_cast<double>(r.end_ns.load() - start) / 1e9;
  out.bytes_per_second = out.seconds > 0 ? static_cast<double>(out.bytes) / out.seconds : 0;
  out.iops = out.seconds > 0 ? static_cast<double>(r.completed.load()) / out.seconds : 0;
  r.latencies_ns.resize(r.completed.load());
  out.p50_us = percentile_us(r.latencies_ns, 0.50);
  out.p99_us = percentile_us(r.latencies_ns, 0.99);
  out.engine = eng->describe();
  out.backend = eng->backend();
  out.direct = f.is_direct();
  return out;
}

// ---- progress ---------------------------------------------------------------------

progress_bar::progress_bar(std::string label)
    : label_(std::move(label)), terminal_(::isatty(STDERR_FILENO) == 1), start_(static_cast<double>(now_ns()) / 1e9) {}

void progress_bar::update(double fraction, double bytes_per_second) {
  if (!terminal_) return;
  if (!shown_ && static_cast<double>(now_ns()) / 1e9 - start_ < 2.0) return;  // only for runs over two seconds
  shown_ = true;
  constexpr int width = 30;
  const int filled = std::clamp(static_cast<int>(fraction * width), 0, width);
  std::fprintf(stderr, "\r%s [%.*s%*s] %3d%%  %s   ", label_.c_str(), filled, "##############################",
               width - filled, "", static_cast<int>(fraction * 100), format_rate(bytes_per_second).c_str());
  std::fflush(stderr);
}

void progress_bar::finish() {
  if (shown_) {
    std::fprintf(stderr, "\r%*s\r", 100, "");
    std::fflush(stderr);
  }
  shown_ = false;
}

}  // namespace tierflow::cli
