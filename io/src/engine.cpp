#include "tierflow/io/engine.hpp"

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "detail/backends.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/io/probe.hpp"

namespace tierflow::io {

const char* to_string(backend_kind kind) noexcept {
  switch (kind) {
    case backend_kind::automatic: return "auto";
    case backend_kind::uring: return "uring";
    case backend_kind::threads: return "threads";
  }
  return "?";
}

backend_kind parse_backend(const std::string& text, const std::string& what) {
  if (text == "auto") return backend_kind::automatic;
  if (text == "uring" || text == "io_uring") return backend_kind::uring;
  if (text == "threads") return backend_kind::threads;
  throw user_error(what + ": '" + text + "' is not one of auto, uring, threads");
}

namespace {

// The range of each setting, named as the caller knows it: validate() uses the
// CLI's words ("block size"), parse_config() the config key it read the value
// from ("aio.block_size"), so an error names what the user typed.
void check_threads(std::uint64_t v, const std::string& name) {
  if (v < 1 || v > 256) throw user_error(name + ": " + std::to_string(v) + " is not in 1..256");
}

void check_queue_depth(std::uint64_t v, const std::string& name) {
  if (v < 1 || v > 4096) throw user_error(name + ": " + std::to_string(v) + " is not in 1..4096");
}

void check_block_size(std::uint64_t v, const std::string& name) {
  if (v == 0 || v % file::offset_alignment != 0 || v > (1u << 30)) {
    throw user_error(name + ": " + std::to_string(v) + " is not a multiple of 4096 between 4 KiB and 1 GiB");
  }
}

void check_submit_batch(std::uint64_t v, const std::string& name) {
  if (v > 4096) throw user_error(name + ": " + std::to_string(v) + " is over 4096");
}

}  // namespace

void validate(const engine_config& c) {
  check_threads(c.threads, "threads");
  check_queue_depth(c.queue_depth, "queue depth");
  check_block_size(c.block_size, "block size");
  check_submit_batch(c.submit_batch, "submit batch");
  if (c.max_registered_files < 1 || c.max_registered_files > 32768 || c.max_registered_buffers < 1 ||
      c.max_registered_buffers > 16384) {
    throw user_error("registered file / buffer table sizes out of range");
  }
}

// ---- registrations ------------------------------------------------------------

file_registration::file_registration(engine* owner, const file* f, int slot) noexcept
    : engine_(owner), file_(f), slot_(slot) {}

file_registration::file_registration(file_registration&& other) noexcept
    : engine_(std::exchange(other.engine_, nullptr)),
      file_(std::exchange(other.file_, nullptr)),
      slot_(std::exchange(other.slot_, -1)) {}

file_registration& file_registration::operator=(file_registration&& other) noexcept {
  if (this != &other) {
    reset();
    engine_ = std::exchange(other.engine_, nullptr);
    file_ = std::exchange(other.file_, nullptr);
    slot_ = std::exchange(other.slot_, -1);
  }
  return *this;
}

file_registration::~file_registration() { reset(); }

void file_registration::reset() noexcept {
  if (engine_ != nullptr) {
    file* f = const_cast<file*>(file_);
    // Stop new requests from using the slot before the rings drop it.
    f->registered_by_.store(nullptr, std::memory_order_release);
    f->registered_slot_.store(-1, std::memory_order_relaxed);
    engine_->unregister_file(*file_, slot_);
    engine_ = nullptr;
    file_ = nullptr;
    slot_ = -1;
  }
}

buffer_registration::buffer_registration(engine* owner, std::span<std::byte> memory, int index,
                                         bool fixed) noexcept
    : engine_(owner), memory_(memory), index_(index), fixed_(fixed) {}

buffer_registration::buffer_registration(buffer_registration&& other) noexcept
    : engine_(std::exchange(other.engine_, nullptr)),
      memory_(std::exchange(other.memory_, {})),
      index_(std::exchange(other.index_, -1)),
      fixed_(std::exchange(other.fixed_, false)) {}

buffer_registration& buffer_registration::operator=(buffer_registration&& other) noexcept {
  if (this != &other) {
    reset();
    engine_ = std::exchange(other.engine_, nullptr);
    memory_ = std::exchange(other.memory_, {});
    index_ = std::exchange(other.index_, -1);
    fixed_ = std::exchange(other.fixed_, false);
  }
  return *this;
}

buffer_registration::~buffer_registration() { reset(); }

void buffer_registration::reset() noexcept {
  if (engine_ != nullptr) {
    engine_->unregister_buffer(index_);
    engine_ = nullptr;
    memory_ = {};
    index_ = -1;
    fixed_ = false;
  }
}

file_registration engine::make_file_registration(const file& f, int slot) noexcept {
  file& mutable_file = const_cast<file&>(f);
  mutable_file.registered_slot_.store(slot, std::memory_order_relaxed);
  // Release: a thread that sees this engine in registered_by_ sees the slot.
  mutable_file.registered_by_.store(this, std::memory_order_release);
  return file_registration(this, &f, slot);
}

buffer_registration engine::make_buffer_registration(std::span<std::byte> memory, int index,
                                                     bool fixed) noexcept {
  return buffer_registration(this, memory, index, fixed);
}

// ---- synchronous helpers --------------------------------------------------------

void engine::read(const file& f, std::uint64_t offset, std::span<std::byte> into) {
  operation op;
  op.prepare_read(f, offset, into);
  submit(op);
  op.wait();
}

void engine::write(const file& f, std::uint64_t offset, std::span<const std::byte> from) {
  operation op;
  op.prepare_write(f, offset, from);
  submit(op);
  op.wait();
}

// ---- the factory --------------------------------------------------------------

std::unique_ptr<engine> make_engine(const engine_config& config) {
  validate(config);
  switch (config.backend) {
    case backend_kind::threads:
      return detail::make_thread_engine(config);
    case backend_kind::uring: {
      const uring_capabilities& caps = probe_uring();
      if (!caps.available) {
        throw error(ENOSYS, error_context{"io_uring backend: " + caps.reason});
      }
      return detail::make_uring_engine(config);
    }
    case backend_kind::automatic: {
      if (probe_uring().available) {
        try {
          return detail::make_uring_engine(config);
        } catch (const error&) {
          // A ring the probe could set up but this configuration cannot
          // (e.g. memory limits for many rings): the thread pool still works.
        }
      }
      return detail::make_thread_engine(config);
    }
  }
  throw user_error("unknown backend");
}

// ---- the config snippet ---------------------------------------------------------

std::string config_snippet(const engine_config& c) {
  nlohmann::ordered_json j;
  j["aio"] = {{"block_size", c.block_size},
              {"queue_depth", c.queue_depth},
              {"intra_op_parallelism", c.threads},
              {"single_submit", c.submit_batch == 1},
              {"overlap_events", true}};
  j["io"] = {{"backend", to_string(c.backend)}, {"sqpoll", c.sqpoll}, {"submit_batch", c.submit_batch}};
  return j.dump(2) + "\n";
}

engine_config parse_config(const std::string& text, engine_config base) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw user_error(std::string("config: not JSON (") + e.what() + ")");
  }
  if (!j.is_object()) throw user_error("config: expected a JSON object");
  // Reads `key` of `section` into `out` when present, checked by `check` under
  // its dotted name before it is narrowed to `out`'s type.
  auto unsigned_key = [](const nlohmann::json& section, const char* key, const std::string& where, auto& out,
                         void (*check)(std::uint64_t, const std::string&)) {
    if (!section.contains(key)) return;
    const nlohmann::json& v = section[key];
    const std::string name = where + "." + key;
    if (!v.is_number_unsigned()) throw user_error(name + ": " + v.dump() + " is not a whole number");
    check(v.get<std::uint64_t>(), name);
    out = v.get<std::remove_reference_t<decltype(out)>>();
  };
  if (j.contains("aio")) {
    const nlohmann::json& aio = j["aio"];
    if (!aio.is_object()) throw user_error("config: aio: expected an object");
    unsigned_key(aio, "block_size", "aio", base.block_size, check_block_size);
    unsigned_key(aio, "queue_depth", "aio", base.queue_depth, check_queue_depth);
    unsigned_key(aio, "thread_count", "aio", base.threads, check_threads);  // DeepSpeed's older name
    unsigned_key(aio, "intra_op_parallelism", "aio", base.threads, check_threads);
    if (aio.contains("single_submit")) {
      if (!aio["single_submit"].is_boolean())
        throw user_error("aio.single_submit: " + aio["single_submit"].dump() + " is not true or false");
      if (aio["single_submit"].get<bool>()) base.submit_batch = 1;
    }
    if (aio.contains("overlap_events")) {
      // DeepSpeed's false submits queue_depth requests and waits for all of
      // them before submitting more. Both backends always refill the queue as
      // each request completes, which is what true means; a config asking for
      // the lockstep would otherwise be run with a behaviour it did not ask for.
      if (!aio["overlap_events"].is_boolean())
        throw user_error("aio.overlap_events: " + aio["overlap_events"].dump() + " is not true or false");
      if (!aio["overlap_events"].get<bool>())
        throw user_error(
            "aio.overlap_events: false (wait for a whole batch before submitting more) is not supported; "
            "tierflow submits the next request as each one completes, as true does");
    }
  }
  if (j.contains("io")) {
    const nlohmann::json& io = j["io"];
    if (!io.is_object()) throw user_error("config: io: expected an object");
    if (io.contains("backend")) {
      if (!io["backend"].is_string()) throw user_error("io.backend: expected a string");
      base.backend = parse_backend(io["backend"].get<std::string>(), "io.backend");
    }
    unsigned_key(io, "submit_batch", "io", base.submit_batch, check_submit_batch);
    if (io.contains("sqpoll")) {
      if (!io["sqpoll"].is_boolean()) throw user_error("io.sqpoll: expected true or false");
      base.sqpoll = io["sqpoll"].get<bool>();
    }
  }
  validate(base);
  return base;
}

engine_config read_config(const std::string& path, engine_config base) {
  std::ifstream in(path);
  if (!in) throw user_error("config " + path + ": cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return parse_config(text.str(), std::move(base));
  } catch (const user_error& e) {
    throw user_error("config " + path + ": " + e.what());
  }
}

}  // namespace tierflow::io
