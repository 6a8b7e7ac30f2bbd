#include "tierflow/core/assert.hpp"

#include <cstdio>
#include <cstdlib>

namespace tierflow::detail {

void assertion_failed(const char* expression, const char* file, int line,
                      const char* message) noexcept {
  std::fprintf(stderr, "tierflow: internal error: assertion `%s` failed at %s:%d%s%s\n",
               expression, file, line, (message && *message) ? ": " : "", message ? message : "");
  std::fflush(stderr);
  std::abort();
}

}  // namespace tierflow::detail
