// make_cuda_timeline in a build without CUDA: make_plan refuses --device cuda
// first, so this only keeps the promise of steps.hpp.
#include "offload/steps.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::bench {

std::unique_ptr<device_timeline> make_cuda_timeline(const offload_plan&, std::span<const float>, float) {
  throw user_error("--device cuda: this tierflow was built without CUDA (TIERFLOW_CUDA=OFF or no nvcc found)");
}

}  // namespace tierflow::bench
