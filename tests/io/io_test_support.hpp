// Shared by the io/ suites: the backend parameter, scratch directories on a
// real filesystem, and reproducible data.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tierflow/io/engine.hpp"
#include "tierflow/io/probe.hpp"

namespace tierflow::io::testing {

// A fresh directory on a disk-backed filesystem (O_DIRECT works there),
// removed with its contents on destruction.
class scratch_dir {
 public:
  explicit scratch_dir(const std::string& parent = default_parent()) {
    std::string tmpl = parent + "/tierflow-io-test-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~scratch_dir() {
    if (!path_.empty()) std::system(("rm -rf '" + path_ + "'").c_str());
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

  // $TMPDIR, else /var/tmp (disk-backed on most systems, unlike a tmpfs /tmp).
  static std::string default_parent() {
    const char* env = std::getenv("TMPDIR");
    if (env != nullptr && *env != '\0') return env;
    return ::access("/var/tmp", W_OK) == 0 ? "/var/tmp" : "/tmp";
  }

 private:
  std::string path_;
};

inline std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> out(n);
  std::mt19937_64 rng(seed);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(out.data() + i, &v, 8);
  }
  for (; i < n; ++i) out[i] = static_cast<std::byte>(rng());
  return out;
}

// The backends every io test runs on; uring is skipped (with the reason)
// where this process cannot set up a ring.
inline std::vector<backend_kind> backends() { return {backend_kind::uring, backend_kind::threads}; }

// So test names and messages read "uring", not a byte dump.
}  // namespace tierflow::io::testing
namespace tierflow::io {
inline void PrintTo(backend_kind kind, std::ostream* os) { *os << to_string(kind); }
}  // namespace tierflow::io
namespace tierflow::io::testing {

inline std::string backend_name(const ::testing::TestParamInfo<backend_kind>& info) {
  return to_string(info.param);
}

class backend_test : public ::testing::TestWithParam<backend_kind> {
 protected:
  void SetUp() override {
    if (GetParam() == backend_kind::uring && !probe_uring().available) {
      GTEST_SKIP() << "io_uring unavailable here: " << probe_uring().reason;
    }
  }
  engine_config config(unsigned queue_depth = 8, std::size_t block_size = 64 * 1024, unsigned threads = 1) const {
    engine_config c;
    c.backend = GetParam();
    c.queue_depth = queue_depth;
    c.block_size = block_size;
    c.threads = threads;
    return c;
  }
};

}  // namespace tierflow::io::testing
