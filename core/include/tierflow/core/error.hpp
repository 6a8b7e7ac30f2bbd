// The one error vocabulary of tierflow.
//
// Environment failures (a syscall, io_uring completion, CUDA or NCCL call that
// failed) throw `tierflow::error`, a std::system_error that also carries the
// context a user needs to act on it: the operation, the path, the offset and
// length, the tier and the block. Bad user input (a flag, a config value, an
// argument out of range) throws `tierflow::user_error`, of the same family with
// EINVAL, whose message is one line meant to be printed as it is.
//
// Broken invariants are bugs, not errors: see assert.hpp.
#pragma once

#include <cstdint>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>
#include <system_error>

namespace tierflow {

// What was being done when an error happened. Every field is optional; the
// message names those that are set.
struct error_context {
  std::string operation;  // "read", "open", "cudaMemcpyAsync", ...
  std::string path;       // the file or directory
  std::optional<std::uint64_t> offset;
  std::optional<std::uint64_t> length;
  std::string tier;   // "device", "host", "nvme"
  std::string block;  // the block's name

  // Fluent setters, so a call site can write
  //   error_context{"read"}.at(path).range(offset, length)
  error_context& at(std::string p) & { path = std::move(p); return *this; }
  error_context&& at(std::string p) && { path = std::move(p); return std::move(*this); }
  error_context& range(std::uint64_t off, std::uint64_t len) & { offset = off; length = len; return *this; }
  error_context&& range(std::uint64_t off, std::uint64_t len) && { offset = off; length = len; return std::move(*this); }
  error_context& in_tier(std::string t) & { tier = std::move(t); return *this; }
  error_context&& in_tier(std::string t) && { tier = std::move(t); return std::move(*this); }
  error_context& of_block(std::string b) & { block = std::move(b); return *this; }
  error_context&& of_block(std::string b) && { block = std::move(b); return std::move(*this); }
};

// The base of every exception tierflow throws on purpose.
// what() reads, for example:
//   read /nvme/tf/state.0 (offset 4096, length 1048576, tier nvme, block "l3.exp_avg"):
//   Input/output error [io/src/uring_engine.cpp:211]
class error : public std::system_error {
 public:
  error(std::error_code code, error_context context,
        std::source_location where = std::source_location::current());
  error(int errnum, error_context context,
        std::source_location where = std::source_location::current());
  // A failure its thrower words itself: what() is `message` as it is (one
  // line naming the thing, e.g. "directory /proc: cannot be written: ..."),
  // while errno and `context` stay for programs (Python's OSError.errno and
  // .filename).
  error(int errnum, error_context context, std::string message,
        std::source_location where = std::source_location::current());

  const error_context& context() const noexcept { return context_; }
  // The errno (or the CUDA/NCCL status, see code().category()).
  int errnum() const noexcept { return code().value(); }
  // Where it was thrown: "file:line".
  std::string where() const;
  const char* what() const noexcept override { return message_.c_str(); }

 protected:
  // For subclasses that word their message themselves.
  error(std::error_code code, error_context context, std::source_location where,
        std::string message);

 private:
  error_context context_;
  std::source_location where_;
  std::string message_;
};

// A mistake in what the user asked for: a flag, a config value, an argument.
// Its what() is exactly the one line to show, without errno text or file:line.
class user_error : public error {
 public:
  explicit user_error(std::string message,
                      std::source_location where = std::source_location::current());
};

// Throws tierflow::error for `errnum` (an errno value) with `context`.
[[noreturn]] void throw_errno(int errnum, error_context context,
                              std::source_location where = std::source_location::current());

namespace detail {
std::string describe(const error_context& context);
}  // namespace detail

}  // namespace tierflow

// TF_CHECK_SYSCALL(expr, context): evaluates `expr`; when it returns -1, captures
// errno at once and throws tierflow::error. `context` (an error_context
// expression) is only built on failure. Yields the call's result otherwise.
#define TF_CHECK_SYSCALL(expr, context)                               \
  ([&]() {                                                            \
    auto tf_result_ = (expr);                                         \
    if (tf_result_ == -1) [[unlikely]] {                              \
      const int tf_errno_ = errno;                                    \
      ::tierflow::throw_errno(tf_errno_, (context));                  \
    }                                                                 \
    return tf_result_;                                                \
  }())

// TF_CHECK_ERRNO_RESULT(res, context): for APIs that return -errno (io_uring
// completions, liburing calls): a negative `res` throws with errno = -res.
#define TF_CHECK_ERRNO_RESULT(res, context)                           \
  do {                                                                \
    const auto tf_res_ = (res);                                       \
    if (tf_res_ < 0) [[unlikely]] {                                   \
      ::tierflow::throw_errno(static_cast<int>(-tf_res_), (context)); \
    }                                                                 \
  } while (0)
