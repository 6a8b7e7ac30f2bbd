// The engine on real files, real io_uring and real threads, every test on
// both backends: round trips of random lengths and offsets compared byte for
// byte, reads past the end, registered buffers and files, chained callbacks,
// many submitting threads.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include <gtest/gtest.h>

#include "io_test_support.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/io/aligned_buffer.hpp"
#include "tierflow/io/engine.hpp"
#include "tierflow/io/file.hpp"
#include "tierflow/io/probe.hpp"

namespace tierflow::io {
namespace {

using testing::backend_test;
using testing::random_bytes;
using testing::scratch_dir;

std::vector<std::byte> read_back(const std::string& path, std::uint64_t offset, std::size_t n) {
  std::vector<std::byte> out(n);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::pread(fd, out.data(), n, static_cast<off_t>(offset)), static_cast<ssize_t>(n));
  ::close(fd);
  return out;
}

class Engine : public backend_test {};

TEST_P(Engine, ReportsTheBackendItRuns) {
  auto eng = make_engine(config());
  EXPECT_EQ(eng->backend(), GetParam());
  EXPECT_FALSE(eng->describe().empty());
}

TEST_P(Engine, RoundTripsRandomOffsetsAndLengthsByteForByte) {
  scratch_dir dir;
  file f = file::open(dir.file("data"), {.creation = creation::if_missing});
  ASSERT_TRUE(f.is_direct()) << "O_DIRECT should work under " << dir.path();
  // Small blocks so one request spans many chunks and the queue depth limits.
  auto eng = make_engine(config(4, 16 * 1024));
  constexpr std::size_t file_size = 1 << 20;
  const std::vector<std::byte> image = random_bytes(file_size, 1);
  aligned_buffer whole(file_size);
  std::memcpy(whole.data(), image.data(), file_size);
  eng->write(f, 0, whole.span());

  std::mt19937_64 rng(7);
  aligned_buffer buffer(file_size + 8192);
  for (int round = 0; round < 200; ++round) {
    std::uint64_t offset = rng() % file_size;
    std::size_t length = 1 + rng() % (file_size - offset);
    if (round % 4 == 0) length = std::min<std::size_t>(length, 1 + rng() % 9000);  // many small ones
    if (round % 10 == 1) {  // aligned start, 1-byte tail
      offset = (offset / 4096) * 4096;
      length = std::min<std::size_t>(4096 * (1 + rng() % 8) + 1, file_size - offset);
    }
    // Aligned and misaligned memory both.
    std::byte* memory = buffer.data() + (round % 3 == 0 ? (rng() % 4096) : 0);
    std::span<std::byte> into(memory, length);
    std::memset(memory, 0xee, length);
    eng->read(f, offset, into);
    ASSERT_EQ(std::memcmp(memory, image.data() + offset, length), 0)
        << "read offset " << offset << " length " << length;
  }
  // Writes of random pieces, then the whole file compared with a model.
  std::vector<std::byte> model = image;
  for (int round = 0; round < 100; ++round) {
    const std::uint64_t offset = rng() % file_size;
    const std::size_t length = 1 + rng() % std::min<std::uint64_t>(file_size - offset, 70000);
    const auto piece = random_bytes(length, 1000 + round);
    std::byte* memory = buffer.data() + (round % 2) * (rng() % 512);
    std::memcpy(memory, piece.data(), length);
    eng->write(f, offset, {memory, length});
    std::memcpy(model.data() + offset, piece.data(), length);
  }
  EXPECT_EQ(read_back(f.path(), 0, file_size), model);
}

TEST_P(Engine, OneByteAndTailOnlyRequests) {
  scratch_dir dir;
  file f = file::open(dir.file("tiny"), {.creation = creation::if_missing});
  auto eng = make_engine(config());
  const std::byte one{0x42};
  aligned_buffer b(4096);
  b.data()[0] = one;
  eng->write(f, 4095, {b.data(), 1});
  eng->write(f, 8191, {b.data(), 1});
  EXPECT_EQ(f.size(), 8192u);
  std::byte got{};
  eng->read(f, 4095, {&got, 1});
  EXPECT_EQ(got, one);
  // A file whose size is not a multiple of 512 (DeepSpeed #1070's lost tail).
  file g = file::open(dir.file("odd"), {.creation = creation::if_missing});
  const auto data = random_bytes(10000 + 77, 3);
  aligned_buffer src(data.size());
  std::memcpy(src.data(), data.data(), data.size());
  eng->write(g, 0, src.span());
  EXPECT_EQ(g.size(), data.size());
  aligned_buffer dst(data.size());
  eng->read(g, 0, dst.span());
  EXPECT_EQ(std::memcmp(dst.data(), data.data(), data.size()), 0);
}

TEST_P(Engine, ReadPastEndOfFileIsAnErrorNotZeros) {
  scratch_dir dir;
  file f = file::open(dir.file("short"), {.creation = creation::if_missing});
  auto eng = make_engine(config());
  aligned_buffer b(16384);
  eng->write(f, 0, {b.data(), 5000});
  for (auto [offset, length] : {std::pair<std::uint64_t, std::size_t>{0, 8192}, {4096, 4096}, {5000, 1}, {8192, 4096}}) {
    operation op;
    op.prepare_read(f, offset, {b.data(), length});
    eng->submit(op);
    op.wait_quietly();
    ASSERT_TRUE(op.failed()) << offset << "+" << length;
    EXPECT_EQ(op.errnum(), ENODATA);
    try {
      op.rethrow_if_failed();
      FAIL();
    } catch (const tierflow::error& e) {
      EXPECT_NE(std::string(e.what()).find("past end of file"), std::string::npos) << e.what();
      EXPECT_EQ(e.context().path, f.path());
      EXPECT_EQ(e.context().offset, offset);
      EXPECT_EQ(e.context().length, length);
    }
  }
  // Up to the last byte is fine.
  eng->read(f, 0, {b.data(), 5000});
}

TEST_P(Engine, ZeroLengthRequestsComplete) {
  scratch_dir dir;
  file f = file::open(dir.file("z"), {.creation = creation::if_missing});
  auto eng = make_engine(config());
  operation op;
  op.prepare_write(f, 123, {});
  eng->submit(op);
  op.wait();
  EXPECT_EQ(op.bytes_transferred(), 0u);
}

TEST_P(Engine, BadDescriptorUseIsAnErrorNamingTheFile) {
  scratch_dir dir;
  { file::open(dir.file("ro"), {.creation = creation::if_missing}); }
  file f = file::open(dir.file("ro"), {.access = access::read_only});
  auto eng = make_engine(config());
  aligned_buffer b(4096);
  operation op;
  op.prepare_write(f, 0, b.span());
  eng->submit(op);
  try {
    op.wait();
    FAIL() << "a write to a read-only descriptor succeeded";
  } catch (const tierflow::error& e) {
    EXPECT_EQ(e.errnum(), EBADF);
    EXPECT_EQ(e.context().operation, "write");
    EXPECT_EQ(e.context().path, f.path());
  }
}

TEST_P(Engine, RegisteredBuffersAndFilesMoveTheSameBytes) {
  scratch_dir dir;
  file f = file::open(dir.file("reg"), {.creation = creation::if_missing});
  auto eng = make_engine(config(8, 64 * 1024, 2));
  aligned_buffer pinned(1 << 20);
  const auto data = random_bytes(pinned.size(), 9);
  std::memcpy(pinned.data(), data.data(), data.size());
  {
    file_registration freg = eng->register_file(f);
    buffer_registration breg = eng->register_buffer(pinned.span());
    if (GetParam() == backend_kind::uring) {
      EXPECT_TRUE(breg.fixed());
    }
    operation op;
    op.prepare_write(f, 0, pinned.span());
    op.use_buffer(breg);
    eng->submit(op);
    op.wait();
    EXPECT_EQ(op.bytes_transferred(), pinned.size());
    std::memset(pinned.data(), 0, pinned.size());
    // Unaligned pieces of a registered buffer take the buffered descriptor's slot.
    op.prepare_read(f, 100, {pinned.data() + 100, pinned.size() - 200});
    op.use_buffer(breg);
    eng->submit(op);
    op.wait();
    op.prepare_read(f, 0, {pinned.data(), 100});
    eng->submit(op);
    op.wait();
    EXPECT_EQ(std::memcmp(pinned.data(), data.data(), pinned.size() - 100), 0);
  }
  // Registrations gone: the same requests still work.
  eng->read(f, 0, pinned.span());
  EXPECT_EQ(std::memcmp(pinned.data(), data.data(), pinned.size()), 0);
}

// A chain: each completion prepares and submits the next piece from its
// callback, on the engine's thread, with no thread per request.
struct chain {
  engine* eng;
  const file* f;
  std::byte* memory;
  std::uint64_t piece;
  std::uint64_t next = 0;
  std::uint64_t total;
  std::atomic<int> calls{0};
};

void chain_step(operation& op, void* context) {
  auto& c = *static_cast<chain*>(context);
  c.calls.fetch_add(1);
  if (op.failed() || c.next >= c.total) return;
  op.prepare_write(*c.f, c.next, {c.memory + c.next, c.piece});
  op.on_complete(chain_step, &c);
  c.next += c.piece;
  c.eng->submit(op);
}

TEST_P(Engine, CallbacksChainWorkWithoutWaiting) {
  scratch_dir dir;
  file f = file::open(dir.file("chain"), {.creation = creation::if_missing});
  auto eng = make_engine(config());
  aligned_buffer memory(256 * 1024);
  const auto data = random_bytes(memory.size(), 11);
  std::memcpy(memory.data(), data.data(), data.size());
  chain c{eng.get(), &f, memory.data(), 16 * 1024, 0, memory.size()};
  operation op;
  op.prepare_write(f, 0, {memory.data(), c.piece});
  op.on_complete(chain_step, &c);
  c.next = c.piece;
  eng->submit(op);
  op.wait();  // ready only after the last link did not resubmit
  EXPECT_EQ(c.calls.load(), 16);
  EXPECT_EQ(read_back(f.path(), 0, data.size()), data);
}

TEST_P(Engine, ManyThreadsSubmittingAtOnce) {
  scratch_dir dir;
  file f = file::open(dir.file("many"), {.creation = creation::if_missing});
  auto eng = make_engine(config(16, 32 * 1024, 2));
  constexpr int threads = 8, per_thread = 40;
  constexpr std::size_t piece = 12 * 1024 + 512;  // unaligned lengths on purpose
  f.truncate(threads * per_thread * piece);
  std::vector<std::thread> pool;
  std::atomic<int> failures{0};
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      aligned_buffer b(piece * 4);
      operation ops[4];
      for (int i = 0; i < per_thread; i += 4) {
        for (int k = 0; k < 4; ++k) {
          const std::uint64_t index = static_cast<std::uint64_t>(t) * per_thread + i + k;
          std::memset(b.data() + k * piece, static_cast<int>(index & 0xff), piece);
          ops[k].prepare_write(f, index * piece, {b.data() + k * piece, piece});
          eng->submit(ops[k]);
        }
        for (auto& op : ops) {
          op.wait_quietly();
          if (op.failed()) failures.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  EXPECT_EQ(failures.load(), 0);
  const auto all = read_back(f.path(), 0, threads * per_thread * piece);
  for (std::size_t index = 0; index < threads * per_thread; ++index) {
    for (std::size_t k = 0; k < piece; k += 1021) {
      ASSERT_EQ(all[index * piece + k], static_cast<std::byte>(index & 0xff)) << index;
    }
  }
}

TEST_P(Engine, DestructionFinishesWhatWasSubmitted) {
  scratch_dir dir;
  file f = file::open(dir.file("drain"), {.creation = creation::if_missing});
  aligned_buffer b(4 << 20);
  std::memset(b.data(), 0x5a, b.size());
  operation op;
  {
    auto eng = make_engine(config(2, 64 * 1024));
    op.prepare_write(f, 0, b.span());
    eng->submit(op);
  }
  EXPECT_TRUE(op.ready());
  op.wait();
  EXPECT_EQ(f.size(), b.size());
}

INSTANTIATE_TEST_SUITE_P(Backends, Engine, ::testing::ValuesIn(testing::backends()), testing::backend_name);

// ---- not per backend ------------------------------------------------------------

TEST(EngineConfig, SnippetRoundTripsAndReadsDeepSpeedKeys) {
  engine_config c;
  c.backend = backend_kind::threads;
  c.block_size = 256 * 1024;
  c.queue_depth = 16;
  c.threads = 2;
  c.sqpoll = true;
  c.submit_batch = 3;
  const engine_config back = parse_config(config_snippet(c));
  EXPECT_EQ(back.backend, c.backend);
  EXPECT_EQ(back.block_size, c.block_size);
  EXPECT_EQ(back.queue_depth, c.queue_depth);
  EXPECT_EQ(back.threads, c.threads);
  EXPECT_TRUE(back.sqpoll);
  EXPECT_EQ(back.submit_batch, 3u);
  const engine_config ds = parse_config(
      R"({"train_batch_size": 8, "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
          "single_submit": false, "overlap_events": true}})");
  EXPECT_EQ(ds.block_size, 1u << 20);
  EXPECT_EQ(ds.queue_depth, 8u);
  EXPECT_EQ(ds.submit_batch, engine_config{}.submit_batch);
  EXPECT_EQ(parse_config(R"({"aio": {"single_submit": true}})").submit_batch, 1u);
  EXPECT_EQ(parse_config(R"({"io": {"submit_batch": 0}})").submit_batch, 0u);
  EXPECT_THROW(parse_config(R"({"aio": {"block_size": 1000}})"), user_error);
  EXPECT_THROW(parse_config(R"({"aio": {"queue_depth": "deep"}})"), user_error);
  EXPECT_THROW(parse_config("not json"), user_error);
  EXPECT_THROW(read_config("/nonexistent/tierflow.json"), user_error);
}

// The probe reports the opcodes the uring backend submits, no others, and
// io_uring counts as available only when the kernel has all of them.
TEST(UringProbe, ListsTheOpcodesTheEngineSubmits) {
  const uring_capabilities& caps = probe_uring();
  if (!caps.available) GTEST_SKIP() << "io_uring unavailable here: " << caps.reason;
  std::vector<std::string> names;
  for (const auto& [name, supported] : caps.opcodes) {
    names.push_back(name);
    EXPECT_TRUE(supported) << name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"read", "read_fixed", "write", "write_fixed"}));
}

