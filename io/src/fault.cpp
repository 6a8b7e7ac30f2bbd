#include "tierflow/io/fault.hpp"

namespace tierflow::io {

void fault_injector::add(const fault_rule& rule) {
  lock_guard lock(mutex_);
  rules_.push_back({rule, 0});
}

void fault_injector::clear() {
  lock_guard lock(mutex_);
  rules_.clear();
  fired_ = 0;
}

fault_decision fault_injector::decide(op_kind kind, const std::string& path, std::uint64_t offset,
                                      std::uint64_t length) {
  fault_decision decision{0, length};
  lock_guard lock(mutex_);
  for (armed_rule& armed : rules_) {
    const fault_match& m = armed.rule.match;
    if (m.kind && *m.kind != kind) continue;
    if (!m.path_contains.empty() && path.find(m.path_contains) == std::string::npos) continue;
    if (offset < m.offset_from || offset >= m.offset_to) continue;
    const std::uint64_t n = ++armed.seen;
    if (n < armed.rule.nth || n >= armed.rule.nth + armed.rule.times) continue;
    ++fired_;
    if (armed.rule.action.errnum != 0) {
      decision.errnum = armed.rule.action.errnum;
    } else if (armed.rule.action.short_by > 0) {
      // Keep at least one byte, so the request still makes progress.
      const std::uint64_t cut = armed.rule.action.short_by < length ? armed.rule.action.short_by : length - 1;
      decision.length = length - cut;
    }
    return decision;
  }
  return decision;
}

std::uint64_t fault_injector::fired() const {
  lock_guard lock(mutex_);
  return fired_;
}

}  // namespace tierflow::io
