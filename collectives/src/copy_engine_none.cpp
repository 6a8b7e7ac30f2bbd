// peer_copy_group and probe_ce_topology in a build without CUDA: they say so.

#include <string>

#include "tierflow/collectives/copy_engine.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::collectives {

namespace {

[[noreturn]] void no_cuda(const char* what) {
  throw error(ENOTSUP, error_context{what},
              std::string(what) + ": this tierflow was built without CUDA (TIERFLOW_CUDA=OFF or no nvcc)");
}

}  // namespace

struct peer_copy_group::state {};

peer_copy_group::peer_copy_group(std::vector<int>, std::vector<CUstream_st*>, std::shared_ptr<ce_telemetry>) {
  no_cuda("peer_copy_group");
}
peer_copy_group::~peer_copy_group() = default;
int peer_copy_group::size() const noexcept { return 0; }
CUstream_st* peer_copy_group::stream(int) const noexcept { return nullptr; }
bool peer_copy_group::batched() const noexcept { return false; }
work_ptr peer_copy_group::all_gather(std::span<const void* const>, std::span<void* const>,
                                     std::span<const std::size_t>, dtype) {
  no_cuda("peer_copy_group");
}
work_ptr peer_copy_group::broadcast(std::span<void* const>, std::size_t, dtype, int) { no_cuda("peer_copy_group"); }

ce_topology probe_ce_topology(std::span<const int>) { no_cuda("probe_ce_topology"); }

}  // namespace tierflow::collectives
