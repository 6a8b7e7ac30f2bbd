// The one translation of tierflow's C++ exceptions into Python's:
//
//   tierflow::user_error       -> ValueError (its one-line message as it is)
//   tierflow::budget_exceeded  -> tierflow.BudgetError (MemoryError and TierflowError)
//   tierflow::error            -> tierflow.TierflowError (an OSError)
//
// The Python classes live in tierflow/errors.py, where their attributes are
// documented; they are looked up when the first error is raised, so that the
// extension imports on its own (as the stub generator does).
#include <exception>
#include <optional>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "bindings.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/tier.hpp"

namespace nb = nanobind;

namespace tierflow::python {
namespace {

nb::object none_if_empty(const std::string& s) { return s.empty() ? nb::none() : nb::cast(s); }

nb::object optional_number(const std::optional<std::uint64_t>& v) {
  return v ? nb::cast(*v) : nb::none();
}

// Raises an instance of tierflow.errors.<class_name> built from `e`; falls
// back to a plain OSError when the Python package is not importable.
void raise_as(const char* class_name, const tierflow::error& e, const nb::kwargs& extra) {
  const error_context& c = e.context();
  try {
    nb::object type = nb::module_::import_("tierflow.errors").attr(class_name);
    nb::kwargs kw;
    kw["filename"] = none_if_empty(c.path);
    kw["operation"] = none_if_empty(c.operation);
    kw["offset"] = optional_number(c.offset);
    kw["length"] = optional_number(c.length);
    kw["tier"] = none_if_empty(c.tier);
    kw["block"] = none_if_empty(c.block);
    kw["where"] = e.where();
    for (auto [key, value] : extra) kw[key] = value;
    nb::object instance = type(e.errnum(), std::string(e.what()), **kw);
    PyErr_SetObject(type.ptr(), instance.ptr());
  } catch (nb::python_error&) {
    PyErr_Format(PyExc_OSError, "%s", e.what());
  }
}

void translate(const std::exception_ptr& thrown, void*) {
  try {
    std::rethrow_exception(thrown);
  } catch (const user_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const budget_exceeded& e) {
    nb::kwargs extra;
    extra["budget"] = e.budget();
    extra["request"] = e.request();
    raise_as("BudgetError", e, extra);
  } catch (const tierflow::error& e) {
    raise_as("TierflowError", e, nb::kwargs());
  }
}

}  // namespace

void register_errors(nb::module_&) { nb::register_exception_translator(&translate); }

}  // namespace tierflow::python
