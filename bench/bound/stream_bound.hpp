// An Adam step's memory bound measured without tierflow's kernels: a plain
// loop over exactly the streams the step moves (the same widths, the same
// bytes per parameter), compiled on its own at -O3 with one clone per x86-64
// vector level chosen at run time, and glibc's memcpy over the same number of
// bytes. `tierflow bench optim` holds the step to the higher of the two.
#pragma once

#include <barrier>
#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

#include "tierflow/tiers/host_memory.hpp"

namespace tierflow::bound {

// The streams of one Adam step, per parameter: the fp32 master parameter is
// always read and written; the rest follow the step's dtypes.
struct adam_streams {
  unsigned grad_bytes = 4;        // read: 4 (fp32) or 2 (bf16, fp16)
  unsigned state_bytes = 4;       // m and v, each read and written: 4 or 2
  unsigned copy_bytes = 0;        // the model's copy written: 0 (none) or 2
  bool grad_read_twice = false;   // a finite check reads the gradients first

  // Reads plus writes per parameter, as adam_optimizer::bytes_per_param counts
  // them (plus the finite check's second read of g).
  std::size_t bytes_per_param() const noexcept;
};

// Worker threads that stay up between passes, so that a pass costs what the
// memory costs and not a thread start (the optimizer's pool stays up too).
class team {
 public:
  explicit team(int threads);
  ~team();
  team(const team&) = delete;
  team& operator=(const team&) = delete;

  int size() const noexcept { return size_; }
  // Runs job(k) for k in [0, size()) on the team, the caller being k = 0;
  // returns when every k has finished.
  void run(const std::function<void(int)>& job);

 private:
  void work(int k);

  int size_;
  std::barrier<> start_;
  std::barrier<> done_;
  const std::function<void(int)>* job_ = nullptr;  // written before start_, read after it
  bool stop_ = false;
  std::vector<std::jthread> workers_;
};

class stream_bound {
 public:
  // Maps and first-touches, on `threads` threads and in the partition the
  // passes use, the streams for `params` parameters and the two memcpy
  // buffers of bytes_per_param() * params / 2 bytes each. Throws user_error
  // for params == 0 or threads < 1, tierflow::error when mapping fails.
  stream_bound(std::size_t params, adam_streams streams, int threads, tiers::huge_pages pages);

  // One pass of the plain loop over every stream; returns its seconds.
  double stream_pass();
  // One memcpy of the source buffer over the destination, split across the
  // threads; returns its seconds.
  double memcpy_pass();

  std::size_t params() const noexcept { return params_; }
  // Bytes one stream pass moves (reads plus writes).
  std::size_t stream_bytes() const noexcept { return streams_.bytes_per_param() * params_; }
  // Bytes one memcpy pass moves: its length read plus its length written.
  std::size_t memcpy_bytes() const noexcept { return 2 * copy_length_; }

 private:
  struct region {
    tiers::host_region mapping;
    std::byte* data = nullptr;
  };
  std::byte* map(std::size_t bytes, tiers::huge_pages pages);
  std::pair<std::size_t, std::size_t> share(int k, std::size_t count) const noexcept;

  std::size_t params_;
  adam_streams streams_;
  team team_;
  std::vector<region> regions_;
  std::byte *p_ = nullptr, *g_ = nullptr, *m_ = nullptr, *v_ = nullptr, *copy_ = nullptr;
  std::byte *copy_source_ = nullptr, *copy_target_ = nullptr;
  std::size_t copy_length_ = 0;
};

}  // namespace tierflow::bound
