#include "tierflow/optim/executor.hpp"

#include <cstring>
#include <string>

#include "kernels.hpp"
#include "tiles.hpp"
#include "tierflow/core/assert.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::optim {

std::vector<std::string> simd_targets() {
  std::vector<std::string> names;
  for (auto& [bits, name] : detail::available_targets()) names.push_back(name);
  return names;
}

namespace {
std::int64_t pick_target(std::string_view simd, std::string& chosen) {
  const auto targets = detail::available_targets();
  TF_ASSERT(!targets.empty(), "Highway reports no usable target");
  if (simd == "auto") {
    chosen = targets.front().second;
    return targets.front().first;
  }
  std::string known;
  for (const auto& [bits, name] : targets) {
    if (name == simd) {
      chosen = name;
      return bits;
    }
    known += (known.empty() ? "" : ", ") + name;
  }
  throw user_error("--simd: '" + std::string(simd) + "' is not available here (choose auto, " +
                   known + ")");
}
}  // namespace

executor::executor(int threads, std::string_view simd)
    : threads_(threads),
      target_(0),
      arena_(threads >= 1 ? threads : 1, /*reserved_for_masters=*/1) {
  if (threads < 1) throw user_error("threads: must be at least 1, got " + std::to_string(threads));
  target_ = pick_target(simd, simd_name_);
}

void first_touch(executor& ex, tensor_ref buffer) {
  if (buffer.size == 0) return;
  if (buffer.data == nullptr) throw user_error("first_touch: null buffer");
  const std::size_t elem = size_of(buffer.type);
  auto* bytes = static_cast<unsigned char*>(buffer.data);
  detail::for_each_tile(ex, buffer.size, [&](std::size_t begin, std::size_t end) {
    std::memset(bytes + begin * elem, 0, (end - begin) * elem);
  });
}

}  // namespace tierflow::optim
