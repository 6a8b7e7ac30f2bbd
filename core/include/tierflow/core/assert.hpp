// Broken invariants are bugs: they abort with the file and line, never throw
// something a caller could catch and carry on from.
#pragma once

namespace tierflow::detail {
[[noreturn]] void assertion_failed(const char* expression, const char* file, int line,
                                   const char* message) noexcept;
}  // namespace tierflow::detail

// Always checked, in every build type: use it for invariants whose check is
// cheap next to the work around it.
#define TF_ASSERT(cond, ...)                                                         \
  do {                                                                               \
    if (!(cond)) [[unlikely]]                                                        \
      ::tierflow::detail::assertion_failed(#cond, __FILE__, __LINE__, "" __VA_ARGS__); \
  } while (0)

// Checked in debug builds only: for per-element or per-request hot paths.
#ifdef NDEBUG
#define TF_DEBUG_ASSERT(cond, ...) ((void)0)
#else
#define TF_DEBUG_ASSERT(cond, ...) TF_ASSERT(cond, __VA_ARGS__)
#endif