// The engine refills its queue as each request completes; DeepSpeed's
// overlap_events: false (lockstep batches) is refused, never run as true.
TEST(EngineConfig, OverlapEventsFalseIsRefusedNamingTheKey) {
  EXPECT_NO_THROW(parse_config(R"({"aio": {"overlap_events": true}})"));
  for (const char* text : {R"({"aio": {"overlap_events": false}})", R"({"aio": {"overlap_events": 0}})"}) {
    try {
      parse_config(text);
      ADD_FAILURE() << "accepted " << text;
    } catch (const user_error& e) {
      EXPECT_NE(std::string(e.what()).find("aio.overlap_events"), std::string::npos) << e.what();
    }
  }
}

TEST(EngineConfig, BadValuesAreUserErrors) {
  EXPECT_THROW(make_engine({.queue_depth = 0}), user_error);
  EXPECT_THROW(make_engine({.block_size = 4097}), user_error);
  EXPECT_THROW(make_engine({.threads = 0}), user_error);
  EXPECT_THROW(parse_backend("spdk", "--backend"), user_error);
}

// A bad value in a config names the key it was read from, as the user spelt
// it, and the value; the CLI's flags keep their own words.
TEST(EngineConfig, AConfigErrorNamesTheKeyAndTheValue) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"aio": {"block_size": 1000}})", "aio.block_size: 1000 is not a multiple of 4096"},
      {R"({"aio": {"queue_depth": 0}})", "aio.queue_depth: 0 is not in 1..4096"},
      {R"({"aio": {"thread_count": 300}})", "aio.thread_count: 300 is not in 1..256"},
      {R"({"aio": {"intra_op_parallelism": -2}})", "aio.intra_op_parallelism: -2 is not a whole number"},
      {R"({"aio": {"queue_depth": "deep"}})", "aio.queue_depth: \"deep\" is not a whole number"},
      {R"({"io": {"submit_batch": 5000}})", "io.submit_batch: 5000 is over 4096"},
      {R"({"aio": {"single_submit": "yes"}})", "aio.single_submit: \"yes\" is not true or false"},
  };
  for (const auto& [text, expected] : cases) {
    try {
      parse_config(text);
      ADD_FAILURE() << "accepted " << text;
    } catch (const user_error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
  try {
    make_engine({.block_size = 4097});
    ADD_FAILURE() << "accepted a block size of 4097";
  } catch (const user_error& e) {
    EXPECT_NE(std::string(e.what()).find("block size: 4097"), std::string::npos) << e.what();
  }
}

// The flags of the mapping holding `address`, from /proc/self/smaps ("" when not found).
std::string mapping_flags(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long long begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx ", &begin, &end) == 2) inside = begin <= at && at < end;
    else if (inside && line.rfind("VmFlags:", 0) == 0) return line.substr(8) + " ";
  }
  return "";
}

