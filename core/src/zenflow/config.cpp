#include "tierflow/core/zenflow/config.hpp"

#include <cmath>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "tierflow/core/error.hpp"

namespace tierflow::zenflow {
namespace {

using nlohmann::json;

[[noreturn]] void refuse(const std::string& key, const json& value, const std::string& why) {
  throw user_error("zenflow." + key + ": " + value.dump() + " " + why);
}

double number(const json& j, const std::string& key) {
  if (!j.is_number()) refuse(key, j, "is not a number");
  return j.get<double>();
}

bool boolean(const json& j, const std::string& key) {
  if (!j.is_boolean()) refuse(key, j, "is not true or false");
  return j.get<bool>();
}

std::uint64_t count(const json& j, const std::string& key) {
  if (!j.is_number_integer() || j.get<std::int64_t>() < 0) refuse(key, j, "is not a whole number ≥ 0");
  return j.get<std::uint64_t>();
}

// "auto" or a positive whole number.
std::optional<std::uint64_t> interval(const json& j, const std::string& key) {
  if (j.is_string() && j.get<std::string>() == "auto") return std::nullopt;
  if (!j.is_number_integer() || j.get<std::int64_t>() < 1) refuse(key, j, "is not \"auto\" or a whole number ≥ 1");
  return j.get<std::uint64_t>();
}

}  // namespace

config from_json(const json& z) {
  if (!z.is_object()) throw user_error("zenflow: expected an object, got " + z.dump());
  static const std::set<std::string> known = {
      "topk_ratio",  "select_strategy", "select_interval",       "update_interval",
      "overlap_step", "offload",        "auto_ratio",            "full_warm_up_rounds",
      "pt_reserved_cores_perc", "importance_norm", "steps_per_epoch"};
  config c;
  for (const auto& [key, value] : z.items()) {
    if (!known.contains(key)) {
      throw user_error("zenflow." + key + ": unknown key");
    }
    if (key == "topk_ratio") c.topk_ratio = number(value, key);
    else if (key == "select_strategy") {
      const std::string s = value.is_string() ? value.get<std::string>() : "";
      if (s == "auto") c.strategy = select_strategy::automatic;
      else if (s == "step") c.strategy = select_strategy::step;
      else if (s == "epoch") c.strategy = select_strategy::epoch;
      else refuse(key, value, "is not \"auto\", \"step\" or \"epoch\"");
    } else if (key == "select_interval") c.select_interval = interval(value, key);
    else if (key == "update_interval") c.update_interval = interval(value, key);
    else if (key == "overlap_step") c.overlap_step = boolean(value, key);
    else if (key == "offload") {
      // DeepSpeed's default (false) is accepted so its configs carry over;
      // true would have the selected columns' moments cross PCIe twice in
      // every device update, and nothing here does that.
      if (boolean(value, key))
        refuse(key, value,
               "is not supported: the device keeps the selected columns' master values and moments in its own "
               "memory (12 bytes per element of the topk_ratio share); lower topk_ratio for less");
    }
    else if (key == "auto_ratio") c.auto_ratio = number(value, key);
    else if (key == "full_warm_up_rounds") c.full_warm_up_rounds = count(value, key);
    else if (key == "pt_reserved_cores_perc") c.pt_reserved_cores_perc = number(value, key);
    else if (key == "importance_norm") {
      const std::string s = value.is_string() ? value.get<std::string>() : "";
      if (s == "l1") c.norm = importance_norm::l1;
      else if (s == "l2") c.norm = importance_norm::l2;
      else refuse(key, value, "is not \"l1\" or \"l2\"");
    } else if (key == "steps_per_epoch") {
      if (!value.is_null()) c.steps_per_epoch = interval(value, key).value_or(0);
      if (c.steps_per_epoch == 0u) refuse(key, value, "is not a whole number ≥ 1");
    }
  }
  validate(c);
  return c;
}

void validate(const config& c) {
  auto bad = [](const std::string& key, double v, const char* why) {
    throw user_error("zenflow." + key + ": " + json(v).dump() + " " + why);
  };
  if (!std::isfinite(c.topk_ratio) || c.topk_ratio <= 0 || c.topk_ratio > 1)
    bad("topk_ratio", c.topk_ratio, "is outside (0, 1]");
  if (!std::isfinite(c.auto_ratio) || c.auto_ratio <= 0 || c.auto_ratio > 1)
    bad("auto_ratio", c.auto_ratio, "is outside (0, 1]");
  if (!std::isfinite(c.pt_reserved_cores_perc) || c.pt_reserved_cores_perc < 0 || c.pt_reserved_cores_perc >= 1)
    bad("pt_reserved_cores_perc", c.pt_reserved_cores_perc, "is outside [0, 1)");
  if (c.select_interval == 0u) bad("select_interval", 0, "must be ≥ 1");
  if (c.update_interval == 0u) bad("update_interval", 0, "must be ≥ 1");
  if (c.strategy == select_strategy::step && !c.select_interval)
    throw user_error("zenflow.select_interval: \"auto\" needs select_strategy \"auto\" or \"epoch\"; "
                     "with \"step\" give a number of steps");
  if (c.strategy == select_strategy::step && c.update_interval && *c.select_interval < *c.update_interval)
    throw user_error("zenflow.select_interval: " + std::to_string(*c.select_interval) +
                     " is less than update_interval " + std::to_string(*c.update_interval) +
                     " (a refresh must fall on an update boundary)");
}

schedule resolve(const config& c) {
  validate(c);
  schedule s;
  s.warm_up_steps = c.full_warm_up_rounds;
  s.update_interval = c.update_interval;
  const std::uint64_t fallback = c.update_interval ? 10 * *c.update_interval : 100;
  switch (c.strategy) {
    case select_strategy::step:
      s.select_interval = *c.select_interval;
      s.select_interval_source = "select_interval steps";
      break;
    case select_strategy::automatic:
    case select_strategy::epoch: {
      // "auto" is one epoch; "epoch" is select_interval epochs (default one).
      const std::uint64_t epochs =
          c.strategy == select_strategy::epoch ? c.select_interval.value_or(1) : 1;
      if (c.steps_per_epoch) {
        s.select_interval = epochs * *c.steps_per_epoch;
        s.select_interval_source = std::to_string(epochs) + " epoch(s) of " +
                                   std::to_string(*c.steps_per_epoch) + " steps";
      } else {
        s.select_interval = fallback;
        s.select_interval_source = "steps_per_epoch unknown: every " + std::to_string(fallback) + " steps";
      }
      break;
    }
  }
  // A refresh must fall on an update boundary: round it up to a whole number of windows.
  if (s.update_interval && s.select_interval % *s.update_interval != 0) {
    s.select_interval += *s.update_interval - s.select_interval % *s.update_interval;
    s.select_interval_source += ", rounded up to whole update windows";
  }
  return s;
}

bool is_select_boundary(const schedule& s, std::uint64_t step) {
  if (step < s.warm_up_steps) return false;
  return (step - s.warm_up_steps + 1) % s.select_interval == 0;
}

bool is_update_boundary(const schedule& s, std::uint64_t step) {
  if (step < s.warm_up_steps) return true;  // warm-up steps are full updates
  if (!s.update_interval) return is_select_boundary(s, step);
  return (step - s.warm_up_steps + 1) % *s.update_interval == 0;
}

const char* to_string(importance_norm n) { return n == importance_norm::l1 ? "l1" : "l2"; }

const char* to_string(select_strategy s) {
  switch (s) {
    case select_strategy::automatic: return "auto";
    case select_strategy::step: return "step";
    case select_strategy::epoch: return "epoch";
  }
  return "?";
}

}  // namespace tierflow::zenflow
