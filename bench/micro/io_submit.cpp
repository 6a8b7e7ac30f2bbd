// Micro-benchmarks of the io::engine's submission path and small-block IOPS,
// each beside its peer in the same run:
//   engine_overhead   — a zero-length request through submit → worker → completion
//                       (the engine's own cost, no kernel I/O), per backend;
//   cached_read_4k    — a 4 KiB read of a page-cached file at queue depth 1,
//                       beside a plain pread() and a bare liburing submit-and-wait;
//   direct_randread_4k — O_DIRECT 4 KiB random reads at queue depth 1..64, each
//                       completion resubmitting from its callback, beside a bare
//                       liburing loop at the same depth (what fio's io_uring engine does).
// The scratch file lives in $TMPDIR (default /var/tmp), 256 MiB, removed at exit.
#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "tierflow/io/aligned_buffer.hpp"
#include "tierflow/io/engine.hpp"
#include "tierflow/io/probe.hpp"

namespace tierflow::io {
namespace {

constexpr std::uint64_t file_bytes = 256ull << 20;

// The shared scratch file, written once.
class scratch {
 public:
  static scratch& get() {
    static scratch s;
    return s;
  }
  const std::string& path() const { return path_; }
  ~scratch() { ::unlink(path_.c_str()); }

 private:
  scratch() {
    const char* dir = std::getenv("TMPDIR");
    path_ = std::string(dir != nullptr && *dir ? dir : "/var/tmp") + "/tierflow-io-micro-" + std::to_string(::getpid());
    file f = file::open(path_, {.creation = creation::if_missing});
    auto eng = make_engine({.backend = backend_kind::threads});
    aligned_buffer b(8 << 20);
    std::memset(b.data(), 0x3c, b.size());
    for (std::uint64_t off = 0; off < file_bytes; off += b.size()) eng->write(f, off, b.span());
    f.sync();
  }
  std::string path_;
};

bool skip_without_uring(benchmark::State& state, backend_kind kind) {
  if (kind == backend_kind::uring && !probe_uring().available) {
    state.SkipWithError(("io_uring unavailable: " + probe_uring().reason).c_str());
    return true;
  }
  return false;
}

backend_kind backend_of(const benchmark::State& state) {
  return state.range(0) == 0 ? backend_kind::uring : backend_kind::threads;
}

void engine_overhead(benchmark::State& state) {
  const backend_kind kind = backend_of(state);
  if (skip_without_uring(state, kind)) return;
  file f = file::open(scratch::get().path(), {});
  auto eng = make_engine({.backend = kind});
  operation op;
  for (auto _ : state) {
    op.prepare_read(f, 0, {});
    eng->submit(op);
    op.wait();
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(to_string(kind));
}
BENCHMARK(engine_overhead)->Arg(0)->Arg(1)->UseRealTime();

void cached_read_4k(benchmark::State& state) {
  const backend_kind kind = backend_of(state);
  if (skip_without_uring(state, kind)) return;
  file f = file::open(scratch::get().path(), {.direct = direct_io::off});
  auto eng = make_engine({.backend = kind});
  aligned_buffer b(4096);
  operation op;
  std::uint64_t offset = 0;
  for (auto _ : state) {
    op.prepare_read(f, offset, b.span());
    eng->submit(op);
    op.wait();
    offset = (offset + 4096) % (16 << 20);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(to_string(kind));
}
BENCHMARK(cached_read_4k)->Arg(0)->Arg(1)->UseRealTime();

void peer_cached_pread_4k(benchmark::State& state) {
  const int fd = ::open(scratch::get().path().c_str(), O_RDONLY | O_CLOEXEC);
  aligned_buffer b(4096);
  std::uint64_t offset = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(::pread(fd, b.data(), 4096, static_cast<off_t>(offset)));
    offset = (offset + 4096) % (16 << 20);
  }
  ::close(fd);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(peer_cached_pread_4k)->UseRealTime();

void peer_cached_uring_4k(benchmark::State& state) {
  if (skip_without_uring(state, backend_kind::uring)) return;
  const int fd = ::open(scratch::get().path().c_str(), O_RDONLY | O_CLOEXEC);
  io_uring ring;
  io_uring_queue_init(8, &ring, 0);
  aligned_buffer b(4096);
  std::uint64_t offset = 0;
  for (auto _ : state) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    io_uring_prep_read(sqe, fd, b.data(), 4096, offset);
    io_uring_submit_and_wait(&ring, 1);
    io_uring_cqe* cqe = nullptr;
    io_uring_peek_cqe(&ring, &cqe);
    benchmark::DoNotOptimize(cqe->res);
    io_uring_cqe_seen(&ring, cqe);
    offset = (offset + 4096) % (16 << 20);
  }
  io_uring_queue_exit(&ring);
  ::close(fd);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(peer_cached_uring_4k)->UseRealTime();

// Random 4 KiB O_DIRECT reads kept at a queue depth by callbacks.
struct random_reader {
  engine* eng;
  const file* f;
  const buffer_registration* registration;
  std::atomic<std::int64_t> remaining;
};

struct reader_slot {
  operation op;
  random_reader* reader;
  std::byte* memory;
  std::uint64_t rng;
};

void next_read(operation& op, void* context) {
  auto& s = *static_cast<reader_slot*>(context);
  if (op.failed() || s.reader->remaining.fetch_sub(1, std::memory_order_relaxed) <= 0) return;
  s.rng ^= s.rng << 13;
  s.rng ^= s.rng >> 7;
  s.rng ^= s.rng << 17;
  op.prepare_read(*s.reader->f, (s.rng % (file_bytes / 4096)) * 4096, {s.memory, 4096});
  op.use_buffer(*s.reader->registration);
  op.on_complete(next_read, &s);
  s.reader->eng->submit(op);
}

void direct_randread_4k(benchmark::State& state) {
  const backend_kind kind = backend_of(state);
  if (skip_without_uring(state, kind)) return;
  const auto depth = static_cast<unsigned>(state.range(1));
  constexpr std::int64_t reads_per_iteration = 4096;
  file f = file::open(scratch::get().path(), {.access = access::read_only, .direct = direct_io::require});
  auto eng = make_engine({.backend = kind, .threads = kind == backend_kind::threads ? depth : 1, .queue_depth = depth,
                          .block_size = 4096});
  aligned_buffer memory(4096 * depth);
  file_registration freg = eng->register_file(f);
  buffer_registration breg = eng->register_buffer(memory.span());
  random_reader reader{eng.get(), &f, &breg, {0}};
  std::vector<reader_slot> slots(depth);
  for (auto _ : state) {
    reader.remaining.store(reads_per_iteration);
    for (unsigned i = 0; i < depth; ++i) {
      slots[i].reader = &reader;
      slots[i].memory = memory.data() + 4096 * i;
      slots[i].rng = 0x9e3779b97f4a7c15ull * (i + 1) + static_cast<std::uint64_t>(state.iterations());
      next_read(slots[i].op, &slots[i]);
    }
    for (auto& s : slots) {
      if (s.op.target() != nullptr) s.op.wait();
    }
  }
  state.SetItemsProcessed(state.iterations() * reads_per_iteration);
  state.SetLabel(to_string(kind));
}
BENCHMARK(direct_randread_4k)->ArgsProduct({{0, 1}, {1, 8, 64}})->UseRealTime()->Unit(benchmark::kMillisecond);

void peer_uring_randread_4k(benchmark::State& state) {
  if (skip_without_uring(state, backend_kind::uring)) return;
  const auto depth = static_cast<unsigned>(state.range(0));
  constexpr std::int64_t reads_per_iteration = 4096;
  const int fd = ::open(scratch::get().path().c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  io_uring ring;
  io_uring_queue_init(depth, &ring, 0);
  aligned_buffer memory(4096 * depth);
  std::uint64_t rng = 88172645463325252ull;
  auto queue = [&](unsigned slot) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    io_uring_prep_read(sqe, fd, memory.data() + 4096 * slot, 4096, (rng % (file_bytes / 4096)) * 4096);
    io_uring_sqe_set_data64(sqe, slot);
  };
  for (auto _ : state) {
    std::int64_t issued = 0, done = 0;
    for (unsigned i = 0; i < depth; ++i, ++issued) queue(i);
    while (done < reads_per_iteration) {
      io_uring_submit_and_wait(&ring, 1);
      io_uring_cqe* cqe;
      unsigned head, n = 0;
      io_uring_for_each_cqe(&ring, head, cqe) {
        ++n;
        ++done;
        if (issued < reads_per_iteration) {
          queue(static_cast<unsigned>(cqe->user_data));
          ++issued;
        }
      }
      io_uring_cq_advance(&ring, n);
    }
  }
  io_uring_queue_exit(&ring);
  ::close(fd);
  state.SetItemsProcessed(state.iterations() * reads_per_iteration);
}
BENCHMARK(peer_uring_randread_4k)->Arg(1)->Arg(8)->Arg(64)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tierflow::io

BENCHMARK_MAIN();
