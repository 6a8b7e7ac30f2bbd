// probe_cuda() in a build without CUDA: nothing to probe, and it says so.
#include "tierflow/tiers/cuda_probe.hpp"

namespace tierflow::tiers {

cuda_status probe_cuda() {
  cuda_status out;
  out.reason = "this tierflow was built without CUDA (TIERFLOW_CUDA=OFF or no nvcc)";
  return out;
}

}  // namespace tierflow::tiers
