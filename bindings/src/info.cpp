// tierflow.info(): the object `tierflow info --json` prints, as a dict with
// the same keys and values — both come from tiers::machine_info().
#include <optional>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nlohmann/json.hpp>

#include "bindings.hpp"
#include "tierflow/tiers/machine_info.hpp"

namespace nb = nanobind;

namespace tierflow::python {
namespace {

// JSON as the Python value json.loads() would make of it.
nb::object to_python(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return nb::none();
    case nlohmann::json::value_t::boolean: return nb::bool_(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return nb::int_(j.get<std::int64_t>());
    case nlohmann::json::value_t::number_unsigned: return nb::int_(j.get<std::uint64_t>());
    case nlohmann::json::value_t::number_float: return nb::float_(j.get<double>());
    case nlohmann::json::value_t::string: return nb::str(j.get_ref<const std::string&>().c_str());
    case nlohmann::json::value_t::array: {
      nb::list out;
      for (const auto& item : j) out.append(to_python(item));
      return out;
    }
    case nlohmann::json::value_t::object: {
      nb::dict out;
      for (const auto& [key, value] : j.items()) out[key.c_str()] = to_python(value);
      return out;
    }
    default: return nb::none();  // binary and discarded values: machine_info() makes neither
  }
}

nb::dict info(const std::optional<std::string>& path) {
  nlohmann::json facts;
  {
    // The CUDA driver and the directory probe can take a while.
    nb::gil_scoped_release unlocked;
    facts = tiers::machine_info(path.value_or(std::string()));
  }
  return nb::borrow<nb::dict>(to_python(facts));
}

}  // namespace

void bind_info(nb::module_& m) {
  m.def("info", &info, nb::arg("path") = nb::none(),
        "What this machine offers tierflow, every fact probed: the dict `tierflow info --json`\n"
        "prints (CPU and SIMD level, cores and NUMA nodes, memory and the pinning limit,\n"
        "io_uring, CUDA devices; with `path`, that directory's filesystem, O_DIRECT and free\n"
        "space). A `path` that does not exist or cannot be written raises ValueError naming it.");
}

}  // namespace tierflow::python
