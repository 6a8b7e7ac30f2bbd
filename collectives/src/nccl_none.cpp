// The NCCL backend in a build without CUDA or NCCL: the same declarations,
// which say so.

#include <string>

#include "tierflow/collectives/nccl.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::collectives {

namespace {

[[noreturn]] void no_nccl(const char* what) {
  throw error(ENOTSUP, error_context{what},
              std::string(what) + ": this tierflow was built without NCCL (no CUDA, or no nccl.h and libnccl)");
}

}  // namespace

int nccl_version() noexcept { return 0; }

std::unique_ptr<nccl_communicator> make_nccl_communicator(const nccl_options&) { no_nccl("make_nccl_communicator"); }

nccl_memory nccl_memory::allocate(std::size_t) { no_nccl("nccl_memory"); }
nccl_memory::nccl_memory(nccl_memory&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {}
nccl_memory& nccl_memory::operator=(nccl_memory&&) noexcept { return *this; }
nccl_memory::~nccl_memory() = default;
void nccl_memory::reset() noexcept {}

ce_crossover measure_ce_crossover(int, const crossover_sweep&) { no_nccl("measure_ce_crossover"); }

}  // namespace tierflow::collectives
