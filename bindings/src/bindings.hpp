// The parts of the tierflow._core extension, each binding one area of the
// C++ library onto the module (module.cpp calls them in order).
#pragma once

#include <nanobind/nanobind.h>

namespace tierflow::python {

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

}  // namespace tierflow::python