// A 1 MiB block in scattered 4 KiB pages is 256 segments, split by the block
// layer; inside a huge page it is one. Buffers of a huge page or more ask for them.
TEST(AlignedBuffer, AHugePageOrMoreIsAlignedToItAndAsksForHugePages) {
  struct stat st {};
  if (::stat("/sys/kernel/mm/transparent_hugepage", &st) != 0) GTEST_SKIP() << "no transparent huge pages in this kernel";
  aligned_buffer large(32u << 20);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(large.data()) % aligned_buffer::huge_page_size, 0u);
  const std::string flags = mapping_flags(large.data());
  ASSERT_FALSE(flags.empty()) << "the buffer is in no mapping of /proc/self/smaps";
  EXPECT_NE(flags.find(" hg "), std::string::npos) << "VmFlags:" << flags;
  EXPECT_EQ(large.data()[(32u << 20) - 1], std::byte{0});  // zero-filled to the end
}

TEST(File, RefusesASymlinkInPlaceOfTheFile) {
  scratch_dir dir;
  { file::open(dir.file("real"), {.creation = creation::if_missing}); }
  ASSERT_EQ(::symlink(dir.file("real").c_str(), dir.file("link").c_str()), 0);
  try {
    file::open(dir.file("link"), {});
    FAIL();
  } catch (const tierflow::error& e) {
    EXPECT_EQ(e.errnum(), ELOOP);
    EXPECT_EQ(e.context().path, dir.file("link"));
  }
  EXPECT_THROW(file::open(dir.file("real"), {.creation = creation::exclusive}), tierflow::error);
}

TEST(File, FallsBackToThePageCacheWhereODirectIsRefused) {
  // /dev/shm is a tmpfs; newer kernels accept O_DIRECT there, older refuse it.
  scratch_dir dir("/dev/shm");
  if (dir.path().empty()) GTEST_SKIP() << "no /dev/shm";
  file f = file::open(dir.file("x"), {.creation = creation::if_missing, .direct = direct_io::prefer});
  auto eng = make_engine({.backend = backend_kind::threads});
  const auto data = random_bytes(10000, 5);
  eng->write(f, 3, data);
  std::vector<std::byte> back(data.size());
  eng->read(f, 3, back);
  EXPECT_EQ(back, data);
}

}  // namespace
}  // namespace tierflow::io
