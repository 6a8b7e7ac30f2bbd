// Links every module through tierflow::tierflow and uses one call from each
// that exists, so a missing library or dependency in the package fails here.
#include <cstdio>

#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/core/version.hpp"
#include "tierflow/io/probe.hpp"
#include "tierflow/tiers/topology.hpp"

int main() {
  const auto host = tierflow::tiers::probe_host();
  const auto& uring = tierflow::io::probe_uring();
  std::printf("tierflow %s: %u cpus, io_uring %s, %s\n", tierflow::version, host.cpus,
              uring.available ? "yes" : "no", tierflow::format_bytes(4096).c_str());
  return host.cpus > 0 ? 0 : 1;
}
