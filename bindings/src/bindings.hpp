// The parts of the tierflow._core extension, each binding one area of the
// C++ library onto the module (module.cpp calls them in order).
#pragma once

#include <nanobind/nanobind.h>

#include "tierflow/io/engine.hpp"

namespace tierflow::python {

// The I/O engine of an NVMe tier from a dict of block_size, queue_depth,
// threads and submit_batch (each optional: the engine's default), as a
// DeepSpeed config's aio section sets them; another key, or a value that is
// not a whole number in the engine's range, is a user_error naming aio.<key>.
// And back: the dict of a config. (store.cpp)
io::engine_config parse_engine_options(const nanobind::dict& options);
nanobind::dict engine_options_of(const io::engine_config& config);

// Maps the tierflow::error family onto Python's exceptions, once for every
// function of the module (see errors.cpp for the mapping).
void register_errors(nanobind::module_& m);

// info(path=None) -> dict: what `tierflow info --json` reports.
void bind_info(nanobind::module_& m);

// Executor, simd_targets(), adam_step(), AdamSlot, adam_step_group(), address_of().
void bind_optim(nanobind::module_& m);

// MuonWorkspace, muon_step(), group_parameters().
void bind_muon(nanobind::module_& m);

// Store: tiers with budgets and the blocks homed in them.
void bind_store(nanobind::module_& m);

// zenflow_config(), aio_config(), parse_size(): the C++ readers of config sections.
void bind_config(nanobind::module_& m);
// OffloadedAdam: Adam/AdamW state on NVMe, streamed through a host budget.
void bind_offloaded_adam(nanobind::module_& m);
// ZenFlowEngine: the ZenFlow engine over a model's parameters.
void bind_zenflow(nanobind::module_& m);
// AioHandle: DeepSpeed aio_handle's reads and writes over the I/O engine.
void bind_aio(nanobind::module_& m);
// GlooCommunicator, Work: collectives over CPU buffers between ranks.
void bind_collectives(nanobind::module_& m);

}  // namespace tierflow::python
