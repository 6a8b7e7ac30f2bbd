// tierflow._core: the one extension module of the tierflow Python package.
// The pure-Python package (bindings/tierflow/) re-exports what users call.
#include <nanobind/nanobind.h>

#include "bindings.hpp"
#include "tierflow/core/version.hpp"

NB_MODULE(_core, m) {
  m.doc() = "tierflow's C++ core: probes, the CPU optimizers' steps, the block store, the config readers and the error family";
  m.attr("__version__") = tierflow::version;
  tierflow::python::register_errors(m);
  tierflow::python::bind_info(m);
  tierflow::python::bind_optim(m);
  tierflow::python::bind_muon(m);
  tierflow::python::bind_store(m);
  tierflow::python::bind_config(m);
  tierflow::python::bind_offloaded_adam(m);
  tierflow::python::bind_zenflow(m);
  tierflow::python::bind_aio(m);
  tierflow::python::bind_collectives(m);
}
