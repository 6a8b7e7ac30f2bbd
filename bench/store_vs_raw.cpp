// Measures what the block store costs on top of raw I/O: blocks streamed
// host -> NVMe -> host through the store (write leases released dirty and
// evicted, then read back with prefetch ahead), beside `tierflow bench io`'s
// raw sequential write and read of the same bytes with the same engine
// settings, in the same run; and the time to pin host memory the store's way
// (exact-size mmap, parallel pre-touch, huge pages, one mlock or
// cudaHostRegister) beside a plain single-threaded mlock of the same size.
//
//   tierflow_store_vs_raw --dir /nvme/scratch [--total 1G] [--block 8M]
//       [--host-memory 256M] [--pin-size 4G | --skip-pin] [--json]
#include <sys/mman.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/io_runner.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/tiers/host_memory.hpp"
#include "tierflow/tiers/tiers.hpp"

namespace {

using namespace tierflow;
using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

struct options {
  std::string dir;
  std::string total = "1G";
  std::string block = "8M";
  std::string chunk = "1M";
  unsigned queue_depth = 32;
  std::string host_memory = "256M";
  unsigned links = 4;
  unsigned repeats = 2;
  std::string pin_size = "4G";
  unsigned pin_threads = 0;
  std::string pin_pages = "transparent";
  bool skip_pin = false;
  bool pin_only = false;
  bool as_json = false;
};

struct store_figures {
  double write_bps = 0;
  double read_bps = 0;
  std::string telemetry;
};

// Streams every block through the host tier and back, twice over.
store_figures run_store(const options& o, std::uint64_t total, std::uint64_t block, const io::engine_config& engine) {
  tiers::store_config c;
  c.host = tiers::host_tier_options{.budget = parse_size(o.host_memory, "--host-memory")};
  c.nvme = tiers::nvme_tier_options{.directory = o.dir + "/store", .budget = total + block,
                                    .file_size = std::max<std::uint64_t>(block, 1ull << 30)};
  c.nvme->io = engine;
  c.nvme_link_engines = o.links;
  c.store.trace = false;
  auto store = tiers::make_store(std::move(c));
  const std::uint64_t n = total / block;
  std::vector<block_id> ids;
  for (std::uint64_t i = 0; i < n; ++i)
    ids.push_back(store->create_block({.name = "b" + std::to_string(i), .size_bytes = block, .home = tier_kind::nvme}));
  const std::uint64_t fits = store->tier_of(tier_kind::host).budget() / block;
  if (fits < 2) throw user_error("--host-memory must hold at least two blocks");
  const std::uint64_t lookahead = std::min<std::uint64_t>(fits - 1, o.links * 2);

  store_figures out;
  for (unsigned r = 0; r < o.repeats; ++r) {
    // host -> NVMe: each block overwritten in the host tier, released dirty
    // and evicted: its write-back streams while the next ones are written.
    auto start = clock_type::now();
    for (std::uint64_t i = 0; i < n; ++i) {
      lease l = store->acquire(ids[i], tier_kind::host, access::overwrite);
      std::byte* p = l.wait().data();
      p[0] = std::byte(i);  // touch: the bytes are the pool's, already faulted in
      store->release(std::move(l), dirty::yes);
      store->evict(ids[i], tier_kind::host);
    }
    store->flush();
    out.write_bps = std::max(out.write_bps, double(n * block) / since(start));

    // NVMe -> host: prefetch `lookahead` blocks ahead, read, evict after use.
    start = clock_type::now();
    for (std::uint64_t i = 0; i < std::min(lookahead, n); ++i) store->prefetch(ids[i], tier_kind::host);
    for (std::uint64_t i = 0; i < n; ++i) {
      if (i + lookahead < n) store->prefetch(ids[i + lookahead], tier_kind::host);
      lease l = store->acquire(ids[i], tier_kind::host);
      if (l.wait()[0] != std::byte(i)) throw std::runtime_error("store returned the wrong bytes");
      store->release(std::move(l), dirty::no);
      store->evict(ids[i], tier_kind::host);
    }
    out.read_bps = std::max(out.read_bps, double(n * block) / since(start));
  }
  out.telemetry = store->telemetry_json();
  return out;
}

struct raw_figures {
  double write_bps = 0;
  double read_bps = 0;
  std::string engine;
};

raw_figures run_raw(const options& o, std::uint64_t total, const io::engine_config& engine) {
  raw_figures out;
  cli::io_job job;
  job.path = o.dir + "/raw.bin";
  job.size = total;
  job.engine = engine;
  for (unsigned r = 0; r < o.repeats; ++r) {
    job.pattern = cli::io_pattern::write;
    const cli::io_result w = cli::run_io_job(job);
    job.pattern = cli::io_pattern::read;
    const cli::io_result rd = cli::run_io_job(job);
    out.write_bps = std::max(out.write_bps, w.bytes_per_second);
    out.read_bps = std::max(out.read_bps, rd.bytes_per_second);
    out.engine = rd.engine;
  }
  std::filesystem::remove(job.path);
  return out;
}

struct pin_figures {
  std::uint64_t bytes = 0;
  double plain_mlock_seconds = 0;
  double store_seconds = 0;
  double store_touch_seconds = 0;
  double store_pin_seconds = 0;
  std::string pinned_by;
  std::string pages;
};

// Each repeat pins with the peer, then the store's way; the best of each is
// kept (the first touch of guest memory in a VM can cost the hypervisor's
// backing, whichever method comes first).
pin_figures run_pin(const options& o) {
  pin_figures out;
  out.bytes = parse_size(o.pin_size, "--pin-size");
  out.plain_mlock_seconds = out.store_seconds = 1e30;
  for (unsigned r = 0; r < std::max(1u, o.repeats); ++r) {
    {
      // The peer: one mmap and one mlock, which faults every page in on this thread.
      const auto start = clock_type::now();
      void* p = ::mmap(nullptr, out.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw_errno(errno, error_context{"mmap"}.range(0, out.bytes));
      if (::mlock(p, out.bytes) != 0) {
        const int err = errno;
        ::munmap(p, out.bytes);
        throw_errno(err, error_context{"mlock (raise RLIMIT_MEMLOCK or use a smaller --pin-size)"}.range(0, out.bytes));
      }
      out.plain_mlock_seconds = std::min(out.plain_mlock_seconds, since(start));
      ::munlock(p, out.bytes);
      ::munmap(p, out.bytes);
    }
    const tiers::huge_pages pages = o.pin_pages == "off"       ? tiers::huge_pages::off
                                    : o.pin_pages == "hugetlb" ? tiers::huge_pages::hugetlb
                                                               : tiers::huge_pages::transparent;
    const auto start = clock_type::now();
    tiers::host_region region = tiers::host_region::map({.bytes = out.bytes,
                                                         .pages = pages,
                                                         .touch_threads = o.pin_threads,
                                                         .pin = tiers::pinning::automatic});
    const double seconds = since(start);
    if (seconds < out.store_seconds) {
      out.store_seconds = seconds;
      out.store_touch_seconds = region.touch_seconds();
      out.store_pin_seconds = region.pin_seconds();
      out.pinned_by = region.pinned_by();
      out.pages = region.page_backing();
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  CLI::App app{"Block store streaming host->NVMe->host beside raw io; pinning beside plain mlock"};
  app.add_option("--dir", o.dir, "Scratch directory on the NVMe device")->required();
  app.add_option("--total", o.total, "Bytes streamed per pass")->capture_default_str();
  app.add_option("--block", o.block, "Block size")->capture_default_str();
  app.add_option("--chunk", o.chunk, "io engine request size (both runs)")->capture_default_str();
  app.add_option("--queue-depth", o.queue_depth, "io engine requests in flight (both runs)")->capture_default_str();
  app.add_option("--host-memory", o.host_memory, "Host tier budget")->capture_default_str();
  app.add_option("--links", o.links, "Transfers in flight on the host<->nvme links")->capture_default_str();
  app.add_option("--repeats", o.repeats, "Passes of each measurement; the best of each is reported")
      ->capture_default_str();
  app.add_option("--pin-size", o.pin_size, "Host memory to pin in the pinning comparison")->capture_default_str();
  app.add_option("--pin-threads", o.pin_threads, "Pre-touch threads (0: one per CPU)")->capture_default_str();
  app.add_option("--pin-pages", o.pin_pages, "off | transparent | hugetlb")->capture_default_str()
      ->check(CLI::IsMember({"off", "transparent", "hugetlb"}));
  app.add_flag("--skip-pin", o.skip_pin, "Skip the pinning comparison");
  app.add_flag("--pin-only", o.pin_only, "Only the pinning comparison");
  app.add_flag("--json", o.as_json, "One JSON object on stdout");
  CLI11_PARSE(app, argc, argv);

  try {
    const std::uint64_t total = parse_size(o.total, "--total");
    const std::uint64_t block = aligned_size(parse_size(o.block, "--block"));
    if (total < block) throw user_error("--total must hold at least one --block");
    std::filesystem::create_directories(o.dir);
    io::engine_config engine;
    engine.block_size = parse_size(o.chunk, "--chunk");
    engine.queue_depth = o.queue_depth;
    engine.threads = 1;

    raw_figures raw;
    store_figures store;
    if (!o.pin_only) {
      raw = run_raw(o, total / block * block, engine);
      store = run_store(o, total / block * block, block, engine);
    }
    pin_figures pin;
    if (!o.skip_pin) pin = run_pin(o);

    if (o.pin_only && o.skip_pin) throw user_error("--pin-only and --skip-pin leave nothing to do");
    nlohmann::json j = {
        {"total_bytes", total / block * block},
        {"block_bytes", block},
        {"engine", raw.engine},
        {"raw", {{"write_bytes_per_second", raw.write_bps}, {"read_bytes_per_second", raw.read_bps}}},
        {"store", {{"write_bytes_per_second", store.write_bps}, {"read_bytes_per_second", store.read_bps}}},
        {"ratio", {{"write", store.write_bps / raw.write_bps}, {"read", store.read_bps / raw.read_bps}}}};
    if (!o.skip_pin)
      j["pinning"] = {{"bytes", pin.bytes},
                      {"plain_mlock_seconds", pin.plain_mlock_seconds},
                      {"store_seconds", pin.store_seconds},
                      {"store_touch_seconds", pin.store_touch_seconds},
                      {"store_pin_seconds", pin.store_pin_seconds},
                      {"store_pinned_by", pin.pinned_by},
                      {"store_pages", pin.pages},
                      {"speedup", pin.plain_mlock_seconds / pin.store_seconds}};
    if (o.as_json) {
      j["store_telemetry"] = nlohmann::json::parse(store.telemetry);
      std::cout << j.dump(2) << '\n';
      return 0;
    }
    if (!o.pin_only) {
    std::printf("store vs raw io: %s in %s blocks, engine %s\n", format_bytes(double(total / block * block)).c_str(),
                format_bytes(double(block)).c_str(), raw.engine.c_str());
    std::printf("  %-6s %14s %14s %7s\n", "", "raw io", "store", "ratio");
    std::printf("  %-6s %14s %14s %6.2fx\n", "write", format_rate(raw.write_bps).c_str(),
                format_rate(store.write_bps).c_str(), store.write_bps / raw.write_bps);
    std::printf("  %-6s %14s %14s %6.2fx\n", "read", format_rate(raw.read_bps).c_str(),
                format_rate(store.read_bps).c_str(), store.read_bps / raw.read_bps);
    }
    if (!o.skip_pin) {
      std::printf("pinning %s of host memory\n", format_bytes(double(pin.bytes)).c_str());
      std::printf("  plain mmap + mlock (one thread): %7.3f s\n", pin.plain_mlock_seconds);
      std::printf("  store (%s pages, pre-touch, %s): %7.3f s (touch %.3f s, pin %.3f s)  %.2fx faster\n",
                  pin.pages.c_str(), pin.pinned_by.c_str(), pin.store_seconds, pin.store_touch_seconds,
                  pin.store_pin_seconds, pin.plain_mlock_seconds / pin.store_seconds);
    }
    return 0;
  } catch (const user_error& e) {
    std::fprintf(stderr, "tierflow_store_vs_raw: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tierflow_store_vs_raw: %s\n", e.what());
    return 1;
  }
}
