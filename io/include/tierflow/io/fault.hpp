// The fault-injection seam: makes chosen I/O requests fail with an errno or
// complete short, for what the kernel will not do on demand (EIO, a short
// write). Both backends consult it for every request they hand to the kernel
// (each chunk, and each resubmission of a chunk's remainder).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/core/thread_annotations.hpp"
#include "tierflow/io/operation.hpp"

namespace tierflow::io {

// Which requests a rule counts.
struct fault_match {
  std::optional<op_kind> kind;       // read or write; any when empty
  std::string path_contains;         // substring of the file's path; any when empty
  std::uint64_t offset_from = 0;     // requests that start in [offset_from, offset_to)
  std::uint64_t offset_to = UINT64_MAX;
};

// What happens to the chosen requests.
struct fault_action {
  int errnum = 0;                // complete with -errnum (EIO, ENOSPC, EINTR, EAGAIN, ...)
  std::uint64_t short_by = 0;    // or: submit this many bytes fewer (a genuinely short completion)
};

struct fault_rule {
  fault_match match;
  std::uint64_t nth = 1;     // the first matching request it hits (1-based)
  std::uint64_t times = 1;   // how many consecutive matching requests from there
  fault_action action;
};

// What the seam decided for one request.
struct fault_decision {
  int errnum = 0;             // non-zero: fail with this errno, do not submit
  std::uint64_t length = 0;   // the length to submit (shortened when short_by)
};

class fault_injector {
 public:
  // Adds a rule; rules are tried in order, the first that fires decides.
  void add(const fault_rule& rule) TF_EXCLUDES(mutex_);
  // Removes every rule and resets the counts.
  void clear() TF_EXCLUDES(mutex_);
  // Called by the engines for each request about to go to the kernel. Thread-safe.
  fault_decision decide(op_kind kind, const std::string& path, std::uint64_t offset,
                        std::uint64_t length) TF_EXCLUDES(mutex_);
  // How many requests were failed or shortened so far.
  std::uint64_t fired() const TF_EXCLUDES(mutex_);

 private:
  struct armed_rule {
    fault_rule rule;
    std::uint64_t seen = 0;
  };
  mutable mutex mutex_;
  std::vector<armed_rule> rules_ TF_GUARDED_BY(mutex_);
  std::uint64_t fired_ TF_GUARDED_BY(mutex_) = 0;
};

}  // namespace tierflow::io
