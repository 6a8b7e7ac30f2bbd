// cuda_zenflow_device in a build without CUDA: it cannot be made, and says so.
#include "tierflow/core/error.hpp"
#include "tierflow/optim/zenflow_cuda.hpp"

namespace tierflow::optim {
namespace {

[[noreturn]] void no_cuda() { throw user_error("the CUDA ZenFlow device needs a CUDA build of tierflow"); }

}  // namespace

struct cuda_zenflow_device::impl {};

cuda_zenflow_device::cuda_zenflow_device(const std::vector<zenflow::weight_shape>&, std::vector<cuda_zenflow_weight>,
                                         const cuda_zenflow_options&) {
  no_cuda();
}
cuda_zenflow_device::~cuda_zenflow_device() = default;

// Unreachable: no object is ever constructed.
void cuda_zenflow_device::initialize(std::size_t, std::span<const float>) { no_cuda(); }
std::span<const std::uint32_t> cuda_zenflow_device::owned_columns(std::size_t) const { no_cuda(); }
cuda_zenflow_traffic cuda_zenflow_device::traffic() const { no_cuda(); }
void cuda_zenflow_device::set_adam(const adam_options&) { no_cuda(); }
bool cuda_zenflow_device::read_owned(std::size_t, const zenflow::packed_columns&) { no_cuda(); }
bool cuda_zenflow_device::write_owned(std::size_t, const zenflow::packed_columns&) { no_cuda(); }
void cuda_zenflow_device::column_importance(std::size_t, zenflow::importance_norm, std::span<float>) { no_cuda(); }
void cuda_zenflow_device::update_owned(std::size_t, std::int64_t) { no_cuda(); }
std::span<const float> cuda_zenflow_device::download_gradient(std::size_t) { no_cuda(); }
void cuda_zenflow_device::gradients_ready(std::span<const void* const>) { no_cuda(); }
void cuda_zenflow_device::gradients_ready() { no_cuda(); }
bool cuda_zenflow_device::accumulate_gradient(std::size_t, std::span<const zenflow::column_run>, std::span<float>) {
  no_cuda();
}
void cuda_zenflow_device::stage_upload(std::size_t, std::span<const zenflow::column_run>, std::span<const float>) {
  no_cuda();
}
void cuda_zenflow_device::apply_staged(std::size_t, std::span<const zenflow::column_run>) { no_cuda(); }
void cuda_zenflow_device::hand_over(std::size_t, std::span<const std::uint32_t>, const zenflow::packed_columns&,
                                    const zenflow::packed_columns&) {
  no_cuda();
}

}  // namespace tierflow::optim
