// Host memory for the tiers: one region per tier, mapped at its exact size
// (page-aligned, never rounded to a power of two), placed on a NUMA node,
// pre-touched by several threads, optionally backed by huge pages, and pinned
// once — so nothing is pinned, faulted or registered on the hot path.
//
// Pinning policy (pinning::automatic):
//   * a CUDA build with a usable device: cudaHostRegister, so copy engines DMA
//     straight from it;
//   * otherwise mlock;
//   * when mlock is refused (RLIMIT_MEMLOCK too small, no CAP_IPC_LOCK) the
//     region stays unpinned, and pinned_by() == "none" with pin_note() saying
//     why — reported in the tier's telemetry, never silent.
// pinning::mlock and pinning::cuda are requirements: failure throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace tierflow::tiers {

enum class huge_pages : unsigned char {
  off,          // 4 KiB pages
  transparent,  // madvise(MADV_HUGEPAGE): the kernel backs it with 2 MiB pages where it can
  hugetlb,      // MAP_HUGETLB from the reserved pool, falling back to transparent when empty
};

enum class pinning : unsigned char { automatic, cuda, mlock, none };

struct host_region_options {
  std::uint64_t bytes = 0;             // rounded up to the page size (4 KiB, or 2 MiB with hugetlb)
  huge_pages pages = huge_pages::transparent;
  int numa_node = -1;                  // bind here; -1: the node nearest the GPU when known, else none
  bool pre_touch = true;               // fault every page in now, in parallel
  unsigned touch_threads = 0;          // 0: one per CPU this process may use
  pinning pin = pinning::automatic;
  int cuda_device = 0;                 // for pinning by cudaHostRegister
};

// Owns the mapping (and its pinning). Move-only; the destructor unpins and
// unmaps, logging rather than throwing on failure.
class host_region {
 public:
  // Maps, binds, touches and pins as `options` say. Throws user_error for a
  // zero size, tierflow::error when mmap fails or a required pinning fails.
  static host_region map(const host_region_options& options);

  host_region() noexcept = default;
  host_region(host_region&& other) noexcept;
  host_region& operator=(host_region&& other) noexcept;
  host_region(const host_region&) = delete;
  host_region& operator=(const host_region&) = delete;
  ~host_region();

  std::byte* data() const noexcept { return data_; }
  std::uint64_t size() const noexcept { return size_; }
  std::span<std::byte> bytes() const noexcept { return {data_, static_cast<std::size_t>(size_)}; }

  // "cuda_host_register", "mlock" or "none".
  const std::string& pinned_by() const noexcept { return pinned_by_; }
  // Why the region is unpinned, when pinning was wanted but refused.
  const std::string& pin_note() const noexcept { return pin_note_; }
  // "hugetlb", "transparent", "off".
  const std::string& page_backing() const noexcept { return page_backing_; }
  int numa_node() const noexcept { return numa_node_; }  // -1: not bound
  double touch_seconds() const noexcept { return touch_seconds_; }
  double pin_seconds() const noexcept { return pin_seconds_; }

 private:
  void reset() noexcept;

  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
  std::string pinned_by_ = "none";
  std::string pin_note_;
  std::string page_backing_ = "off";
  int numa_node_ = -1;
  int cuda_device_ = 0;
  double touch_seconds_ = 0;
  double pin_seconds_ = 0;
};

// Whether this process sees a usable CUDA device (a CUDA build with a driver
// and at least one device). Cached after the first call.
bool cuda_device_present();

}  // namespace tierflow::tiers
