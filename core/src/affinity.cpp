#include "tierflow/core/affinity.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow {

std::vector<int> current_affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  TF_CHECK_SYSCALL(::sched_getaffinity(0, sizeof set, &set), error_context{"sched_getaffinity"});
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

core_split split_cores(double reserved_share) {
  if (!(reserved_share >= 0 && reserved_share < 1))
    throw user_error("pt_reserved_cores_perc: " + std::to_string(reserved_share) + " is outside [0, 1)");
  const std::vector<int> cpus = current_affinity();
  core_split split;
  if (cpus.size() <= 1) {
    split.trainer = cpus;
    split.optimizer = cpus;
    return split;
  }
  auto trainer = static_cast<std::size_t>(std::lround(reserved_share * static_cast<double>(cpus.size())));
  if (reserved_share > 0) trainer = std::max<std::size_t>(trainer, 1);
  trainer = std::min(trainer, cpus.size() - 1);  // the optimizer keeps at least one
  split.trainer.assign(cpus.begin(), cpus.begin() + static_cast<std::ptrdiff_t>(trainer));
  split.optimizer.assign(cpus.begin() + static_cast<std::ptrdiff_t>(trainer), cpus.end());
  return split;
}

namespace {

cpu_set_t cpu_set_of(std::span<const int> cpus, std::string& names) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) throw user_error("CPU " + std::to_string(c) + " is out of range");
    CPU_SET(c, &set);
    if (!names.empty()) names += ',';
    names += std::to_string(c);
  }
  return set;
}

}  // namespace

void pin_current_thread(std::span<const int> cpus) {
  std::string names;
  const cpu_set_t set = cpu_set_of(cpus, names);
  TF_CHECK_SYSCALL(::sched_setaffinity(0, sizeof set, &set), error_context{"sched_setaffinity"}.at("cpus " + names));
}

void pin_thread(std::thread::native_handle_type thread, std::span<const int> cpus) {
  std::string names;
  const cpu_set_t set = cpu_set_of(cpus, names);
  // pthread_setaffinity_np returns the error instead of setting errno.
  const int rc = ::pthread_setaffinity_np(thread, sizeof set, &set);
  if (rc != 0) throw error(rc, error_context{"pthread_setaffinity_np"}.at("cpus " + names));
}

}  // namespace tierflow
