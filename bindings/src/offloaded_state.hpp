// What tierflow._core.OffloadedAdam and OffloadedMuon share: optimizer state
// in files of the user's directory, streamed through a bounded host budget.
//
// The store is a pinned host tier of exactly the budget and an NVMe tier of
// files in the directory (tiers/), the state over it chunked and pipelined
// (core/streamed_state.hpp). This class owns both, the registered parameters
// (slots) and their tensors, the checkpoint and the lifetime; the optimizers
// derive from it and add their keys' meaning and their step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "bindings.hpp"
#include "tierflow/core/store.hpp"
#include "tierflow/core/streamed_state.hpp"

namespace tierflow::python {

// The host budget holds this many sub-groups: the one updating, depth - 1 = 2
// loading, and one being written back.
inline constexpr std::uint64_t sub_groups_in_budget = 4;
// The smallest budget either optimizer takes: four sub-groups of a page for
// each of Adam's four state buffers, and the same for Muon, so that the Python
// classes check one number.
inline constexpr std::uint64_t minimum_host_memory = 64 << 10;

// The host budget `given` ("2G" as the CLI's size flags read it, or a byte
// count) in bytes, rounded down to a page. Refused below `minimum`, with
// `minimum_note` ending the message.
std::uint64_t host_memory_of(const std::variant<std::uint64_t, std::string>& given, std::uint64_t minimum,
                             const std::string& minimum_note);
// A store of a pinned host tier of `host_memory` bytes (a page multiple) and
// an NVMe tier of files of `file_size` in `nvme_dir`, bounded by the
// filesystem's free space alone (ENOSPC names the file), without a trace.
// Maps and touches the budget: call it with the GIL released.
// `io` is the NVMe tier's I/O engine (the config's aio section).
std::unique_ptr<block_store> make_offload_store(const std::string& nvme_dir, std::uint64_t host_memory,
                                                std::uint64_t file_size, const io::engine_config& io = {});
// Every block of `store` into a crash-safe checkpoint in `directory`
// (tiers/checkpoint.hpp), read through its host tier; returns its
// generation. No block may be written meanwhile. Call it with the GIL released.
std::uint64_t save_store(block_store& store, const std::string& directory);
// Restores the checkpoint in `directory` into `store` when it is of
// `generation` (what was saved beside it: another is a save interrupted
// between its two files, a user_error naming `what`), verified first so that
// nothing changes when it is refused, and sends the blocks home. Call it with
// the GIL released.
void load_store(block_store& store, const std::string& directory, std::uint64_t generation, const std::string& what);

class offloaded_state {
 public:
  // Makes the store of `nvme_dir` and `host_memory_given` ("2G" as the CLI's
  // size flags read it, or a byte count; rounded down to a page, sub-groups
  // of a quarter of it) with files of `file_size`, and the state of
  // `key_names` over it. A budget below the minimum is refused with
  // `minimum_note` ending the message; `aio` (parse_engine_options) sets the
  // NVMe tier's I/O engine. Releases the GIL while it maps the budget and
  // opens the directory.
  offloaded_state(const std::string& nvme_dir, const std::variant<std::uint64_t, std::string>& host_memory_given,
                  std::uint64_t file_size, std::vector<std::string> key_names, const std::string& minimum_note,
                  const std::optional<nanobind::dict>& aio = std::nullopt);
  // The store waits for the transfers in flight, then removes its files.
  virtual ~offloaded_state();
  offloaded_state(const offloaded_state&) = delete;
  offloaded_state& operator=(const offloaded_state&) = delete;

  // Every block of the state into a crash-safe checkpoint in `directory`
  // (tiers/checkpoint.hpp), read through the host budget; returns its generation.
  std::uint64_t save(const std::string& directory);
  // Restores the checkpoint of generation `generation` in `directory` into the
  // state's blocks (verified first: nothing changes when it is refused), and
  // sends them home.
  void load(const std::string& directory, std::uint64_t generation);
  // Flushes and closes the store, removes its files and frees what release()
  // frees. Idempotent.
  void close();
  // The store's counters, as the dict its JSON reads as.
  nanobind::dict telemetry();

  std::uint64_t host_memory() const noexcept { return host_memory_; }
  std::uint64_t sub_group_bytes();
  std::uint64_t nvme_bytes();
  const std::string& nvme_dir() const noexcept { return nvme_dir_; }
  // The I/O engine the NVMe tier was built with (engine_options_of).
  nanobind::dict io_config() const { return engine_options_of(io_); }
  bool closed();
  std::size_t slot_count();

 protected:
  // What a derived class holds besides the store and frees when closed
  // (called with mutex_ held, the store gone).
  virtual void release() {}

  void require_open() const;
  // Registers a tensor of `elements` with buffers for `keys` under a fresh
  // name and returns its slot; mutex_ held (the GIL is released here while
  // its files are preallocated). A failure registers nothing.
  std::size_t add_slot(std::uint64_t elements, std::span<const std::size_t> keys);
  std::size_t tensor_at(std::size_t slot) const;
  std::size_t slots() const noexcept { return tensors_.size(); }
  bool all_fresh(std::size_t tensor, std::size_t key) const;
  bool any_fresh(std::size_t tensor, std::size_t key) const;

  // The per-slot queries of key `key`, each under mutex_.
  std::vector<bool> fresh_chunks_of(std::size_t slot, std::size_t key);
  void set_fresh_chunks_of(std::size_t slot, std::size_t key, std::vector<bool> fresh);
  void forget_key(std::size_t slot, std::size_t key);
  bool key_written(std::size_t slot, std::size_t key);

  std::mutex mutex_;  // one step, read or write at a time (taken with the GIL released)
  std::unique_ptr<block_store> store_;
  std::unique_ptr<streamed_state> state_;  // over *store_

 private:
  std::vector<std::size_t> tensors_;  // per slot, its tensor in state_
  // A fresh name each registration: one that failed (ENOSPC) may have left
  // some of its blocks behind under the name it tried.
  std::size_t attempts_ = 0;
  std::uint64_t host_memory_ = 0;
  std::string nvme_dir_;
  io::engine_config io_;
};

// The methods and properties of offloaded_state, with their docstrings, onto
// the class binding an optimizer derived from it.
template <class T>
void def_offloaded_state(nanobind::class_<T>& c) {
  using namespace nanobind::literals;
  c.def("save", &T::save, "directory"_a,
        "Writes every state block into tierflow's crash-safe checkpoint in `directory`\n"
        "(manifest.json and blocks-<n>.bin, checksummed), through the host budget; returns\n"
        "its generation.")
      .def("load", &T::load, "directory"_a, "generation"_a,
           "Restores checkpoint `generation` of `directory` (written by save() of an optimizer\n"
           "of the same layout) into the state, through the host budget; refuses (nothing\n"
           "changed) another generation, a corrupt checkpoint or one of other blocks.")
      .def("close", &T::close, "Flushes, then removes the state's files. Idempotent.")
      .def("telemetry", &T::telemetry, "The store's counters, per tier and link.")
      .def_prop_ro("host_memory", &T::host_memory)
      .def_prop_ro("nvme_bytes", &T::nvme_bytes)
      .def_prop_ro("nvme_dir", &T::nvme_dir)
      .def("io_config", &T::io_config,
           "The I/O engine the state's NVMe tier was built with: {'block_size', 'queue_depth',\n"
           "'threads', 'submit_batch'}.")
      .def_prop_ro("closed", &T::closed)
      .def_prop_ro("slot_count", &T::slot_count);
}

}  // namespace tierflow::python
