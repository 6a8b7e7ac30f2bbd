// offloaded_state: the store, slots, checkpoint and lifetime of an optimizer's
// state on NVMe (see offloaded_state.hpp).
#include "offloaded_state.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "tierflow/core/block.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/tiers/checkpoint.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace nb = nanobind;

namespace tierflow::python {
namespace {

// No budget on NVMe but the filesystem's free space (ENOSPC names the file).
constexpr std::uint64_t unbounded_nvme = 1ull << 60;

}  // namespace

std::uint64_t host_memory_of(const std::variant<std::uint64_t, std::string>& given, std::uint64_t minimum,
                             const std::string& minimum_note) {
  const std::uint64_t bytes = std::holds_alternative<std::string>(given)
                                  ? parse_size(std::get<std::string>(given), "host_memory")
                                  : std::get<std::uint64_t>(given);
  if (bytes < minimum)
    throw user_error("host_memory: " + format_bytes(double(bytes)) + " is below the minimum of " +
                     format_bytes(double(minimum)) + minimum_note);
  return bytes / block_alignment * block_alignment;
}

std::unique_ptr<block_store> make_offload_store(const std::string& nvme_dir, std::uint64_t host_memory,
                                                std::uint64_t file_size, const io::engine_config& io) {
  tiers::store_config config;
  config.host = tiers::host_tier_options{.budget = host_memory};
  config.nvme = tiers::nvme_tier_options{.directory = nvme_dir,
                                         .budget = unbounded_nvme,
                                         .file_size = std::max<std::uint64_t>(aligned_size(file_size), block_alignment),
                                         .io = io};
  config.store.trace = false;  // a trace grows with every transfer: not for a training run's life
  return tiers::make_store(std::move(config));
}

offloaded_state::offloaded_state(const std::string& nvme_dir,
                                 const std::variant<std::uint64_t, std::string>& host_memory_given,
                                 std::uint64_t file_size, std::vector<std::string> key_names,
                                 const std::string& minimum_note, const std::optional<nb::dict>& aio) {
  host_memory_ = host_memory_of(host_memory_given, minimum_host_memory, minimum_note);
  if (aio) io_ = parse_engine_options(*aio);
  const std::uint64_t sub_group = host_memory_ / sub_groups_in_budget / block_alignment * block_alignment;
  nb::gil_scoped_release unlocked;  // maps and touches the host budget, opens the directory
  store_ = make_offload_store(nvme_dir, host_memory_, file_size, io_);
  state_ = std::make_unique<streamed_state>(*store_, std::move(key_names),
                                            streamed_state_options{.sub_group_bytes = sub_group});
  nvme_dir_ = nvme_dir;
}

offloaded_state::~offloaded_state() {
  nb::gil_scoped_release unlocked;  // the store waits for the transfers in flight, then removes its files
  state_.reset();
  store_.reset();
}

std::uint64_t save_store(block_store& store, const std::string& directory) {
  return tiers::write_checkpoint(store, directory).generation;
}

void load_store(block_store& store, const std::string& directory, std::uint64_t generation, const std::string& what) {
  const std::uint64_t found = tiers::read_checkpoint_manifest(directory).generation;
  if (found != generation)
    throw user_error(what + ": " + directory + " holds checkpoint " + std::to_string(found) + " of the state, not " +
                     std::to_string(generation) + " (a save interrupted between its two files)");
  tiers::restore_checkpoint(store, directory);
  store.flush();
}

std::uint64_t offloaded_state::save(const std::string& directory) {
  nb::gil_scoped_release unlocked;
  std::lock_guard lock(mutex_);
  require_open();
  return save_store(*store_, directory);
}

void offloaded_state::load(const std::string& directory, std::uint64_t generation) {
  nb::gil_scoped_release unlocked;
  std::lock_guard lock(mutex_);
  require_open();
  load_store(*store_, directory, generation, "load_state");
}

void offloaded_state::close() {
  nb::gil_scoped_release unlocked;
  std::lock_guard lock(mutex_);
  if (!store_) return;
  store_->close();
  state_.reset();
  store_.reset();
  release();
}

nb::dict offloaded_state::telemetry() {
  std::string json;
  {
    std::lock_guard lock(mutex_);
    require_open();
    json = store_->telemetry_json();
  }
  return nb::cast<nb::dict>(nb::module_::import_("json").attr("loads")(json));
}

std::uint64_t offloaded_state::sub_group_bytes() {
  std::lock_guard lock(mutex_);
  require_open();
  return state_->sub_group_bytes();
}

std::uint64_t offloaded_state::nvme_bytes() {
  std::lock_guard lock(mutex_);
  require_open();
  return state_->home_bytes();
}

bool offloaded_state::closed() {
  std::lock_guard lock(mutex_);
  return !store_;
}

std::size_t offloaded_state::slot_count() {
  std::lock_guard lock(mutex_);
  return tensors_.size();
}

void offloaded_state::require_open() const {
  if (!store_) throw user_error("the optimizer's NVMe state was closed");
}

std::size_t offloaded_state::add_slot(std::uint64_t elements, std::span<const std::size_t> keys) {
  require_open();
  const std::string name = "p" + std::to_string(attempts_++);
  std::size_t tensor = 0;
  {
    nb::gil_scoped_release unlocked;  // preallocates files
    tensor = state_->add_tensor(name, elements, keys);
  }
  tensors_.push_back(tensor);
  return tensors_.size() - 1;
}

std::size_t offloaded_state::tensor_at(std::size_t slot) const {
  if (slot >= tensors_.size())
    throw user_error("slot " + std::to_string(slot) + ": " + std::to_string(tensors_.size()) + " registered");
  return tensors_[slot];
}

bool offloaded_state::all_fresh(std::size_t tensor, std::size_t key) const {
  for (std::size_t c = 0; c < state_->chunk_count(tensor); ++c) {
    if (!state_->chunk_fresh(tensor, key, c)) return false;
  }
  return true;
}

bool offloaded_state::any_fresh(std::size_t tensor, std::size_t key) const {
  for (std::size_t c = 0; c < state_->chunk_count(tensor); ++c) {
    if (state_->chunk_fresh(tensor, key, c)) return true;
  }
  return false;
}

std::vector<bool> offloaded_state::fresh_chunks_of(std::size_t slot, std::size_t key) {
  std::lock_guard lock(mutex_);
  require_open();
  return state_->fresh_chunks(tensor_at(slot), key);
}

void offloaded_state::set_fresh_chunks_of(std::size_t slot, std::size_t key, std::vector<bool> fresh) {
  std::lock_guard lock(mutex_);
  require_open();
  state_->set_fresh_chunks(tensor_at(slot), key, std::move(fresh));
}

void offloaded_state::forget_key(std::size_t slot, std::size_t key) {
  std::lock_guard lock(mutex_);
  require_open();
  state_->forget(tensor_at(slot), key);
}

bool offloaded_state::key_written(std::size_t slot, std::size_t key) {
  std::lock_guard lock(mutex_);
  require_open();
  return state_->any_written(tensor_at(slot), key);
}

}  // namespace tierflow::python
