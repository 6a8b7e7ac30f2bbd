// cuda_steps in a build without CUDA: make_plan refuses --device cuda first,
// so this only keeps the promise of steps.hpp.
#include "offload/steps.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::bench {

step_loop_output cuda_steps(const step_loop_inputs&) {
  throw user_error("--device cuda: this tierflow was built without CUDA (TIERFLOW_CUDA=OFF or no nvcc found)");
}

}  // namespace tierflow::bench
