// tierflow._core.Store: the first, thin face of the block store (the tiers
// with their budgets and the blocks homed in them). The logic stays in C++.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "bindings.hpp"
#include "tierflow/core/block.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tierflow::python {
namespace {

class store_handle {
 public:
  // A host tier of `host_budget` bytes and, with `nvme_dir`, an NVMe tier of
  // `nvme_budget` bytes of preallocated files in that directory.
  store_handle(std::uint64_t host_budget, const std::optional<std::string>& nvme_dir,
               std::uint64_t nvme_budget) {
    tiers::store_config config;
    config.host = tiers::host_tier_options{.budget = host_budget};
    if (nvme_dir) config.nvme = tiers::nvme_tier_options{.directory = *nvme_dir, .budget = nvme_budget};
    nb::gil_scoped_release unlocked;  // maps and touches the host region, probes the directory
    store_ = tiers::make_store(std::move(config));
  }

  ~store_handle() {
    nb::gil_scoped_release unlocked;  // the store waits for the transfers in flight
    store_.reset();
  }
  store_handle(const store_handle&) = delete;
  store_handle& operator=(const store_handle&) = delete;

  // Creates a block of `size_bytes` homed in `home` ("host" or "nvme").
  std::uint32_t create_block(const std::string& name, std::uint64_t size_bytes,
                             const std::string& home) {
    block_desc desc{.name = name, .size_bytes = size_bytes, .home = parse_tier_kind(home, "home")};
    nb::gil_scoped_release unlocked;  // an NVMe home may preallocate a file
    return store_->create_block(std::move(desc)).value;
  }

  std::size_t block_count() const { return store_->block_count(); }

  // The store's counters, as the JSON the CLI prints, parsed into a dict.
  nb::dict telemetry() const {
    return nb::cast<nb::dict>(nb::module_::import_("json").attr("loads")(store_->telemetry_json()));
  }

 private:
  std::unique_ptr<block_store> store_;
};

}  // namespace

void bind_store(nb::module_& m) {
  nb::class_<store_handle>(m, "Store",
      "A block store over a host tier of `host_budget` bytes and, when `nvme_dir` is given,\n"
      "an NVMe tier of `nvme_budget` bytes of files preallocated in that directory.")
      .def(nb::init<std::uint64_t, const std::optional<std::string>&, std::uint64_t>(),
           "host_budget"_a, "nvme_dir"_a = nb::none(), "nvme_budget"_a = 0)
      .def("create_block", &store_handle::create_block, "name"_a, "size_bytes"_a, "home"_a = "host",
           "Creates a block of `size_bytes` homed in `home` ('host' or 'nvme') and returns its id.\n"
           "Raises BudgetError when the home tier's budget cannot hold it, TierflowError when\n"
           "its storage cannot be made (e.g. ENOSPC preallocating its NVMe file).")
      .def_prop_ro("block_count", &store_handle::block_count)
      .def("telemetry", &store_handle::telemetry, "The store's counters, per tier and link.");
}

}  // namespace tierflow::python
