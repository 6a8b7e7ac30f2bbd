// The backends behind make_engine().
#pragma once

#include <memory>

#include "tierflow/io/engine.hpp"

namespace tierflow::io::detail {

// Throws tierflow::error when no ring can be set up with this configuration.
std::unique_ptr<engine> make_uring_engine(const engine_config& config);
std::unique_ptr<engine> make_thread_engine(const engine_config& config);

}  // namespace tierflow::io::detail
