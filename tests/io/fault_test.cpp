// The fault seam on both backends: EIO, ENOSPC, short reads and writes,
// EINTR/EAGAIN; a failed request never reports success, a short one is
// finished, and everything else still works.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include <gtest/gtest.h>

#include "io_test_support.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/io/aligned_buffer.hpp"
#include "tierflow/io/engine.hpp"
#include "tierflow/io/fault.hpp"

namespace tierflow::io {
namespace {

using testing::backend_test;
using testing::random_bytes;
using testing::scratch_dir;

class Faults : public backend_test {
 protected:
  void SetUp() override {
    backend_test::SetUp();
    if (IsSkipped()) return;
    faults = std::make_shared<fault_injector>();
    engine_config c = config(4, 16 * 1024);
    c.faults = faults;
    eng = make_engine(c);
    f.emplace(file::open(dir.file("f"), {.creation = creation::if_missing}));
    data = random_bytes(256 * 1024, 21);
    memory = aligned_buffer(data.size());
    std::memcpy(memory.data(), data.data(), data.size());
    eng->write(*f, 0, memory.span());
    faults->clear();
  }
  void TearDown() override {
    eng.reset();
    f.reset();
  }

  // Submits `op`, waits, returns its error (or nullopt).
  std::optional<tierflow::error> run(operation& op) {
    eng->submit(op);
    try {
      op.wait();
    } catch (const tierflow::error& e) {
      return e;
    }
    return std::nullopt;
  }

  scratch_dir dir;
  std::shared_ptr<fault_injector> faults;
  std::unique_ptr<engine> eng;
  std::optional<file> f;
  std::vector<std::byte> data;
  aligned_buffer memory;
};

TEST_P(Faults, NthMatchingRequestFailsWithEio) {
  // The 3rd read chunk of the request fails: the request fails, naming
  // operation, file, offset, length and errno; it is not partially "successful".
  // Queue depth 1: the chunks reach the seam in file order on both backends.
  engine_config c = config(1, 16 * 1024);
  c.faults = faults;
  eng = make_engine(c);
  faults->add({.match = {.kind = op_kind::read}, .nth = 3, .action = {.errnum = EIO}});
  aligned_buffer into(data.size());
  operation op;
  op.prepare_read(*f, 0, into.span());
  const auto e = run(op);
  ASSERT_TRUE(e.has_value());
  EXPECT_TRUE(op.failed());
  EXPECT_EQ(e->errnum(), EIO);
  EXPECT_EQ(e->context().path, f->path());
  EXPECT_EQ(e->context().offset, 0u);
  EXPECT_EQ(e->context().length, data.size());
  EXPECT_NE(std::string(e->what()).find("read"), std::string::npos);
  EXPECT_NE(std::string(e->what()).find("failed at offset 32768"), std::string::npos) << e->what();
  EXPECT_EQ(faults->fired(), 1u);
  // The rule is spent: the same request now succeeds.
  op.prepare_read(*f, 0, into.span());
  EXPECT_FALSE(run(op).has_value());
  EXPECT_EQ(std::memcmp(into.data(), data.data(), data.size()), 0);
}

TEST_P(Faults, EnospcOnAWriteIsReported) {
  faults->add({.match = {.kind = op_kind::write, .offset_from = 64 * 1024}, .action = {.errnum = ENOSPC}});
  operation op;
  op.prepare_write(*f, 0, memory.span());
  const auto e = run(op);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->errnum(), ENOSPC);
  EXPECT_EQ(e->context().operation.rfind("write", 0), 0u);
  EXPECT_LT(op.bytes_transferred(), data.size());
}

TEST_P(Faults, ShortReadsAndWritesAreResubmittedToTheEnd) {
  // Every chunk of the request comes back short, several times over: the
  // engine carries on from where each stopped.
  faults->add({.match = {.kind = op_kind::write}, .nth = 1, .times = 20, .action = {.short_by = 5000}});
  const auto other = random_bytes(data.size(), 22);
  std::memcpy(memory.data(), other.data(), other.size());
  operation op;
  op.prepare_write(*f, 0, memory.span());
  ASSERT_FALSE(run(op).has_value());
  EXPECT_EQ(op.bytes_transferred(), data.size());
  EXPECT_EQ(faults->fired(), 20u);

  faults->clear();
  faults->add({.match = {.kind = op_kind::read}, .nth = 2, .times = 10, .action = {.short_by = 1}});
  aligned_buffer into(data.size());
  op.prepare_read(*f, 3, {into.data() + 3, data.size() - 3});
  ASSERT_FALSE(run(op).has_value());
  EXPECT_EQ(op.bytes_transferred(), data.size() - 3);
  EXPECT_EQ(std::memcmp(into.data() + 3, other.data() + 3, data.size() - 3), 0);
}

TEST_P(Faults, EintrAndEagainAreRetried) {
  faults->add({.match = {.kind = op_kind::read}, .nth = 1, .times = 3, .action = {.errnum = EINTR}});
  faults->add({.match = {.kind = op_kind::read}, .nth = 4, .times = 3, .action = {.errnum = EAGAIN}});
  aligned_buffer into(data.size());
  operation op;
  op.prepare_read(*f, 0, into.span());
  ASSERT_FALSE(run(op).has_value());
  EXPECT_EQ(std::memcmp(into.data(), data.data(), data.size()), 0);
  EXPECT_GE(faults->fired(), 6u);
}

TEST_P(Faults, EndlessEagainEventuallyFails) {
  faults->add({.match = {.kind = op_kind::read}, .nth = 1, .times = 1000000, .action = {.errnum = EAGAIN}});
  aligned_buffer into(4096);
  operation op;
  op.prepare_read(*f, 0, into.span());
  const auto e = run(op);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->errnum(), EAGAIN);
}

TEST_P(Faults, AFailureOnOneFileLeavesOthersAlone) {
  file g = file::open(dir.file("other"), {.creation = creation::if_missing});
  faults->add({.match = {.path_contains = "/f"}, .nth = 1, .times = 1000, .action = {.errnum = EIO}});
  operation bad, good;
  bad.prepare_write(*f, 0, memory.span());
  good.prepare_write(g, 0, memory.span());
  eng->submit(bad);
  eng->submit(good);
  good.wait();
  bad.wait_quietly();
  EXPECT_TRUE(bad.failed());
  EXPECT_EQ(bad.errnum(), EIO);
  EXPECT_EQ(g.size(), data.size());
}

INSTANTIATE_TEST_SUITE_P(Backends, Faults, ::testing::ValuesIn(testing::backends()), testing::backend_name);

}  // namespace
}  // namespace tierflow::io
