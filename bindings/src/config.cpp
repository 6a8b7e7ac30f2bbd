// The C++ readers behind tierflow.config.from_deepspeed(): the sections of a
// DeepSpeed config whose keys the C++ library already parses are handed to
// those parsers as they are, so that each key is checked in one place for the
// CLI, the engine and Python:
//
//   zenflow_config(section)  zero_optimization.zenflow -> zenflow::from_json, then resolve
//   aio_config(section)      aio -> io::parse_config (the snippet `tierflow tune io` writes)
//   parse_size(text, what)   "8G", "512M" -> bytes, as the CLI's size flags read them
//
// A bad key or value is a tierflow::user_error, which errors.cpp raises as a
// ValueError with the parser's one-line message (it names the key and value).
#include <cstdint>
#include <optional>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nlohmann/json.hpp>

#include "bindings.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/core/zenflow/config.hpp"
#include "tierflow/io/engine.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {
namespace {

// A Python value as JSON: what json.dumps() accepts, NaN and infinities kept
// as numbers so that the C++ checks refuse them by name. `where` is the dotted
// key, for the error about anything else.
nlohmann::json to_json(nb::handle value, const std::string& where) {
  if (value.is_none()) return nullptr;
  if (nb::isinstance<nb::bool_>(value)) return nb::cast<bool>(value);
  if (nb::isinstance<nb::int_>(value)) {
    std::int64_t small = 0;
    if (nb::try_cast(value, small)) return small;
    std::uint64_t large = 0;
    if (nb::try_cast(value, large)) return large;
    throw user_error(where + ": " + nb::cast<std::string>(nb::repr(value)) + " does not fit in 64 bits");
  }
  if (nb::isinstance<nb::float_>(value)) return nb::cast<double>(value);
  if (nb::isinstance<nb::str>(value)) return nb::cast<std::string>(value);
  if (nb::isinstance<nb::dict>(value)) {
    nlohmann::json object = nlohmann::json::object();
    for (auto [key, item] : nb::borrow<nb::dict>(value)) {
      if (!nb::isinstance<nb::str>(key))
        throw user_error(where + ": key " + nb::cast<std::string>(nb::repr(key)) + " is not a string");
      const std::string name = nb::cast<std::string>(key);
      object[name] = to_json(item, where + "." + name);
    }
    return object;
  }
  if (nb::isinstance<nb::list>(value) || nb::isinstance<nb::tuple>(value)) {
    nlohmann::json array = nlohmann::json::array();
    std::size_t i = 0;
    for (nb::handle item : value) array.push_back(to_json(item, where + "[" + std::to_string(i++) + "]"));
    return array;
  }
  throw user_error(where + ": " + nb::cast<std::string>(nb::repr(value)) + " is not a JSON value");
}

nb::object interval(const std::optional<std::uint64_t>& v) { return v ? nb::cast(*v) : nb::str("auto"); }

// zero_optimization.zenflow, read by zenflow::from_json (which refuses unknown
// keys and out-of-range values) and resolved to the schedule the engine runs.
nb::dict zenflow_config(const nb::dict& section) {
  const zenflow::config c = zenflow::from_json(to_json(section, "zenflow"));
  const zenflow::schedule s = zenflow::resolve(c);
  nb::dict out;
  out["topk_ratio"] = c.topk_ratio;
  out["select_strategy"] = zenflow::to_string(c.strategy);
  out["select_interval"] = interval(c.select_interval);
  out["update_interval"] = interval(c.update_interval);
  out["overlap_step"] = c.overlap_step;
  out["auto_ratio"] = c.auto_ratio;
  out["full_warm_up_rounds"] = c.full_warm_up_rounds;
  out["pt_reserved_cores_perc"] = c.pt_reserved_cores_perc;
  out["importance_norm"] = zenflow::to_string(c.norm);
  out["steps_per_epoch"] = c.steps_per_epoch ? nb::cast(*c.steps_per_epoch) : nb::none();
  nb::dict schedule;
  schedule["warm_up_steps"] = s.warm_up_steps;
  schedule["select_interval"] = s.select_interval;
  schedule["update_interval"] = s.update_interval ? nb::cast(*s.update_interval) : nb::none();
  schedule["select_interval_source"] = s.select_interval_source;
  out["schedule"] = schedule;
  return out;
}

// The aio section, read by io::parse_config as `tierflow tune io` snippets are.
nb::dict aio_config(const nb::dict& section) {
  nlohmann::json whole = nlohmann::json::object();
  whole["aio"] = to_json(section, "aio");
  return engine_options_of(io::parse_config(whole.dump()));
}

std::uint64_t size_of(const std::string& text, const std::string& what) { return parse_size(text, what); }

}  // namespace

void bind_config(nb::module_& m) {
  m.def("zenflow_config", &zenflow_config, "section"_a,
        "Reads a `zero_optimization.zenflow` dict with DeepSpeed's keys as the C++ engine does and\n"
        "returns its values with the resolved schedule under 'schedule'. An unknown key or a bad\n"
        "value raises ValueError naming it (\"zenflow.topk_ratio: 2 is outside (0, 1]\").");
  m.def("aio_config", &aio_config, "section"_a,
        "Reads an `aio` dict with DeepSpeed's keys as the I/O engine does and returns block_size,\n"
        "queue_depth, threads and submit_batch. A bad value raises ValueError naming the key.");
  m.def("parse_size", &size_of, "text"_a, "what"_a,
        "Bytes in a size written as the CLI's flags take it: a number with an optional K, M, G or T\n"
        "suffix (\"8G\", \"512M\"). Anything else, or zero, raises ValueError naming `what`.");
}

}  // namespace tierflow::python
